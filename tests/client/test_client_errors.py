"""Every error code the server sends has the client's typed exception, of the same status;
which of them the client retries; and the ``Usage`` fields the server reports."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from atto_cloud_client import AttoClient, EndedGrant, SupportRefund, Usage
from atto_cloud_client import exceptions as ex
from atto_cloud_client.testing import MockApi, error

from usage_limits.web import errors as server

STRUCTURED = "POST /v1/structured"
#: Server codes the client never meets: operator routes (IAM) only.
OPERATOR_ONLY = {"forbidden"}


def _server_errors() -> list[type[server.ApiError]]:
    """Every error class of the server's contract (``usage_limits.web.errors``), the base
    (500 ``internal_error``) included."""
    found: list[type[server.ApiError]] = []
    stack = [server.ApiError]
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


def test_every_server_code_has_a_client_exception_of_its_status() -> None:
    """The server's one table of codes (its error classes) is the client's: each code a
    user can meet maps to its own client class, with the server's status."""
    codes = {cls.code: cls.status for cls in _server_errors()} | {
        server.LIMITER_UNAVAILABLE_CODE: 503}
    for code, status in codes.items():
        if code in OPERATOR_ONLY:
            continue
        cls = ex.BY_CODE.get(code)
        assert cls is not None, code
        assert cls.status_code in (status, None) or (code == "invalid_request"), code
        assert ex.error_class(status, code) is cls, code
    assert set(ex.BY_CODE) == set(codes) - OPERATOR_ONLY
    assert len(set(ex.BY_CODE.values())) == len(ex.BY_CODE)  # one class per code


class _Time:
    def __init__(self) -> None:
        self.now, self.slept = 0.0, []  # type: tuple[float, list[float]]

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _client(api: MockApi, time: _Time) -> AttoClient:
    return AttoClient(transport=api.transport, user="alice", sleep=time.sleep,
                      clock=time.clock, rand=lambda: 0.0)


@pytest.mark.parametrize(("status", "code", "cls", "field", "value"), [
    (422, "schema_rejected", ex.SchemaRejected, "reason", "unsupported keyword"),
    (422, "model_refused", ex.ModelRefused, "refusal", "I can't help with that"),
    (422, "content_filtered", ex.ContentFiltered, None, None),
    (502, "output_truncated", ex.OutputTruncated, None, None),
    (503, "provider_quota_exceeded", ex.ProviderQuotaExceeded, "provider", "llm"),
])
def test_provider_refusals_are_typed_with_their_fields(status: int, code: str,
                                                       cls: type[ex.ApiError],
                                                       field: str | None,
                                                       value: str | None) -> None:
    """Each provider refusal raises its own class after one attempt, with its field."""
    api, time = MockApi(), _Time()
    extra: dict[str, Any] = {} if field is None else {field: value}
    api.queue(STRUCTURED, error(status, code, "refused", retry_after_s=60, **extra))
    with pytest.raises(cls) as raised:
        _client(api, time).structured("x", {"type": "object"})
    assert type(raised.value) is cls and raised.value.status == status
    if field is not None:
        assert getattr(raised.value, field) == value
    assert len(api.requests) == 1 and time.slept == []


def test_output_truncated_is_a_provider_error() -> None:
    """``output_truncated`` is caught by an ``except ProviderError`` written before it."""
    assert issubclass(ex.OutputTruncated, ex.ProviderError)


def test_provider_quota_exceeded_is_not_retried_but_provider_busy_is() -> None:
    """503 provider_quota_exceeded (the operator must pay) is raised at once, while 503
    provider_busy is retried under the same key until it is served."""
    api, time = MockApi(), _Time()
    api.queue(STRUCTURED, error(503, "provider_quota_exceeded", "out", retry_after_s=60,
                                provider="llm"))
    with pytest.raises(ex.ProviderQuotaExceeded):
        _client(api, time).structured("x", {"type": "object"})
    assert not issubclass(ex.ProviderQuotaExceeded, ex.ServiceUnavailable)
    assert len(api.requests) == 1 and time.slept == []
    api.queue(STRUCTURED, error(503, "provider_busy", "busy", retry_after_s=1))
    result = _client(api, time).structured("x", {"type": "object"})
    assert result.info.attempts == 2 and time.slept == [1.0]


def test_idempotency_answer_gone_is_typed_and_not_retried() -> None:
    """422 idempotency_answer_gone (served and charged once, its answer not kept) is its
    own class, raised after one attempt."""
    api, time = MockApi(), _Time()
    api.queue(STRUCTURED, error(422, "idempotency_answer_gone", "gone"))
    with pytest.raises(ex.IdempotencyAnswerGone) as raised:
        _client(api, time).structured("x", {"type": "object"}, idempotency_key="k")
    assert raised.value.request_id == "k" and len(api.requests) == 1


def test_usage_keeps_ended_grants_and_support_refunds() -> None:
    """``Usage`` keeps the server's ``ended_grants`` (with what each forfeited) and
    ``refunded`` (support refunds), instants as Unix time."""
    body = {"user_id": "alice", "plan": "default", "windows": [], "events": [], "prices": {},
            "credit": 0, "grants": [],
            "ended_grants": [{"reference": "inv-1", "kind": "paid", "tokens": 500,
                              "ended": "voided", "ended_at": "2026-12-02T16:51:27Z",
                              "forfeited": 500}],
            "refunded": [{"request_id": "k-9", "tokens": 8,
                          "refunded_at": "2026-12-02T17:00:00Z"},
                         {"request_id": "k-10", "tokens": None,
                          "refunded_at": "2026-12-02T17:01:00Z"}]}
    api, time = MockApi(), _Time()
    api.queue("GET /v1/usage", httpx.Response(200, json=body))
    usage = _client(api, time).usage()
    assert usage.ended_grants == (EndedGrant("inv-1", "paid", 500, "voided", 1796230287.0,
                                             500),)
    assert usage.refunded == (SupportRefund("k-9", 8, 1796230800.0),
                              SupportRefund("k-10", None, 1796230860.0))
    older = Usage.from_json({k: v for k, v in body.items()
                             if k not in ("ended_grants", "refunded")})
    assert older.ended_grants == () and older.refunded == ()


def test_the_budget_bar_shows_quota_and_credit_apart() -> None:
    """docs/client.md's budget bar, for a quota of 1000 with 972 left and 484 of credit,
    prints ``972/1000 + 484 credit`` (the quota's ``r`` counts the credit: 1456)."""
    from atto_cloud_client import RateLimitStatus

    status = RateLimitStatus.from_headers(httpx.Headers({
        "ratelimit-policy": '"1h";q=100;w=3600;atto-qu="tokens", '
                            '"30d";q=1000;w=2592000;atto-qu="tokens"',
        "ratelimit": '"1h";r=92;t=3512, "30d";r=1456;t=2591912;atto-credit=484'}))
    assert status is not None
    lines = []
    for w in status.windows:  # the example's loop, as docs/client.md shows it
        bar = "#" * round(20 * (w.fraction_left or 0))
        credit = f" + {w.credit} credit" if w.credit else ""
        lines.append(f"{w.name:>4} [{bar:<20}] {w.quota_remaining}/{w.limit}{credit}")
    assert lines == ["  1h [##################  ] 92/100",
                     " 30d [################### ] 972/1000 + 484 credit"]
