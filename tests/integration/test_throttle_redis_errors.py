"""Redis errors raised inside a throttle script are outages, classified by kind, under real
conditions, and a failed call leaves the provider's shared state as it was.

A server out of memory (maxmemory with noeviction) and a replica (READONLY) refuse every
throttle script: the rate slot (``throttle_acquire``), the pause (``throttle_pause``) and the
in-flight lease (``throttle_lease_acquire``). Each raises ``LimiterUnavailable`` with the
error's kind, and the provider's keys are unchanged afterwards: a caller that got an error
holds no slot and no lease, so nothing leaks. (A lease caller that fails leaves only the
tombstone of its own id, by design: its release runs on the way out, and under OOM Redis lets
a script that has begun writing go on; see ``_semaphore``.)

A queued request's confirm (``throttle_confirm``) that meets such an error as it runs, or
BUSY, books nothing and keeps no answer; the same call sent again books its slot once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis

from local.redis_servers import RedisServer
from tests.breakable import LONG_SCRIPT, outcomes
from usage_limits import LimiterUnavailable, ProviderThrottle
from usage_limits._scripts import error_kind, script
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


# --------------------------------------- throttle_confirm.lua meeting an error as it runs

T0 = 1_700_000_000_000.0
#: The provider of the confirm tests: one slot each 100 ms, a burst of one.
INTERVAL_MS, BURST = "100.0", "1"
#: Waits and grace of a minute: the keys live on (in real time) while a replica syncs.
ANSWER_TTL_MS, WAIT_MS, GRACE_MS, HORIZON_MS = "60000", "60000.000", "60000", "50.000"


def _acquire_args(now: float, user: str, horizon_ms: str = HORIZON_MS) -> list[str]:
    """throttle_acquire.lua's ARGV for a request of cost 1."""
    return [f"{now:.3f}", INTERVAL_MS, BURST, "1", WAIT_MS, ANSWER_TTL_MS, horizon_ms,
            user, "1.0", GRACE_MS, uuid.uuid4().hex]


def _call_keys(provider: str) -> list[str]:
    """A script call's keys: the state, a fresh answer key, the fair queue's four."""
    state, answers, *queue = provider_keys(provider, "gcra", "gcra:call:", "fq",
                                           "fq:entries", "fq:expiry", "fq:users")
    return [state, answers + uuid.uuid4().hex, *queue]


@contextlib.asynccontextmanager
async def _broken(kind: str, server: RedisServer,
                  client: aioredis.Redis) -> AsyncIterator[aioredis.Redis]:
    """Redis unable to serve a write, as ``kind`` says; yields the client to call.

    OOM: maxmemory with noeviction (refused at the script's first write). READONLY: a
    replica of ``server``, synced (refused at the first write). BUSY: another client's
    script runs past busy-reply-threshold (refused before the script starts).
    """
    if kind == "OOM":
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", "1")  # far below what the server uses
        try:
            yield client
        finally:
            await client.config_set("maxmemory", "0")
    elif kind == "READONLY":
        with RedisServer(extra=["--replicaof", "127.0.0.1", str(server.port)]) as replica:
            on_replica = _client(replica.port)
            try:
                deadline = time.monotonic() + 10
                while (await on_replica.info("replication")).get("master_link_status") != "up":
                    assert time.monotonic() < deadline, "the replica never synced"
                    await asyncio.sleep(0.05)
                assert await client.wait(1, 5000) == 1  # the queued entry reached it
                await on_replica.script_load(script("throttle_confirm").source)
                yield on_replica
            finally:
                await on_replica.aclose()
    else:
        assert kind == "BUSY", kind
        await client.config_set("busy-reply-threshold", "50")  # ms (lua-time-limit)
        other = redis.Redis(port=server.port, socket_timeout=10)
        runner = threading.Thread(target=other.eval, args=(LONG_SCRIPT, 0, "1.0"), daemon=True)
        runner.start()
        await asyncio.sleep(0.3)  # the long script is running, past the threshold
        try:
            yield client
        finally:
            runner.join()
            other.close()


@pytest.mark.parametrize("kind", ["OOM", "READONLY", "BUSY"])
async def test_confirm_meeting_an_error_books_nothing_and_once_when_sent_again(
        kind: str, server: RedisServer) -> None:
    """A queued request whose confirm (throttle_confirm.lua) meets OOM or READONLY at its
    first write (an error raised inside the script, ``@user_script`` in its message) or
    BUSY gets LimiterUnavailable of that kind, and the provider is as it was: no slot
    booked, no answer kept. The same call sent again once Redis serves books exactly one
    slot, and sent once more gets that answer and books nothing."""
    client = _client(server.port)
    provider = "p-" + uuid.uuid4().hex[:8]
    acquire, confirm = script("throttle_acquire"), script("throttle_confirm")
    await client.script_load(confirm.source)  # EVALSHA meets the fault, not NOSCRIPT
    try:
        first = await acquire(client, _call_keys(provider), _acquire_args(T0, "a"))
        assert (int(first[0]), int(first[3])) == (1, 1)  # booked at T0: the next slot is +100
        queued = await acquire(client, _call_keys(provider), _acquire_args(T0 + 1, "b"))
        assert int(queued[0]) == 3 and float(queued[2]) == T0 + 100  # queued, told T0 + 100
        entry = queued[4].decode()
        keys = _call_keys(provider)
        # asked again 40 ms before its slot: the head, within the horizon, it would book
        args = [f"{T0 + 60:.3f}", INTERVAL_MS, BURST, WAIT_MS, ANSWER_TTL_MS, HORIZON_MS,
                entry, GRACE_MS, "20.000"]
        before = await _snapshot(client, provider)
        async with _broken(kind, server, client) as target:
            with pytest.raises(LimiterUnavailable) as refused:
                await confirm(target, keys, args)
        cause = refused.value.__cause__
        assert error_kind(cause) == kind  # type: ignore[arg-type]
        if kind != "BUSY":  # refused by a command inside the script, after its reads
            assert "@user_script" in str(cause)
        assert await _snapshot(client, provider) == before
        assert await client.exists(keys[1]) == 0  # no answer kept for a re-send to find
        # Sent again (a retry, or the command arriving late): it books one slot, once.
        again = await confirm(client, keys, args)
        assert (int(again[0]), float(again[2]), int(again[3])) == (1, T0 + 100, 2)
        assert await confirm(client, keys, args) == again
        [state, _, queue, *_] = keys
        assert int(await client.hget(state, "seq")) == 2
        assert await client.zcard(queue) == 0
        # the next request's slot is one interval on: nothing else was booked meanwhile
        third = await acquire(client, _call_keys(provider),
                              _acquire_args(T0 + 61, "c", horizon_ms="500.000"))
        assert (int(third[0]), float(third[2]), int(third[3])) == (1, T0 + 200, 3)
    finally:
        await client.aclose()
