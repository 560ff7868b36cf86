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
