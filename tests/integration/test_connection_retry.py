"""Commands on connections that died with a restarted Redis are retried, not failed."""

from __future__ import annotations

import asyncio

from local.redis_servers import RedisServer
from usage_limits._scripts import script
from usage_limits.connection import redis_from_env


async def test_stale_connections_after_a_restart_are_retried() -> None:
    """After Redis restarts, pooled connections fail once and the command is sent again."""
    with RedisServer() as server:
        client = redis_from_env({"REDIS_URL": server.url, "REDIS_RETRIES": "1"})
        try:
            await asyncio.gather(*(client.set(f"k{i}", 1) for i in range(3)))  # 3 pooled
            server.stop(kill=True)
            server.start()
            assert await asyncio.gather(*(client.set(f"k{i}", 2) for i in range(3))) == [True] * 3
            # scripts too: NOSCRIPT on the new server, then EVAL, on a reconnected connection
            server.stop(kill=True)
            server.start()
            reply = await script("throttle_pause")(
                client, ["ul:{p:retry}:gcra", "ul:{p:retry}:gcra:call:1", "ul:{p:retry}:fq:expiry"],
                ["1000", "0", "10000"])
            assert float(reply) >= 1000
        finally:
            await client.aclose()


def test_blocking_client_retries_too() -> None:
    """The blocking client (Powertools idempotency's) retries a dead connection as well."""
    with RedisServer() as server:
        client = redis_from_env({"REDIS_URL": server.url, "REDIS_RETRIES": "1"}, sync=True)
        client.set("k", 1)
        server.stop(kill=True)
        server.start()
        assert client.set("k", 2) is True
        client.close()
