"""Every throttle script through every fault of the proxy, with the client configured as in
production (``redis_from_env``: 0.5 s socket timeout, one retry): no slot booked twice, no
lease leaked or doubled, no pause extended, and nobody waits forever."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from local.redis_servers import RedisServer
from tests.faultproxy import Fault, FaultProxy, script_sha
from usage_limits._scripts import script
from usage_limits.connection import redis_from_env
from usage_limits.keys import provider_keys
from usage_limits.throttle import ProviderThrottle

#: Longer than the production socket timeout (0.5 s): the client gives up and re-sends.
DELAY_S = 0.8
#: No operation below may take longer than this, whatever the fault (no deadlock).
BOUND_S = 6.0
FAULTS = [Fault.DROP_COMMAND, Fault.DROP_REPLY, Fault.DUPLICATE, Fault.DELAY,
          Fault.CUT_COMMAND, Fault.CUT_REPLY]
#: Faults after which the command has run once already when the client re-sends it.
RAN_FIRST_TIME = frozenset({Fault.DROP_REPLY, Fault.DUPLICATE, Fault.DELAY, Fault.CUT_REPLY})
SCRIPTS = ("throttle_acquire", "throttle_confirm", "throttle_pause", "throttle_lease_acquire",
           "throttle_lease_release")


@pytest.fixture
async def direct(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A client straight to Redis (no proxy), with every throttle script loaded."""
    client = aioredis.Redis(port=redis_server.port)
    for name in SCRIPTS:  # EVALSHA hits: a fault must meet the script, not NOSCRIPT
        await client.script_load(script(name).source)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def production(fault_proxy: FaultProxy) -> AsyncIterator[Any]:
    """A client through the proxy, configured as production configures it."""
    client = redis_from_env({"REDIS_URL": fault_proxy.url})
    try:
        yield client
    finally:
        await client.aclose()


def arm(proxy: FaultProxy, fault: Fault, name: str) -> Any:
    return proxy.inject(fault, match=script_sha(script(name).sha), delay_s=DELAY_S)


async def seq(direct: aioredis.Redis, provider: str) -> int:
    [state] = provider_keys(provider, "gcra")
    return int(await direct.hget(state, "seq") or 0)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.value)
async def test_acquire_books_one_slot_through_any_fault(
        fault: Fault, fault_proxy: FaultProxy, production: Any, direct: aioredis.Redis,
        uid: str) -> None:
    """A rate acquire hit by a fault reserves exactly one slot (or none, and says so)."""
    th = ProviderThrottle(production, uid, rate=10, burst=1, jitter_s=0)
    injection = arm(fault_proxy, fault, "throttle_acquire")
    async with asyncio.timeout(BOUND_S):
        first = await th.admit(max_wait_s=2)  # the one retry gets through
    assert injection.hits == 1
    assert await seq(direct, uid) == first.seq == 1
    second = await ProviderThrottle(direct, uid, rate=10, burst=1, jitter_s=0).admit(max_wait_s=2)
    assert second.seq == 2
    # The next slot is one interval after the first, or now: no phantom booking between.
    expected = max(first.slot_at + 0.1, second.requested_at)
    assert second.slot_at == pytest.approx(expected, abs=1e-5)


async def queued(direct: aioredis.Redis, provider: str) -> int:
    [queue] = provider_keys(provider, "fq")
    return int(await direct.zcard(queue))


@pytest.mark.parametrize("name", ["throttle_acquire", "throttle_confirm"])
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.value)
async def test_queued_admission_books_one_slot_through_any_fault(
        fault: Fault, name: str, fault_proxy: FaultProxy, production: Any,
        direct: aioredis.Redis, uid: str) -> None:
    """A request that queues behind a booked slot, hit by a fault as it queues or as it asks
    again for its slot, queues once and books exactly one slot."""
    other = ProviderThrottle(direct, uid, rate=10, burst=1, jitter_s=0)
    first = await other.admit(max_wait_s=2, user="a")  # the next slot is 0.1 s away: queue
    injection = arm(fault_proxy, fault, name)
    async with asyncio.timeout(BOUND_S):
        second = await ProviderThrottle(production, uid, rate=10, burst=1, jitter_s=0).admit(
            max_wait_s=3, user="b")
    assert injection.hits == 1
    assert second.calls >= 2  # it queued, then booked
    assert (first.seq, second.seq) == (1, 2) and await seq(direct, uid) == 2
    assert await queued(direct, uid) == 0
    third = await other.admit(max_wait_s=3, user="a")
    assert third.seq == 3
    # No phantom booking or queue entry between: the next slot is one interval on, or now.
    expected = max(second.slot_at + 0.1, third.requested_at)
    assert third.slot_at == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.value)
async def test_pause_is_set_once_through_any_fault(
        fault: Fault, fault_proxy: FaultProxy, production: Any, direct: aioredis.Redis,
        uid: str) -> None:
    """A pause hit by a fault ends when its answer says, however often it ran."""
    th = ProviderThrottle(production, uid, rate=10, burst=1, jitter_s=0)
    # Another instance keeps moving the provider's clock while the pause is retried (a
    # pause of 0 s moves the clock and changes nothing else).
    mover = ProviderThrottle(direct, uid, rate=10, burst=1, jitter_s=0)
    injection = arm(fault_proxy, fault, "throttle_pause")

    async def keep_moving() -> None:
        while True:
            await mover.pause(0)
            await asyncio.sleep(0.05)

    mover_task = asyncio.create_task(keep_moving())
    try:
        called_at = time.time()
        async with asyncio.timeout(BOUND_S):
            until = await th.pause(2.0)  # still on when the checks below run
        await asyncio.sleep(DELAY_S + 0.2)  # a delayed or duplicated copy has run by now
    finally:
        mover_task.cancel()
    assert injection.hits == 1
    [state] = provider_keys(uid, "gcra")
    assert float(await direct.hget(state, "pause")) / 1000 == pytest.approx(until, abs=1e-6)
    if fault in RAN_FIRST_TIME:  # a re-run must not start the pause again from a later clock
        assert until <= called_at + 2.0 + 0.15


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.value)
@pytest.mark.parametrize("name", ["throttle_lease_acquire", "throttle_lease_release"])
async def test_leases_survive_any_fault(
        fault: Fault, name: str, fault_proxy: FaultProxy, production: Any,
        direct: aioredis.Redis, uid: str) -> None:
    """Three callers share one lease through a fault: never two at once, none leaked, all done."""
    th = ProviderThrottle(production, uid, rate=1000, burst=10, max_concurrency=1, lease_s=5,
                          jitter_s=0)
    leases_key = provider_keys(uid, "leases")[0]
    inside: list[int] = []
    holding = 0
    injection = arm(fault_proxy, fault, name)

    async def caller() -> str:
        nonlocal holding
        async with th.slot(max_wait_s=4):
            holding += 1
            inside.append(holding)
            inside.append(int(await direct.zcard(leases_key)))
            await asyncio.sleep(0.05)
            holding -= 1
        return "done"

    async with asyncio.timeout(BOUND_S):
        results = await asyncio.gather(caller(), caller(), caller())
    await asyncio.sleep(DELAY_S + 0.2)  # a delayed or duplicated copy has run by now
    assert injection.hits == 1
    assert max(inside) == 1           # never two holders, never two live leases
    assert results == ["done"] * 3    # the one retry gets through; nobody is stuck
    assert await direct.zcard(leases_key) == 0  # nothing leaked
    assert await direct.zcard(provider_keys(uid, "waiters")[0]) == 0
    async with ProviderThrottle(direct, uid, rate=1000, burst=10, max_concurrency=1,
                                lease_s=5, jitter_s=0).slot(max_wait_s=0):
        pass  # the place is free at once
