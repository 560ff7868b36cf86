"""The docs test's comparison of shown answers with given ones: what a reader compares
differs, what ticks or is an id does not."""

from __future__ import annotations

from tests.shown_answers import (
    answer_differences,
    answers,
    charge,
    charge_differences,
    comment_differences,
)

SHOWN = """200 200
HTTP/1.1 429 Too Many Requests
retry-after: 3600
ratelimit: "1h";r=4;t=3599, "30d";r=904;t=2591999;atto-credit=0

{"error":{"code":"budget_exceeded","retry_after_s":3599.4,"remaining":4,"request_id":"a1"}}"""


def given(body: str, ratelimit: str = '"1h";r=4;t=3512, "30d";r=904;t=2591912') -> str:
    """curl -i's output for a 429 with ``body`` (CRLF header lines, more headers than shown)."""
    return ("HTTP/1.1 429 Too Many Requests\r\ndate: x\r\nretry-after: 3512\r\n"
            f"ratelimit: {ratelimit};atto-credit=0\r\nx-request-id: b2\r\n\r\n{body}")


def test_ids_instants_and_ticking_seconds_may_differ() -> None:
    """Another request id, retry_after_s, Retry-After and t= are no difference."""
    body = '{"error":{"code":"budget_exceeded","retry_after_s":3512.0,"remaining":4,' \
           '"request_id":"b2"}}'
    assert answer_differences(answers(SHOWN), answers(given(body))) == []


def test_counts_fields_and_header_values_a_reader_compares_differ() -> None:
    """A token count, a field not shown (request_id missing from the shown body) and a
    RateLimit r each differ."""
    shown = answers(SHOWN.replace(',"request_id":"a1"', ""))
    body = '{"error":{"code":"budget_exceeded","retry_after_s":1.0,"remaining":5,' \
           '"request_id":"b2"}}'
    found = answer_differences(shown, answers(given(body, '"1h";r=5;t=1, "30d";r=904;t=2')))
    assert any("ratelimit" in d for d in found)
    assert any("['request_id'] not shown" in d for d in found)
    assert any("remaining: shown 4, got 5" in d for d in found)


def test_a_comment_is_held_to_its_code_fields_and_cost() -> None:
    """The code after the status, each quoted JSON field (found at any depth) and the
    tokens the comment gives are compared with the call's answer and charge."""
    body = {"credit": 492, "events": [{"draws": [{"reference": "inv", "tokens": 8}]}]}
    comment = '# 200: "credit": 492, the last event "draws": [{"reference": "inv", "tokens": 8}]'
    assert comment_differences(comment, body) == []
    assert comment_differences(comment.replace("492", "491"), body) != []
    assert comment_differences("# refused: 400 invalid_request (bad)",
                               {"error": {"code": "budget_exceeded"}}) != []
    call = 'curl -H X-Atto-User: bob\nbefore "remaining":100\nratelimit: "1h";r=98;t=9\n'
    assert charge(call) == 2
    assert charge_differences("# 200: the salary distribution (2 tokens)", 2) == []
    assert charge_differences("# 200: the salary distribution (3 tokens)", 2) != []
    assert charge_differences("# refused: 429, nothing charged", 0) == []
