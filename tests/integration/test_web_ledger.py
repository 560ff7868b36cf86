"""The web layer's ledger contract: costs that never fit, empty windows, bounded refunds."""

from __future__ import annotations

import asyncio
import importlib
import re
import socket
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi import Depends
from fastapi.responses import JSONResponse

from local.lambda_events import FakeContext, http_event, invoke
from local.redis_servers import RedisServer
from tests.conftest import StartEnvironment
from tests.faultproxy import Fault, FaultProxy, script_sha
from tests.metered import handler, metered_app
from usage_limits import TokenBudget, Window
from usage_limits._scripts import script
from usage_limits.connection import redis_from_env
from usage_limits.deadline import remaining_s
from usage_limits.web import idempotency, refunds, require_tokens
from usage_limits.web.charge import Charge

usage_fn = importlib.import_module("functions.usage.app")
REFUND = script_sha(script("budget_refund").sha)


def build_app() -> Any:
    app = metered_app("web ledger test", ok="/costs-5")

    @app.post("/fails-at-deadline", dependencies=[Depends(require_tokens(cost=5))])
    async def fails_at_deadline() -> JSONResponse:
        await asyncio.sleep(remaining_s())  # the route uses all of its time
        return JSONResponse({"error": {"code": "provider_error", "message": "x"}},
                            status_code=502)

    @app.post("/succeeds-at-deadline", dependencies=[Depends(require_tokens(cost=5))])
    async def succeeds_at_deadline() -> dict[str, bool]:
        await asyncio.sleep(remaining_s())
        return {"ok": True}

    return handler(app)


def stored_answers() -> int:
    """How many records the stored answers' table holds (the handlers' own table)."""
    import os

    import boto3

    client = boto3.client("dynamodb", endpoint_url=os.environ["ATTO_DYNAMODB_ENDPOINT"])
    table = os.environ[idempotency.IDEMPOTENCY_TABLE_ENV]
    return int(client.scan(TableName=table, Select="COUNT", ConsistentRead=True)["Count"])


@pytest.fixture
def web(lambda_env: StartEnvironment, redis_server: RedisServer) -> Iterator[Any]:
    """The test app in a fresh Lambda environment with a 4-token hourly plan."""
    lambda_env({"REDIS_URL": redis_server.url, "ATTO_BUDGET": "4/1h,10/1d"},
               unset=["ATTO_ENV"])
    yield build_app()


def test_a_cost_above_a_window_is_422_cost_exceeds_plan(web: Any) -> None:
    """A route that costs more than a window's limit gets 422 cost_exceeds_plan with the
    cost, the limit and the window, no Retry-After, and nothing is charged."""
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/costs-5", body={}, user=user))
    assert res.status == 422
    err = res.body["error"]
    assert err["code"] == "cost_exceeds_plan"
    assert (err["cost"], err["limit"], err["window_s"]) == (5, 4, 3600)
    assert "retry-after" not in res.headers
    assert invoke(web, http_event("GET", "/used", user=user)).body["used"] == 0


def test_cost_exceeds_plan_is_in_the_openapi_document() -> None:
    """The OpenAPI document of a metered route names the cost_exceeds_plan answer."""
    structured = importlib.import_module("functions.structured.app")
    doc = structured.app.openapi()
    answers = doc["paths"]["/v1/structured"]["post"]["responses"]
    assert "cost_exceeds_plan" in answers["422"]["description"]


@pytest.fixture
def usage_env(lambda_env: StartEnvironment, redis_server: RedisServer) -> None:
    """The usage function in a fresh Lambda environment with a two-window plan."""
    lambda_env({"REDIS_URL": redis_server.url, "ATTO_BUDGET": "20/1h,100/1d"},
               unset=["ATTO_ENV"])


def test_usage_resets_at_is_null_when_a_window_holds_nothing(usage_env: None,
                                                             redis_server: RedisServer) -> None:
    """GET /v1/usage shows resets_at null for a user with no spend and after a full refund,
    and a time when a charge is in the window."""
    user = uuid.uuid4().hex
    res = invoke(usage_fn.handler, http_event("GET", "/v1/usage", user=user))
    assert [w["resets_at"] for w in res.body["windows"]] == [None, None]
    app = build_app()
    assert invoke(app, http_event("POST", "/costs-5", body={}, user=user)).status == 200
    res = invoke(usage_fn.handler, http_event("GET", "/v1/usage", user=user))
    charge_at = instant(res.body["events"][0]["at"])
    assert [instant(w["resets_at"]) for w in res.body["windows"]] == [
        charge_at + timedelta(hours=1), charge_at + timedelta(days=1)]


def instant(text: str) -> datetime:
    """An RFC 3339 UTC instant as the API writes it (``2026-12-02T16:51:27.123Z``).

    Raises:
        AssertionError: the text is not in that form.
    """
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", text), text
    return datetime.fromisoformat(text)


def test_every_instant_in_usage_is_an_rfc3339_utc_string(usage_env: None) -> None:
    """GET /v1/usage writes each instant (windows' resets_at, events' at) as an RFC 3339 UTC
    string within the last minute, and durations as numbers (window_s)."""
    user = uuid.uuid4().hex
    assert invoke(build_app(), http_event("POST", "/costs-5", body={}, user=user)).status == 200
    body = invoke(usage_fn.handler, http_event("GET", "/v1/usage", user=user)).body
    now = datetime.now(UTC)
    (event,) = body["events"]
    assert timedelta(0) <= now - instant(event["at"]) < timedelta(minutes=1)
    for window in body["windows"]:
        assert isinstance(window["window_s"], int)
        assert instant(window["resets_at"]) > now


def test_usage_with_an_idempotency_key_stores_nothing_and_answers_now(
        usage_env: None, redis_server: RedisServer) -> None:
    """GET /v1/usage (free) claims no Idempotency-Key: the same key twice gets the current
    usage both times, never a replay, and no idempotency record is written."""
    user, key = uuid.uuid4().hex, {"Idempotency-Key": uuid.uuid4().hex}
    records = stored_answers()
    first = invoke(usage_fn.handler, http_event("GET", "/v1/usage", user=user, headers=key))
    assert invoke(build_app(), http_event("POST", "/costs-5", body={}, user=user)).status == 200
    again = invoke(usage_fn.handler, http_event("GET", "/v1/usage", user=user, headers=key))
    assert [w["used"] for w in first.body["windows"]] == [0, 0]
    assert [w["used"] for w in again.body["windows"]] == [5, 5]
    assert "idempotent-replayed" not in again.headers
    assert stored_answers() == records


def test_ratelimit_t_is_zero_for_a_window_emptied_by_the_refund(usage_env: None) -> None:
    """A failed request whose refund empties the windows reports t=0 in RateLimit, as
    /v1/usage reports resets_at null."""
    user = uuid.uuid4().hex
    res = invoke(build_app(), http_event("POST", "/fails", body={}, user=user))
    assert res.status == 502
    assert res.headers["ratelimit"] == '"1h";r=20;t=0, "1d";r=100;t=0'
    usage = invoke(usage_fn.handler, http_event("GET", "/v1/usage", user=user)).body
    assert [w["resets_at"] for w in usage["windows"]] == [None, None]


def test_middleware_refund_ends_before_the_lambda_is_killed(
        lambda_env: StartEnvironment, redis_server: RedisServer,
        fault_proxy: FaultProxy) -> None:
    """A refund that Redis answers too slowly is cut at the clean-up bound and kept: the
    invocation still ends before its Lambda time runs out, and the refund lands before the
    next request."""
    lambda_env({"REDIS_URL": fault_proxy.url, "REDIS_SOCKET_TIMEOUT_S": "0.6",
                "REDIS_RETRIES": "1", "ATTO_BUDGET": "20/1h", "ATTO_DEADLINE_MARGIN_S": "0.8"},
               unset=["ATTO_ENV"])
    app, user = build_app(), uuid.uuid4().hex
    fault_proxy.inject(Fault.DELAY, match=REFUND, times=2, delay_s=2.0)
    context = FakeContext(timeout_s=2.0)
    res = invoke(app, http_event("POST", "/fails-at-deadline", body={}, user=user), context)
    assert res.status == 502
    assert context.get_remaining_time_in_millis() > 0  # not killed: it ended in time
    assert refunds.pending() == 1
    fault_proxy.clear()  # Redis answers promptly again
    invoke(app, http_event("POST", "/costs-5", body={}, user=uuid.uuid4().hex))
    assert refunds.pending() == 0
    assert invoke(app, http_event("GET", "/used", user=user)).body["used"] == 0


@pytest.mark.parametrize("path", ["/succeeds-at-deadline", "/fails-at-deadline"])
def test_clean_up_after_a_route_at_its_deadline_ends_in_time(
        lambda_env: StartEnvironment, redis_server: RedisServer, fault_proxy: FaultProxy,
        path: str) -> None:
    """After a keyed route that used all its time, lost replies to the refund (twice, so
    every retry fails) are cut by one clean-up budget, which the answer's store or the
    claim's delete (DynamoDB) shares: the invocation ends before its Lambda time runs out,
    the refund is kept."""
    lambda_env({"REDIS_URL": fault_proxy.url, "REDIS_SOCKET_TIMEOUT_S": "0.6",
                "REDIS_RETRIES": "1", "ATTO_BUDGET": "20/1h", "ATTO_DEADLINE_MARGIN_S": "0.8"},
               unset=["ATTO_ENV"])
    app, user = build_app(), uuid.uuid4().hex
    fault_proxy.inject(Fault.DROP_REPLY, match=REFUND, times=2)
    context = FakeContext(timeout_s=2.0)
    res = invoke(app, http_event("POST", path, body={}, user=user,
                                 headers={"Idempotency-Key": uuid.uuid4().hex}), context)
    assert res.status == (200 if path == "/succeeds-at-deadline" else 502)
    assert context.get_remaining_time_in_millis() > 0  # not killed: it ended in time
    assert refunds.pending() == (0 if res.status == 200 else 1)


async def test_retry_goes_on_past_a_refund_that_fails(redis_server: RedisServer) -> None:
    """A pending refund that keeps failing does not hold up the ones after it."""
    good = redis_from_env(url=redis_server.url, retries=0, socket_timeout_s=1.0)
    dead = redis_from_env(url="redis://127.0.0.1:1", retries=0, connect_timeout_s=0.05)
    user = uuid.uuid4().hex
    plan = [Window(20, 3600)]
    try:
        ledger = TokenBudget(good, plan)
        d = await ledger.reserve(user, "r1", 5)
        refunds.keep(Charge(TokenBudget(dead, plan), user, "r0", 3, "n0"), 3600)
        refunds.keep(Charge(ledger, user, "r1", 5, d.nonce), 3600)
        assert await refunds.retry(each_s=2.0) == 1
        assert refunds.pending() == 1  # the failing one is kept for the next request
        assert (await ledger.usage(user)).windows[0].used == 0
    finally:
        refunds.clear()
        await good.aclose()
        await dead.aclose()


async def test_a_hanging_shard_holds_up_no_other_kept_refund(redis_server: RedisServer) -> None:
    """Kept refunds bound for a server that accepts and never answers use only their own
    bound: the others all land at the first retry, and the hanging ones wait behind them."""
    hole = socket.create_server(("127.0.0.1", 0))  # its backlog accepts; nothing answers
    good = redis_from_env(url=redis_server.url, retries=0, socket_timeout_s=5.0)
    hanging = redis_from_env(url=f"redis://127.0.0.1:{hole.getsockname()[1]}", retries=0,
                             socket_timeout_s=30.0)
    user, plan = uuid.uuid4().hex, [Window(50, 3600)]
    try:
        ledger = TokenBudget(good, plan)
        for i in range(3):
            refunds.keep(Charge(TokenBudget(hanging, plan), user, f"h{i}", 3, "n"), 3600)
        for i in range(4):
            done = await ledger.reserve(user, f"g{i}", 5)
            refunds.keep(Charge(ledger, user, f"g{i}", 5, done.nonce), 3600)
        assert await refunds.retry(each_s=0.2) == 4
        assert (await ledger.usage(user)).windows[0].used == 0
        assert refunds.pending() == 3
        # More kept than one retry tries: the hanging ones, tried and failed, are behind.
        done = await ledger.reserve(user, "late", 5)
        refunds.keep(Charge(ledger, user, "late", 5, done.nonce), 3600)
        assert await refunds.retry(each_s=0.2, batch=3) == 0  # the three hanging ones
        assert await refunds.retry(each_s=0.2, batch=1) == 1  # then the late one's turn
        assert (await ledger.usage(user)).windows[0].used == 0
    finally:
        refunds.clear()
        await good.aclose()
        await hanging.aclose()
        hole.close()


async def test_concurrent_retries_make_each_pending_refund_once(
        redis_server: RedisServer) -> None:
    """Two requests served at once (``make serve`` with WORKER_CONCURRENCY > 1) that both
    retry the pending refunds make each of them once, and neither fails."""
    client = redis_from_env(url=redis_server.url, retries=0, socket_timeout_s=1.0)
    user = uuid.uuid4().hex
    try:
        ledger = TokenBudget(client, [Window(20, 3600)])
        d = await ledger.reserve(user, "r1", 5)
        refunds.keep(Charge(ledger, user, "r1", 5, d.nonce), 3600)
        landed = await asyncio.gather(refunds.retry(each_s=2.0), refunds.retry(each_s=2.0))
        assert sum(landed) == 1 and refunds.pending() == 0
        assert (await ledger.usage(user)).windows[0].used == 0
    finally:
        refunds.clear()
        await client.aclose()
