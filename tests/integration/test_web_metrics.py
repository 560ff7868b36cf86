"""The metrics a request writes, through a real Mangum handler and a real redis-server."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import Depends
from fastapi.responses import JSONResponse
from mangum import Mangum

from local.lambda_events import fresh_environment, http_event, invoke, lambda_loop
from local.redis_servers import RedisServer
from usage_limits.web import create_app, require_tokens
from usage_limits.web import observability as obs


def _handler() -> Any:
    app = create_app("metrics test")

    @app.post("/ok", dependencies=[Depends(require_tokens(cost=5))])
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/fails", dependencies=[Depends(require_tokens(cost=5))])
    async def fails() -> JSONResponse:
        return JSONResponse({"error": {"code": "provider_error", "message": "x"}},
                            status_code=502)

    return Mangum(app, lifespan="off")


def _environment(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    for name, value in {"REDIS_URL": redis_url, "ATTO_BUDGET": "10/1h", "ATTO_ENV": "dev",
                        "POWERTOOLS_SERVICE_NAME": "metered"}.items():
        monkeypatch.setenv(name, value)
    for name in ("POWERTOOLS_METRICS_DISABLED", "POWERTOOLS_DEV", "ATTO_EVENT_BUS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def emf(capsys: pytest.CaptureFixture[str]) -> Any:
    """A reader of the request EMF lines written since the last read (provider lines left out)."""
    capsys.readouterr()

    def lines() -> list[dict[str, Any]]:
        out = capsys.readouterr().out
        found = [json.loads(line) for line in out.splitlines() if '"_aws"' in line]
        return [line for line in found if obs.PROVIDER not in line]

    return lines


@pytest.fixture
def web(monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer) -> Iterator[Any]:
    """The metered app over the session's redis-server, metrics on."""
    _environment(monkeypatch, redis_server.url)
    fresh_environment()
    with lambda_loop():
        yield _handler()
    fresh_environment()


def _values(line: dict[str, Any], name: str) -> float:
    return float(sum(line.get(name, [0])))


def test_a_charged_request_counts_its_route_and_tokens(web: Any, emf: Any) -> None:
    """A 200 writes one line: Requests and TokensReserved under its route key and env."""
    user = uuid.uuid4().hex
    assert invoke(web, http_event("POST", "/ok", body={}, user=user)).status == 200
    (line,) = emf()
    assert (line[obs.ENV], line[obs.SERVICE_DIMENSION], line[obs.ROUTE]) == (
        "dev", "metered", "POST /ok")
    assert _values(line, obs.REQUESTS) == 1 and _values(line, obs.TOKENS_RESERVED) == 5
    assert obs.SERVER_ERRORS not in line and obs.CLIENT_ERRORS not in line


def test_a_failed_request_counts_the_error_and_the_refund(web: Any, emf: Any) -> None:
    """A 502 counts a server error and the refunded tokens; a 429 counts a client error."""
    user = uuid.uuid4().hex
    assert invoke(web, http_event("POST", "/fails", body={}, user=user)).status == 502
    assert invoke(web, http_event("POST", "/ok", body={}, user=user)).status == 200
    assert invoke(web, http_event("POST", "/ok", body={}, user=user)).status == 200
    assert invoke(web, http_event("POST", "/ok", body={}, user=user)).status == 429
    failed, _, _, rejected = emf()
    assert _values(failed, obs.SERVER_ERRORS) == 1 and _values(failed, obs.TOKENS_REFUNDED) == 5
    assert failed[obs.ROUTE] == "POST /fails"
    assert _values(rejected, obs.CLIENT_ERRORS) == 1 and _values(rejected, obs.BUDGET_REJECTED) == 1


def test_an_unreachable_limiter_counts_unavailable_and_a_kept_refund(
        monkeypatch: pytest.MonkeyPatch, emf: Any) -> None:
    """Redis down: the 503 limiter_unavailable is counted, and so is the refund kept for later."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    _environment(monkeypatch, f"redis://127.0.0.1:{closed}")
    monkeypatch.setenv("REDIS_SOCKET_TIMEOUT_S", "0.2")
    fresh_environment()
    try:
        with lambda_loop():
            res = invoke(_handler(), http_event("POST", "/ok", body={}, user="u"))
    finally:
        fresh_environment()
    assert res.status == 503 and res.body["error"]["code"] == "limiter_unavailable"
    (line,) = emf()
    assert _values(line, obs.LIMITER_UNAVAILABLE) == 1
    assert _values(line, obs.SERVER_ERRORS) == 1 and _values(line, obs.REFUNDS_KEPT) == 1
