"""Redis errors raised inside a throttle script are outages, classified by kind, under real
conditions, and a failed call leaves the provider's shared state as it was.

A server out of memory (maxmemory with noeviction) and a replica (READONLY) refuse every
throttle script: the rate slot (``throttle_acquire``), the pause (``throttle_pause``) and the
in-flight lease (``throttle_lease_acquire``). Each raises ``LimiterUnavailable`` with the
error's kind, and the provider's keys are unchanged afterwards: a caller that got an error
holds no slot and no lease, so nothing leaks. (A lease caller that fails leaves only the
tombstone of its own id, by design: its release runs on the way out, and under OOM Redis lets
a script that has begun writing go on; see ``_semaphore``.)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from local.redis_servers import RedisServer
from tests.breakable import outcomes
from usage_limits import LimiterUnavailable, ProviderThrottle
from usage_limits._scripts import error_kind
from usage_limits.keys import provider_keys


def _client(port: int) -> aioredis.Redis:
    return aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=2.0, retry=None,
                          decode_responses=False)


def _throttle(client: aioredis.Redis, provider: str) -> ProviderThrottle:
    return ProviderThrottle(client, provider, rate=50, per_s=1, burst=2, max_concurrency=2,
                            lease_s=5)


async def _snapshot(client: aioredis.Redis, provider: str) -> dict[bytes, bytes]:
    """Every key of the provider with its serialized value (DUMP), so any change shows;
    without the per-call answers (they expire alone) and the tombstones of callers that
    left (a failed caller's own id)."""
    tag = provider_keys(provider, "")[0]
    skip = (f"{tag}gcra:call:", f"{tag}released")
    out: dict[bytes, bytes] = {}
    async for key in client.scan_iter(match=f"{tag}*"):
        if not key.decode().startswith(skip):
            out[key] = await client.dump(key) or b""
    return out


async def _every_script(throttle: ProviderThrottle) -> dict[str, object]:
    """Run each throttle script once; what each raised (or returned)."""

    async def lease() -> float:
        async with throttle.slot(max_wait_s=0.5) as waited:
            return waited

    calls = {"acquire": lambda: throttle.acquire(max_wait_s=0.5),
             "pause": lambda: throttle.pause(1.0),
             "lease": lease}
    return await outcomes(calls)


@pytest.fixture
def server(breakable_server: RedisServer) -> RedisServer:
    """The test's own redis-server, which it may break."""
    return breakable_server


@pytest.fixture
async def used(server: RedisServer) -> AsyncIterator[tuple[aioredis.Redis, str]]:
    """A client and a provider that has already admitted one call (its keys exist)."""
    client = _client(server.port)
    provider = "p-" + uuid.uuid4().hex[:8]
    async with _throttle(client, provider).slot():
        pass
    try:
        yield client, provider
    finally:
        await client.aclose()


async def test_out_of_memory_is_limiter_unavailable(used: tuple[aioredis.Redis, str]) -> None:
    """Under maxmemory with noeviction, every throttle script raises LimiterUnavailable of
    kind OOM and changes nothing of the provider's state."""
    client, provider = used
    before = await _snapshot(client, provider)
    await client.config_set("maxmemory-policy", "noeviction")
    await client.config_set("maxmemory", "1")  # far below what the server uses
    try:
        out = await _every_script(_throttle(client, provider))
    finally:
        await client.config_set("maxmemory", "0")
    for name in ("acquire", "pause", "lease"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "OOM", (name, out[name])  # type: ignore[arg-type]
    assert await _snapshot(client, provider) == before
    # and the provider serves again once memory is back: no slot or lease was leaked
    assert isinstance(await _throttle(client, provider).acquire(max_wait_s=1.0), float)


async def test_replica_is_limiter_unavailable(server: RedisServer,
                                              used: tuple[aioredis.Redis, str]) -> None:
    """On a replica (after a failover, say), every throttle script raises LimiterUnavailable
    of kind READONLY."""
    client, provider = used
    with RedisServer(extra=["--replicaof", "127.0.0.1", str(server.port)]) as replica:
        on_replica = _client(replica.port)
        try:
            deadline = time.monotonic() + 10
            while (await on_replica.info("replication")).get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica never synced"
                await asyncio.sleep(0.05)
            assert await client.wait(1, 5000) == 1  # the provider's keys reached it
            out = await _every_script(_throttle(on_replica, provider))
        finally:
            await on_replica.aclose()
    for name in ("acquire", "pause", "lease"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "READONLY", (name, out[name])  # type: ignore[arg-type]
