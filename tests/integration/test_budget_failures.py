"""The ledger fails closed: an unreachable or stalled Redis raises LimiterUnavailable."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from local.redis_servers import RedisServer, free_port
from usage_limits import LimiterUnavailable, TokenBudget, Window


def client(port: int, timeout: float) -> aioredis.Redis:
    return aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout,
                          socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))


@pytest.fixture
def debug_server() -> Iterator[RedisServer]:
    """A private redis-server of this test that accepts DEBUG SLEEP."""
    with RedisServer(extra=["--enable-debug-command", "yes"]) as server:
        yield server


@pytest.mark.parametrize("call", ["reserve", "refund", "settle", "usage"])
async def test_unreachable_redis_raises_limiter_unavailable(call: str, uid: str) -> None:
    """Every ledger call against a closed port raises LimiterUnavailable from the redis error."""
    r = client(free_port(), 0.5)
    budget = TokenBudget(r, [Window(10, 60)])
    calls = {"reserve": lambda: budget.reserve(uid, "a", 1),
             "refund": lambda: budget.refund(uid, "a", nonce="n"),
             "settle": lambda: budget.settle(uid, "a", 0, nonce="n"),
             "usage": lambda: budget.usage(uid)}
    try:
        with pytest.raises(LimiterUnavailable) as info:
            await calls[call]()
        assert isinstance(info.value.__cause__, RedisConnectionError)
    finally:
        await r.aclose()


async def test_stalled_redis_raises_limiter_unavailable(debug_server: RedisServer,
                                                        uid: str) -> None:
    """A reservation that gets no answer within the socket timeout raises LimiterUnavailable."""
    sleeper, r = client(debug_server.port, 5.0), client(debug_server.port, 0.3)
    budget = TokenBudget(r, [Window(10, 60)])
    try:
        assert (await budget.reserve(uid, "warm", 1)).allowed  # scripts loaded, pool open
        stall = asyncio.create_task(sleeper.execute_command("DEBUG", "SLEEP", "1.5"))
        await asyncio.sleep(0.2)  # let DEBUG SLEEP reach the server first
        with pytest.raises(LimiterUnavailable) as info:
            await budget.reserve(uid, "stalled", 1)
        assert isinstance(info.value.__cause__, RedisTimeoutError)
        await stall
    finally:
        await sleeper.aclose()
        await r.aclose()
