"""A redis-server a test may break (out of memory, a replica, busy), and the outcome of each
call made against it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping

import pytest

from local.redis_servers import RedisServer

#: A script that keeps the server busy for ARGV[1] seconds (EVAL it with no keys): past
#: busy-reply-threshold every other client's command is refused BUSY.
LONG_SCRIPT = "local t = redis.call('TIME'); local s = t[1] + t[2] / 1e6; " \
              "while true do t = redis.call('TIME'); " \
              "if t[1] + t[2] / 1e6 - s > tonumber(ARGV[1]) then break end end; return 1"


@pytest.fixture
def breakable_server() -> Iterator[RedisServer]:
    """A private redis-server of this test (of the test's engine), which it may break."""
    with RedisServer() as srv:
        yield srv


async def outcomes(calls: Mapping[str, Callable[[], Awaitable[object]]]) -> dict[str, object]:
    """Each call's result, or the exception it raised, by name (run one after another)."""
    out: dict[str, object] = {}
    for name, call in calls.items():
        try:
            out[name] = await call()
        except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
            out[name] = exc
    return out
