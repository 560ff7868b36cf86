"""The metrics a request writes, through a real Mangum handler and a real redis-server."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from local.lambda_events import http_event, invoke
from local.redis_servers import RedisServer
from tests.conftest import StartEnvironment
from tests.metered import handler, metered_app
from usage_limits.web import observability as obs


def _handler() -> Any:
    return handler(metered_app("metrics test"))


def _environment(redis_url: str) -> dict[str, str]:
    """The metered function's variables: metrics on (no bus)."""
    return {"REDIS_URL": redis_url, "ATTO_BUDGET": "10/1h", "ATTO_ENV": "dev",
            "POWERTOOLS_SERVICE_NAME": "metered"}


UNSET = ("POWERTOOLS_METRICS_DISABLED", "POWERTOOLS_DEV", "ATTO_EVENT_BUS")


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
def web(lambda_env: StartEnvironment, redis_server: RedisServer) -> Iterator[Any]:
    """The metered app over the session's redis-server, metrics on."""
    lambda_env(_environment(redis_server.url), unset=UNSET)
    yield _handler()


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
        lambda_env: StartEnvironment, emf: Any) -> None:
    """Redis down: the 503 limiter_unavailable is counted, and so is the refund kept for later."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    lambda_env({**_environment(f"redis://127.0.0.1:{closed}"), "REDIS_SOCKET_TIMEOUT_S": "0.2"},
               unset=UNSET)
    res = invoke(_handler(), http_event("POST", "/ok", body={}, user="u"))
    assert res.status == 503 and res.body["error"]["code"] == "limiter_unavailable"
    (line,) = emf()
    assert _values(line, obs.LIMITER_UNAVAILABLE) == 1
    assert _values(line, obs.SERVER_ERRORS) == 1 and _values(line, obs.REFUNDS_KEPT) == 1


def test_the_request_log_line_carries_the_id_the_user_quotes(
        lambda_env: StartEnvironment, redis_server: RedisServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The request's log line has x_request_id equal to the response's X-Request-Id, so the
    id a user quotes finds the line."""
    lambda_env({**_environment(redis_server.url), "LOG_LEVEL": "INFO"}, unset=UNSET)
    web = _handler()
    capsys.readouterr()
    res = invoke(web, http_event("POST", "/ok", body={}, user=uuid.uuid4().hex,
                                 request_id="gw-log-1"))
    assert res.status == 200 and res.headers["x-request-id"] == "gw-log-1"
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()
             if '"message":"request"' in ln]
    assert [ln["x_request_id"] for ln in lines] == ["gw-log-1"]
