"""Redis errors raised inside a budget script are classified by their kind, under real conditions.

A server out of memory (maxmemory with noeviction), a replica (READONLY) and a server busy
running another client's long script (BUSY) are outages: ``LimiterUnavailable``, which the
web layer answers with 503 ``limiter_unavailable`` and Retry-After. A genuine bug in a
script (a Lua runtime error) stays an error.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from local.redis_servers import RedisServer
from tests.breakable import outcomes
from tests.conftest import StartEnvironment
from usage_limits import LimiterUnavailable, TokenBudget, Window
from usage_limits._scripts import error_kind, script
from usage_limits.keys import user_keys

T0 = 1_700_000_000_000
PLAN = [Window(limit=100, seconds=60)]


def _client(port: int, timeout: float = 2.0) -> aioredis.Redis:
    return aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout,
                          retry=None, decode_responses=False)


async def _every_call(budget: TokenBudget, user: str, nonce: str) -> dict[str, object]:
    """Run each budget script once; what each raised (or returned)."""
    calls = {"reserve": lambda: budget.reserve(user, "r2", 1, now_ms=T0 + 1),
             "refund": lambda: budget.refund(user, "r1", nonce=nonce),
             "settle": lambda: budget.settle(user, "r1", 1, nonce=nonce),
             "usage": lambda: budget.usage(user, now_ms=T0 + 2)}
    return await outcomes(calls)


@pytest.fixture
def server(breakable_server: RedisServer) -> RedisServer:
    """The test's own redis-server, which it may break."""
    return breakable_server


@pytest.fixture
async def charged(server: RedisServer) -> AsyncIterator[tuple[TokenBudget, str, str]]:
    """A budget over ``server`` with one charge ("r1", 5 tokens) already made."""
    client = _client(server.port)
    budget = TokenBudget(client, PLAN)
    user = uuid.uuid4().hex
    d = await budget.reserve(user, "r1", 5, now_ms=T0)
    assert d.allowed
    try:
        yield budget, user, d.nonce
    finally:
        await client.aclose()


async def test_out_of_memory_is_limiter_unavailable(server: RedisServer,
                                                    charged: tuple[TokenBudget, str, str]) -> None:
    """Under maxmemory with noeviction, every script that writes raises LimiterUnavailable."""
    budget, user, nonce = charged
    await budget.redis.config_set("maxmemory-policy", "noeviction")
    await budget.redis.config_set("maxmemory", "1")  # far below what the server uses
    out = await _every_call(budget, user, nonce)
    for name in ("reserve", "refund", "settle", "usage"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "OOM"  # type: ignore[arg-type]
    await budget.redis.config_set("maxmemory", "0")
    assert (await budget.usage(user, now_ms=T0 + 3)).windows[0].used == 5  # nothing changed


async def test_replica_is_limiter_unavailable(server: RedisServer,
                                              charged: tuple[TokenBudget, str, str]) -> None:
    """On a replica (after a failover, say), every script that writes raises
    LimiterUnavailable with the READONLY kind."""
    budget, user, nonce = charged
    with RedisServer(extra=["--replicaof", "127.0.0.1", str(server.port)]) as replica:
        client = _client(replica.port)
        try:
            deadline = time.monotonic() + 10
            while await client.exists(*user_keys(user, "log")) == 0:  # replicated
                assert time.monotonic() < deadline, "the replica never synced"
                await asyncio.sleep(0.05)
            on_replica = TokenBudget(client, PLAN)
            out = await _every_call(on_replica, user, nonce)
        finally:
            await client.aclose()
    for name in ("reserve", "refund", "settle", "usage"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "READONLY"  # type: ignore[arg-type]
    assert (await budget.usage(user, now_ms=T0 + 3)).windows[0].used == 5


LONG_SCRIPT = "local t = redis.call('TIME'); local s = t[1] + t[2] / 1e6; " \
              "while true do t = redis.call('TIME'); " \
              "if t[1] + t[2] / 1e6 - s > tonumber(ARGV[1]) then break end end; return 1"


async def test_busy_server_is_limiter_unavailable(
        server: RedisServer, charged: tuple[TokenBudget, str, str]) -> None:
    """While another client's script runs past busy-reply-threshold, every budget script
    raises LimiterUnavailable with the BUSY kind, and the ledger is unchanged afterwards."""
    budget, user, nonce = charged
    await budget.redis.config_set("busy-reply-threshold", "50")  # ms (lua-time-limit)
    other = redis.Redis(port=server.port, socket_timeout=10)
    runner = threading.Thread(target=other.eval, args=(LONG_SCRIPT, 0, "1.5"), daemon=True)
    runner.start()
    await asyncio.sleep(0.3)  # the long script is running, past the threshold
    out = await _every_call(budget, user, nonce)
    runner.join()
    other.close()
    for name in ("reserve", "refund", "settle", "usage"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "BUSY"  # type: ignore[arg-type]
    assert (await budget.usage(user, now_ms=T0 + 3)).windows[0].used == 5


async def test_a_script_bug_stays_an_error(charged: tuple[TokenBudget, str, str]) -> None:
    """A Lua runtime error inside a script (here: arguments the script cannot compare) is
    raised as the redis error it is, not as an outage."""
    budget, user, _ = charged
    keys = user_keys(user, "log", "ev", "meta")
    with pytest.raises(ResponseError) as info:
        # a cost that is not a number: the script compares nil with a number
        await script("budget_reserve")(budget.redis, keys,
                                       [T0, "r9", "x", "n", "", 0, 60_000, 100])
    assert not isinstance(info.value, LimiterUnavailable)
    assert error_kind(info.value) == "ERR" and "user_script" in str(info.value)


def test_out_of_memory_answers_503_with_retry_after(server: RedisServer,
                                                    lambda_env: StartEnvironment) -> None:
    """Through a real handler, a Redis out of memory answers 503 limiter_unavailable with
    Retry-After on a metered route and on GET /v1/usage, not 500."""
    import importlib

    from local.lambda_events import http_event, invoke

    lambda_env({"REDIS_URL": server.url, "ATTO_BUDGET": "20/1h"}, unset=["ATTO_ENV"])
    embeddings = importlib.import_module("functions.embeddings.app")
    usage = importlib.import_module("functions.usage.app")
    user = uuid.uuid4().hex

    async def seed() -> None:  # the user has spent something: usage has keys to update
        client = _client(server.port)
        try:
            assert (await TokenBudget(client, [Window(20, 3600)]).reserve(user, "s", 1)).allowed
        finally:
            await client.aclose()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(seed())
    finally:
        loop.close()
    admin = redis.Redis(port=server.port)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")
    try:
        metered = invoke(embeddings.handler, http_event(
            "POST", "/v1/embeddings", body={"input": ["a"]}, user=user))
        free = invoke(usage.handler, http_event("GET", "/v1/usage", user=user))
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()
    for res in (metered, free):
        assert res.status == 503, res.body
        assert res.body["error"]["code"] == "limiter_unavailable"
        assert int(res.headers["retry-after"]) >= 1
