"""Throttle scripts run twice (a lost reply re-sent by redis-py) or late (a command held up
past the socket timeout) change nothing; leases use the server's clock, whatever the
callers' clocks say; a caller
that slept to its slot never calls a paused provider. Real redis-server and cluster."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from tests.resend import Resending
from usage_limits._scripts import script
from usage_limits._semaphore import LEASE_CLOCK_TRUST_S, WAITER_TTL_S, LeaseSemaphore
from usage_limits.exceptions import ProviderBusy
from usage_limits.keys import provider_keys
from usage_limits.throttle import ProviderThrottle, UpstreamRateLimited

EPS = 0.002  # loop clock against wall clock, and slots stored with 1 µs precision


@pytest.fixture
async def client(redis_client: Any) -> Any:
    """The session's client (standalone, then cluster), initialised for concurrent use."""
    if isinstance(redis_client, RedisCluster):
        await redis_client.initialize()
    return redis_client


def leases_key(provider: str) -> str:
    return provider_keys(provider, "leases")[0]


async def state(client: Any, provider: str) -> dict[str, str]:
    [key] = provider_keys(provider, "gcra")
    raw = await client.hgetall(key)
    return {k.decode(): v.decode() for k, v in raw.items()}


async def test_resent_lease_acquire_does_not_queue_behind_itself(client: Any, uid: str) -> None:
    """A lease acquire run twice grants one lease; the caller does not wait for itself."""
    th = ProviderThrottle(Resending(client), uid, rate=1000, burst=10, max_concurrency=1,
                          lease_s=5, jitter_s=0)
    async with th.slot(max_wait_s=1):
        assert await client.zcard(leases_key(uid)) == 1
    assert await client.zcard(leases_key(uid)) == 0
    async with th.slot(max_wait_s=1):  # and the next caller is not held up either
        pass


async def test_resent_acquire_books_one_slot(client: Any, uid: str) -> None:
    """A rate acquire run twice reserves one slot: the next caller's slot is one interval on."""
    resending = Resending(client)
    th = ProviderThrottle(resending, uid, rate=10, burst=1, jitter_s=0)
    first = await th.admit(max_wait_s=1)
    second = await ProviderThrottle(client, uid, rate=10, burst=1, jitter_s=0).admit(max_wait_s=1)
    assert first.seq == 1
    assert second.seq == 2
    assert second.slot_at - first.slot_at == pytest.approx(0.1, abs=1e-5)


async def test_resent_queue_and_confirm_book_one_slot(client: Any, uid: str) -> None:
    """A request that queues and then asks for its slot, every call run twice, queues once
    and books one slot: the next caller's slot is one interval after it."""
    other = ProviderThrottle(client, uid, rate=10, burst=1, jitter_s=0)
    resending = Resending(client)
    first = await other.admit(max_wait_s=1, user="a")
    second = await ProviderThrottle(resending, uid, rate=10, burst=1, jitter_s=0).admit(
        max_wait_s=1, user="b")
    assert resending.calls_of(script("throttle_confirm"))  # it queued, then asked again
    third = await other.admit(max_wait_s=1, user="a")
    assert [first.seq, second.seq, third.seq] == [1, 2, 3]
    assert second.slot_at - first.slot_at == pytest.approx(0.1, abs=1e-5)
    assert third.slot_at - second.slot_at == pytest.approx(0.1, abs=1e-5)
    assert await client.zcard(provider_keys(uid, "fq")[0]) == 0


async def test_late_duplicate_acquire_books_nothing(client: Any, uid: str) -> None:
    """A rate acquire that arrives again after its caller moved on reserves nothing more."""
    resending = Resending(client, twice=False)
    th = ProviderThrottle(resending, uid, rate=10, burst=1, jitter_s=0)
    await th.admit(max_wait_s=1)
    before = await state(client, uid)
    [call] = resending.calls_of(script("throttle_acquire"))
    await resending.replay(call)
    after = await state(client, uid)
    assert (after["tat"], after["seq"]) == (before["tat"], before["seq"])


async def test_resent_pause_is_not_extended(client: Any, uid: str) -> None:
    """A pause run again after another caller moved the clock keeps its end."""
    resending = Resending(client, twice=False)
    th = ProviderThrottle(resending, uid, rate=100, burst=1, jitter_s=0)
    until = await th.pause(0.5)
    await asyncio.sleep(0.05)
    other = ProviderThrottle(client, uid, rate=100, burst=1, jitter_s=0)
    await other.admit(max_wait_s=2)  # moves the provider's clock on
    [call] = resending.calls_of(script("throttle_pause"))
    assert float(await resending.replay(call)) / 1000 == pytest.approx(until, abs=1e-6)
    assert float((await state(client, uid))["pause"]) / 1000 == pytest.approx(until, abs=1e-6)


async def test_late_lease_acquire_after_release_leaks_nothing(client: Any, uid: str) -> None:
    """A lease acquire that arrives after its caller released the lease grants nothing."""
    resending = Resending(client, twice=False)
    th = ProviderThrottle(resending, uid, rate=1000, burst=10, max_concurrency=1, lease_s=5,
                          jitter_s=0)
    async with th.slot(max_wait_s=1):
        pass
    [call] = resending.calls_of(script("throttle_lease_acquire"))
    reply = await resending.replay(call)
    assert int(reply[0]) == 0
    assert await client.zcard(leases_key(uid)) == 0
    async with ProviderThrottle(client, uid, rate=1000, burst=10, max_concurrency=1,
                                lease_s=5, jitter_s=0).slot(max_wait_s=0):
        pass  # the place is free at once


async def test_resent_release_reports_the_release(client: Any, uid: str) -> None:
    """A lease release run twice still answers that it released a live lease."""
    sem = LeaseSemaphore(Resending(client), uid, 1, 5.0)
    lease = await sem.acquire(asyncio.get_running_loop().time() + 1)
    assert await sem.release(lease) is True
    assert await client.zcard(leases_key(uid)) == 0


async def lease_call(sem: LeaseSemaphore, now_s: float, lease_id: str, *,
                     queue: bool = True) -> bool:
    """Run the lease acquire script as the library does, with an explicit caller clock."""
    reply = await script("throttle_lease_acquire")(sem._client, sem._keys, [
        f"{now_s * 1000:.3f}", sem.limit, f"{sem.lease_s * 1000:.3f}", lease_id,
        f"{WAITER_TTL_S * 1000:.0f}", 1 if queue else 0, f"{LEASE_CLOCK_TRUST_S * 1000:.3f}"])
    return bool(int(reply[0]))


async def server_s(client: Any) -> float:
    """The Redis server's clock, epoch seconds."""
    sec, usec = await client.time()
    return sec + usec / 1e6


class Skewed:
    """A stand-in for the ``time`` module whose clock runs ``offset_s`` off the true time."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def time(self) -> float:
        return time.time() + self.offset_s


@pytest.mark.parametrize("offset_s", [5.0, 1e6])
async def test_a_clock_far_ahead_does_not_expire_a_live_lease(client: Any, uid: str,
                                                             offset_s: float) -> None:
    """A caller whose clock runs more than lease_s ahead finds a live lease live, and
    leaves the lease clock on the server's time."""
    sem = LeaseSemaphore(client, uid, 1, 2.0)
    assert await lease_call(sem, time.time(), "holder")
    before = await client.zscore(leases_key(uid), "holder")
    assert not await lease_call(sem, time.time() + offset_s, "fast", queue=False)
    assert not await lease_call(sem, time.time() + offset_s, "fast-2", queue=False)
    assert await client.zscore(leases_key(uid), "holder") == before
    [clock_key] = provider_keys(uid, "lclock")
    assert float(await client.get(clock_key)) / 1000 <= await server_s(client)


@pytest.mark.parametrize("offset_s", [-5.0, -1e6])
async def test_a_holder_whose_clock_runs_behind_gets_a_whole_lease(client: Any, uid: str,
                                                                  offset_s: float) -> None:
    """A lease taken by a caller whose clock runs more than lease_s behind expires lease_s
    after its grant on the server's clock, so a caller with the true time finds it live."""
    sem = LeaseSemaphore(client, uid, 1, 2.0)
    granted_at = await server_s(client)
    assert await lease_call(sem, time.time() + offset_s, "slow")
    expiry = float(await client.zscore(leases_key(uid), "slow")) / 1000
    assert granted_at + 2.0 <= expiry <= await server_s(client) + 2.0
    assert not await lease_call(sem, time.time(), "normal", queue=False)


async def test_a_dead_holders_lease_frees_on_the_servers_clock(client: Any, uid: str) -> None:
    """A holder that never releases frees its place lease_s after its grant, on the server's
    clock, for callers whose clocks run far behind or ahead alike."""
    sem = LeaseSemaphore(client, uid, 1, 0.2)
    assert await lease_call(sem, time.time() + 1e6, "dead")
    expiry = float(await client.zscore(leases_key(uid), "dead")) / 1000
    while await server_s(client) <= expiry:
        assert not await lease_call(sem, time.time() - 1e6, "behind", queue=False)
        await asyncio.sleep(0.02)
    assert await lease_call(sem, time.time() - 1e6, "behind", queue=False)


async def test_skewed_callers_wait_by_the_lease_clock(client: Any, uid: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller whose clock runs far ahead is told to retry after the holder's remaining
    lease time, not after nothing or after its own clock's lead."""
    holder = ProviderThrottle(client, uid, rate=1000, burst=10, max_concurrency=1,
                              lease_s=3, jitter_s=0)
    async with holder.slot(max_wait_s=1):
        monkeypatch.setattr("usage_limits._semaphore.time", Skewed(60.0))
        with pytest.raises(ProviderBusy) as busy:
            async with ProviderThrottle(client, uid, rate=1000, burst=10, max_concurrency=1,
                                        lease_s=3, jitter_s=0).slot(max_wait_s=0):
                pass
        monkeypatch.undo()
        assert 2.0 < busy.value.retry_after_s <= 3.0
    assert await client.zcard(leases_key(uid)) == 0


async def test_callers_that_slept_do_not_call_a_paused_provider(client: Any, uid: str) -> None:
    """Callers holding slots when an upstream 429 lands wait out the pause before calling."""
    th = ProviderThrottle(client, uid, rate=10, burst=1, jitter_s=0)
    calls: list[float] = []
    limited_at: list[float] = []

    async def upstream() -> str:
        calls.append(time.time())
        if len(calls) == 2:
            limited_at.append(time.time())
            raise UpstreamRateLimited(1.0)
        return "ok"

    results = await asyncio.gather(*(th.call(upstream, retries=1, max_wait_s=8)
                                     for _ in range(10)), return_exceptions=True)
    pause_until = float((await state(client, uid))["pause"]) / 1000
    assert all(r == "ok" for r in results), results
    [limited] = limited_at
    inside = [at for at in calls if limited + 0.05 < at < pause_until - EPS]
    assert inside == []
    assert len(calls) == 11  # every caller called once, the limited one twice


async def test_callers_that_cannot_wait_out_the_pause_are_busy(client: Any, uid: str) -> None:
    """A caller whose slot falls in a pause and who cannot wait past it gets ProviderBusy."""
    th = ProviderThrottle(client, uid, rate=10, burst=1, jitter_s=0)
    admitted: list[float] = []

    async def caller() -> None:
        admission = await th.admit(max_wait_s=1.2)
        admitted.append(admission.granted_at)

    async def limited() -> float:
        await asyncio.sleep(0.15)
        paused_at = time.time()
        await th.pause(2.0)
        return paused_at

    *results, paused_at = await asyncio.gather(*(caller() for _ in range(8)), limited(),
                                               return_exceptions=True)
    pause_until = float((await state(client, uid))["pause"]) / 1000
    assert isinstance(paused_at, float)
    assert [at for at in admitted if paused_at + 0.05 < at] == []
    busy = [r for r in results if isinstance(r, ProviderBusy)]
    assert len(busy) + len(admitted) == 8 and admitted
    # Slots are 0.1 s apart from the first; every one after the moment the pause landed
    # must be busy. Counted from when it really landed (a loaded loop wakes the pausing
    # task late), it is the 5 slots from 0.3 s when the pause lands at 0.15 s.
    first = min(admitted)
    before = sum(1 for k in range(8) if first + k * 0.1 <= paused_at + 0.05)
    assert len(busy) >= 8 - before
    assert all(b.retry_after_s >= pause_until - paused_at - 1.3 for b in busy)
