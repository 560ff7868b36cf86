"""A request's identity is worked out once: every caller of one request gets the same answer."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.requests import Request

from usage_limits.web import identity, settings
from usage_limits.web.errors import InvalidRequest, Unauthorized


def _scope(headers: dict[str, str], event: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/x", "query_string": b"",
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
            "aws.event": event or {}}


@pytest.fixture(autouse=True)
def cloud(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Cloud mode (no local user header), settings read afresh."""
    monkeypatch.setenv("ATTO_ENV", "dev")
    settings.cache_clear()
    yield
    settings.cache_clear()


def test_a_generated_request_id_is_the_same_for_every_caller_of_one_request() -> None:
    """Without a key or a gateway id, one request keeps one generated id; another gets another."""
    scope = _scope({})
    first = identity.request_id(Request(scope))
    assert first.startswith("g:")
    assert identity.request_id(Request(scope)) == first  # a second Request over the same scope
    assert identity.request_id(Request(_scope({}))) != first


def test_user_and_key_are_read_from_the_request_and_kept() -> None:
    """The JWT sub and the Idempotency-Key are found once and given to every later caller."""
    event = {"version": "2.0", "requestContext": {"requestId": "gw-1", "authorizer": {
        "jwt": {"claims": {"sub": "alice"}}}}}
    scope = _scope({"idempotency-key": "abc"}, event)
    assert identity.user_id(Request(scope)) == "alice"
    assert identity.request_id(Request(scope)) == "k:abc"
    event["requestContext"]["authorizer"]["jwt"]["claims"]["sub"] = "mallory"
    assert identity.user_id(Request(scope)) == "alice"
    assert identity.request_id(Request(_scope({}, event))) == "r:gw-1"


def test_errors_are_raised_to_every_caller() -> None:
    """No user and a malformed key raise their errors each time they are asked for."""
    scope = _scope({"idempotency-key": ""})
    for _ in range(2):
        with pytest.raises(Unauthorized):
            identity.user_id(Request(scope))
        with pytest.raises(InvalidRequest):
            identity.request_id(Request(scope))


@pytest.mark.parametrize(("field", "key"), [
    ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    ("8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    ('"a\\"b\\\\c"', 'a"b\\c'),                 # the draft's escapes
    ('"k";ttl=60', "k"),                        # parameters are ignored
    (' "k" ', "k"), ("k", "k"), ('a"b', 'a"b'),  # OWS; a bare key may hold a quote inside
    ('"' + "x" * 128 + '"', "x" * 128),
])
def test_an_idempotency_key_is_the_drafts_sf_string_or_bare(field: str, key: str) -> None:
    """The field is an RFC 9651 String (quoted, unescaped) or the bare key: one key, and
    the request id is ``k:`` and the key unquoted."""
    assert identity.idempotency_key(field) == key
    request = Request(_scope({"idempotency-key": field}))
    assert identity.request_id(request) == "k:" + key
    assert identity.response_id(request) == key


@pytest.mark.parametrize("field", ['"open', '""', '"a" "b"', '"k";', '"tab\there"', "",
                                   '"' + "x" * 129 + '"', "x" * 129, "caf\u00e9"])
def test_a_key_outside_the_published_format_is_refused(field: str) -> None:
    """A quoted field that is no sf-string, or a key that is empty, longer than 128 or not
    printable ASCII, is 400 invalid_request naming the Idempotency-Key."""
    with pytest.raises(InvalidRequest, match="Idempotency-Key"):
        identity.idempotency_key(field)
