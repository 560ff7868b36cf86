"""Provider throttle against real Redis (standalone and a 3-master cluster), in one process.

Assertions use the slots and timestamps the throttle records, never the test's wall time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from local.redis_servers import RedisServer, free_port
from usage_limits import deadline
from usage_limits.exceptions import CostExceedsLimit, LimiterUnavailable, ProviderBusy
from usage_limits.keys import provider_keys
from usage_limits.throttle import ProviderThrottle, UpstreamRateLimited, throttled

EPS = 1e-6  # slots are stored with 1 µs precision


@pytest.fixture
async def client(redis_client: Any) -> Any:
    """The session's client (standalone, then cluster), ready for concurrent use.

    redis-py 8.1's async RedisCluster fails some of several concurrent first commands on a
    fresh client (ConnectionError); one initialisation before the tests avoids it.
    """
    if isinstance(redis_client, RedisCluster):
        await redis_client.initialize()
    return redis_client


def lease_keys(provider: str) -> tuple[str, str, str]:
    leases, waiters, wexpiry = provider_keys(provider, "leases", "waiters", "wexpiry")
    return leases, waiters, wexpiry


async def test_slots_are_spaced_by_the_emission_interval(client: Any, uid: str) -> None:
    """At burst 1, consecutive reservations are exactly one interval apart, in order."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=50, burst=1)
    await th.pause(0.2)  # every request below arrives before the first slot: a full queue
    got = sorted(await asyncio.gather(*(th.admit(max_wait_s=1) for _ in range(4))),
                 key=lambda a: a.seq)
    assert [a.seq for a in got] == [1, 2, 3, 4]
    for before, after in zip(got, got[1:], strict=False):
        assert after.slot_at - before.slot_at == pytest.approx(0.02, abs=EPS)
        assert after.granted_at >= after.slot_at - 0.002


async def test_the_first_slot_after_a_pause_is_kept_when_the_clocks_drift(
        client: Any, uid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wall clock runs 1% slow against the loop's (a slewing clock, or a moment between
    the two readings): the caller holding the slot at the pause's very end still goes at
    it, and takes no second slot."""
    import usage_limits.throttle as throttle_module

    real, t0 = time.time, time.time()
    slow = type("Clock", (), {"time": staticmethod(lambda: t0 + (real() - t0) * 0.99)})
    th = ProviderThrottle(client, uid, jitter_s=0, rate=50, burst=1)
    monkeypatch.setattr(throttle_module, "time", slow)
    until = await th.pause(0.2)
    got = sorted(await asyncio.gather(*(th.admit(max_wait_s=1) for _ in range(3))),
                 key=lambda a: a.seq)
    assert [a.seq for a in got] == [1, 2, 3]
    assert got[0].slot_at == pytest.approx(until, abs=EPS)


async def test_burst_is_admitted_at_once_then_the_rate(client: Any, uid: str) -> None:
    """A burst of 3 starts immediately; the 4th call's slot is one interval later."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=10, burst=3)
    first = [await th.admit(max_wait_s=0) for _ in range(3)]
    assert all(a.slot_at - a.requested_at <= 0.001 for a in first)
    with pytest.raises(ProviderBusy) as busy:
        await th.acquire(max_wait_s=0)
    assert 0 < busy.value.retry_after_s <= 0.1
    assert busy.value.provider == uid


async def test_weighted_cost_uses_the_same_bucket(client: Any, uid: str) -> None:
    """A cost of 50 at 100/s fills a 50-unit burst; the next 10 units wait 0.1 s of slots."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=100, burst=50)
    a = await th.admit(cost=50, max_wait_s=0)
    b = await th.admit(cost=10, max_wait_s=1)
    assert b.slot_at - a.slot_at == pytest.approx(0.1, abs=EPS)


async def test_cost_above_burst_touches_nothing(client: Any, uid: str) -> None:
    """CostExceedsLimit is raised clearly and nothing is written to Redis."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=10, burst=2)
    with pytest.raises(CostExceedsLimit, match="above the burst capacity"):
        await th.acquire(cost=3)
    assert await client.exists(*provider_keys(uid, "gcra")) == 0


async def test_rejected_requests_do_not_push_back_others(client: Any, uid: str) -> None:
    """A request refused for its short wait reserves nothing: the next one gets its slot."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=5, burst=1)
    first = await th.admit(max_wait_s=0)
    for _ in range(5):
        with pytest.raises(ProviderBusy):
            await th.acquire(max_wait_s=0)
    second = await th.admit(max_wait_s=1)
    assert second.seq == first.seq + 1
    assert second.slot_at == pytest.approx(first.slot_at + 0.2, abs=EPS)


async def test_never_waits_past_max_wait(client: Any, uid: str) -> None:
    """Admitted calls wait at most max_wait_s; the others get ProviderBusy with Retry-After."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=20, burst=1)
    results = await asyncio.gather(*(th.admit(max_wait_s=0.12) for _ in range(6)),
                                   return_exceptions=True)
    admitted = [r for r in results if not isinstance(r, BaseException)]
    busy = [r for r in results if isinstance(r, ProviderBusy)]
    assert len(admitted) + len(busy) == 6
    assert admitted and busy  # slots 50 ms apart: three or so fit in 120 ms, six never
    for a in admitted:
        assert a.slot_at - a.requested_at <= 0.12 + EPS
        assert a.waited_s <= 0.12 + 0.05  # wake-up lateness on a shared machine
    assert all(b.retry_after_s > 0.12 for b in busy)


async def test_deadline_clamps_the_wait(client: Any, uid: str) -> None:
    """Inside a request deadline, a longer max_wait_s is clamped to the time left."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=5, burst=1)
    await th.acquire(max_wait_s=0)
    with deadline.deadline_scope(0.05), pytest.raises(ProviderBusy) as busy:
        await th.acquire(max_wait_s=10)
    assert busy.value.retry_after_s > 0.05
    with deadline.deadline_scope(1.0):
        a = await th.admit()  # the default wait is the deadline
    assert a.slot_at - a.requested_at <= 1.0


async def test_pause_holds_back_every_instance(client: Any, uid: str) -> None:
    """A pause set through one throttle object delays the slots of another one."""
    one = ProviderThrottle(client, uid, jitter_s=0, rate=100, burst=5)
    other = ProviderThrottle(client, uid, jitter_s=0, rate=100, burst=5)
    until = await one.pause(0.3)
    assert await one.pause(0.05) == until  # a shorter pause never shortens it
    with pytest.raises(ProviderBusy) as busy:
        await other.acquire(max_wait_s=0)
    assert 0 < busy.value.retry_after_s <= 0.3
    a = await other.admit(max_wait_s=1)
    assert a.slot_at >= until - EPS
    assert a.granted_at >= until - 0.002


async def test_pause_does_not_reset_the_bucket(client: Any, uid: str) -> None:
    """After a pause the rate continues: burst then one interval per unit, never more."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=50, burst=2)
    until = await th.pause(0.1)
    got = [await th.admit(max_wait_s=1) for _ in range(4)]
    assert all(a.slot_at >= until - EPS for a in got)
    assert got[3].slot_at - got[0].slot_at >= 2 * 0.02 - EPS


async def test_one_script_call_per_admission(standalone_client: Any, uid: str) -> None:
    """Each admission costs exactly one EVALSHA and no other command."""
    th = ProviderThrottle(standalone_client, uid, jitter_s=0, rate=1000, burst=20)
    await th.acquire(max_wait_s=1)  # loads the script
    before = await standalone_client.info("commandstats")
    for _ in range(10):
        await th.acquire(max_wait_s=1)
    after = await standalone_client.info("commandstats")

    def calls(stats: dict[str, Any], name: str) -> int:
        return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))

    assert calls(after, "evalsha") - calls(before, "evalsha") == 10
    assert calls(after, "eval") == calls(before, "eval")


async def test_script_flush_is_recovered(client: Any, redis_server: RedisServer,
                                         redis_cluster: Any, uid: str) -> None:
    """After SCRIPT FLUSH the scripts are sent again (NOSCRIPT) and keep working."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=1000, burst=10, max_concurrency=2)
    await th.acquire(max_wait_s=1)
    for server in [redis_server, *redis_cluster.nodes]:
        server.cli("script", "flush")
    await th.acquire(max_wait_s=1)
    await th.pause(0)
    async with th.slot(max_wait_s=1):
        pass


async def test_redis_down_is_limiter_unavailable(uid: str) -> None:
    """With Redis stopped every operation raises LimiterUnavailable (fail closed)."""
    with RedisServer() as server:
        client = aioredis.Redis(port=server.port, socket_timeout=1, socket_connect_timeout=1,
                                retry=Retry(NoBackoff(), 0))
        th = ProviderThrottle(client, uid, jitter_s=0, rate=10, max_concurrency=1)
        await th.acquire(max_wait_s=0)
        server.stop(kill=True)
        with pytest.raises(LimiterUnavailable):
            await th.acquire(max_wait_s=1)
        with pytest.raises(LimiterUnavailable):
            await th.pause(1)
        with pytest.raises(LimiterUnavailable):
            async with th.slot(max_wait_s=1):
                pass
        await client.aclose()


async def test_cluster_down_is_limiter_unavailable(uid: str) -> None:
    """A cluster client that reaches no node raises LimiterUnavailable too."""
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", free_port())],
                          socket_timeout=0.5, socket_connect_timeout=0.5)
    th = ProviderThrottle(client, uid, jitter_s=0, rate=10)
    with pytest.raises(LimiterUnavailable):
        await th.acquire(max_wait_s=0)
    await client.aclose()


async def test_lease_caps_calls_in_flight(client: Any, uid: str) -> None:
    """With max_concurrency=2 no more than two blocks run at once; the rest wait their turn."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=1000, burst=10, max_concurrency=2,
                          lease_s=5)
    inside: list[int] = []
    peak = 0

    async def job() -> None:
        nonlocal peak
        async with th.slot(max_wait_s=5):
            inside.append(1)
            peak = max(peak, len(inside))
            await asyncio.sleep(0.03)
            inside.pop()

    await asyncio.gather(*(job() for _ in range(8)))
    assert peak == 2
    assert await client.zcard(lease_keys(uid)[0]) == 0


async def test_release_wakes_the_next_waiter(client: Any, uid: str) -> None:
    """A waiter enters only after the holder's block exits, woken by the release."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=1000, burst=10, max_concurrency=1,
                          lease_s=5)
    exited: list[float] = []
    entered: list[float] = []

    async def holder() -> None:
        async with th.slot(max_wait_s=1):
            await asyncio.sleep(0.15)
            exited.append(time.time())

    async def waiter() -> None:
        await asyncio.sleep(0.03)
        async with th.slot(max_wait_s=3):
            entered.append(time.time())

    await asyncio.gather(holder(), waiter())
    assert entered[0] >= exited[0]


async def test_lease_waiters_are_served_in_arrival_order(client: Any, uid: str) -> None:
    """Queued callers get the lease in the order they arrived, not in wake-up order."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=1000, burst=10, max_concurrency=1,
                          lease_s=5)
    _, waiters_key, _ = lease_keys(uid)
    order: list[int] = []
    release = asyncio.Event()

    async def holder() -> None:
        async with th.slot(max_wait_s=1):
            await release.wait()

    async def waiter(i: int) -> None:
        async with th.slot(max_wait_s=5):
            order.append(i)
            await asyncio.sleep(0.005)

    hold = asyncio.create_task(holder())
    await _until(lambda: client.zcard(lease_keys(uid)[0]), 1)
    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(waiter(i)))
        await _until(lambda: client.zcard(waiters_key), i + 1)  # queued before the next arrives
    release.set()
    await asyncio.gather(hold, *tasks)
    assert order == [0, 1, 2, 3, 4]


async def test_lease_wait_times_out_and_leaves_the_queue(client: Any, uid: str) -> None:
    """A waiter that cannot get a lease in time gets ProviderBusy and leaves the queue."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=1000, burst=10, max_concurrency=1,
                          lease_s=5)
    async with th.slot(max_wait_s=1):
        with pytest.raises(ProviderBusy) as busy:
            async with th.slot(max_wait_s=0.1):
                pass
        assert 0 < busy.value.retry_after_s <= 5
        with pytest.raises(ProviderBusy):
            async with th.slot(max_wait_s=0):
                pass
    _, waiters_key, wexpiry_key = lease_keys(uid)
    assert await client.zcard(waiters_key) == 0
    assert await client.zcard(wexpiry_key) == 0


async def test_late_rate_slot_gives_the_lease_back(client: Any, uid: str) -> None:
    """When the rate slot comes too late, the lease taken for it is released at once."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=1, burst=1, max_concurrency=1, lease_s=5)
    async with th.slot(max_wait_s=0):
        pass
    with pytest.raises(ProviderBusy) as busy:
        async with th.slot(max_wait_s=0.1):
            pass
    assert busy.value.retry_after_s > 0.1
    assert await client.zcard(lease_keys(uid)[0]) == 0


async def test_expired_lease_frees_its_place(client: Any, uid: str) -> None:
    """A lease whose holder vanished (never released) stops counting when it expires."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=1000, burst=10, max_concurrency=1,
                          lease_s=5)
    leases_key = lease_keys(uid)[0]
    expires = time.time() + 0.3
    await client.zadd(leases_key, {"vanished": expires * 1000})
    async with th.slot(max_wait_s=3):
        entered = time.time()
    assert entered >= expires


async def test_dead_waiter_leaves_the_queue(client: Any, uid: str) -> None:
    """A queued caller that stopped coming back is dropped after its entry expires."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=1000, burst=10, max_concurrency=1,
                          lease_s=5)
    _, waiters_key, wexpiry_key = lease_keys(uid)
    expires = time.time() + 0.3
    await client.zadd(waiters_key, {"ghost": 1})
    await client.zadd(wexpiry_key, {"ghost": expires * 1000})
    async with th.slot(max_wait_s=3):
        entered = time.time()
    assert entered >= expires
    assert await client.zcard(waiters_key) == 0


async def test_throttled_method_holds_its_lease(client: Any, uid: str) -> None:
    """A decorated client method runs at most max_concurrency at once, charging its cost."""
    class Client:
        def __init__(self) -> None:
            self.throttle = ProviderThrottle(client, uid, jitter_s=0, rate=1000, burst=10,
                                             max_concurrency=1, lease_s=5)
            self.running = 0
            self.peak = 0

        @throttled(cost=lambda self, n: n)
        async def fetch(self, n: int) -> int:
            self.running += 1
            self.peak = max(self.peak, self.running)
            await asyncio.sleep(0.01)
            self.running -= 1
            return n

    client = Client()
    assert await asyncio.gather(*(client.fetch(i + 1) for i in range(4))) == [1, 2, 3, 4]
    assert client.peak == 1
    with pytest.raises(CostExceedsLimit):
        await client.fetch(11)


async def test_upstream_429_pauses_and_retries(client: Any, uid: str) -> None:
    """UpstreamRateLimited pauses the provider for everyone and the call is retried after it."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=100, burst=5)
    other = ProviderThrottle(client, uid, jitter_s=0, rate=100, burst=5)
    started: list[float] = []

    async def upstream() -> str:
        started.append(time.time())
        if len(started) == 1:
            raise UpstreamRateLimited(0.2)
        return "ok"

    result, bystander = await asyncio.gather(
        th.call(upstream, retries=1),
        _after(0.1, other.admit(max_wait_s=2)))
    assert result == "ok"
    assert started[1] - started[0] >= 0.2 - 0.002
    assert bystander.slot_at >= started[0] + 0.2 - 0.01


async def test_upstream_429_without_retries_is_provider_busy(client: Any, uid: str) -> None:
    """Out of retries, the 429 becomes ProviderBusy carrying the upstream's Retry-After."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=100, burst=5)

    async def upstream() -> None:
        raise UpstreamRateLimited(0.5)

    with pytest.raises(ProviderBusy) as busy:
        await th.call(upstream, retries=0)
    assert isinstance(busy.value.__cause__, UpstreamRateLimited)
    assert 0.4 < busy.value.retry_after_s <= 0.5


async def test_upstream_429_past_the_deadline_is_not_retried(client: Any, uid: str) -> None:
    """A Retry-After beyond the request's deadline fails at once instead of waiting."""
    th = ProviderThrottle(client, uid, jitter_s=0, rate=100, burst=5)
    calls = 0

    async def upstream() -> None:
        nonlocal calls
        calls += 1
        raise UpstreamRateLimited(5)

    with deadline.deadline_scope(1.0), pytest.raises(ProviderBusy) as busy:
        await th.call(upstream, retries=3)
    assert calls == 1
    assert busy.value.retry_after_s > 4


async def _after(delay: float, coro: Any) -> Any:
    await asyncio.sleep(delay)
    return await coro


async def _until(count: Any, at_least: int) -> None:
    """Poll Redis until ``await count()`` reaches ``at_least``."""
    for _ in range(1000):
        if await count() >= at_least:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never reached {at_least}")


async def test_standalone_waiters_are_woken_by_pub_sub(standalone_client: Any, uid: str) -> None:
    """On a standalone client a release wakes the waiter before its safety-net poll, and the
    shared subscription is gone once nobody waits."""
    from usage_limits._semaphore import SUBSCRIBED_POLL_S

    th = ProviderThrottle(standalone_client, uid, jitter_s=0, rate=1000, burst=10,
                          max_concurrency=1, lease_s=30)
    [channel] = provider_keys(uid, "free")
    exited: list[float] = []
    entered: list[float] = []
    subscribers: list[int] = []

    async def holder() -> None:
        async with th.slot(max_wait_s=1):
            await _until(lambda: standalone_client.zcard(lease_keys(uid)[1]), 1)
            await asyncio.sleep(0.05)  # the waiter subscribes, then re-checks
            subscribers.append((await standalone_client.pubsub_numsub(channel))[0][1])
            exited.append(time.time())

    async def waiter() -> None:
        await asyncio.sleep(0.01)
        async with th.slot(max_wait_s=5):
            entered.append(time.time())

    await asyncio.gather(holder(), waiter())
    assert subscribers == [1]
    assert entered[0] - exited[0] < SUBSCRIBED_POLL_S
    for _ in range(100):  # the listener task closes its connection once cancelled
        if (await standalone_client.pubsub_numsub(channel))[0][1] == 0:
            break
        await asyncio.sleep(0.01)
    assert (await standalone_client.pubsub_numsub(channel))[0][1] == 0
    assert th._semaphore is not None and th._semaphore._wakeups is not None
    assert th._semaphore._wakeups._task is None


async def test_jitter_allowance_spaces_slots_for_late_dispatch(client: Any, uid: str) -> None:
    """With a dispatch allowance, slots are at least (per_s + jitter_s) / rate apart, so calls
    that leave up to jitter_s late still fit the provider's window."""
    th = ProviderThrottle(client, uid, rate=5, burst=1, jitter_s=0.05)
    await th.pause(0.1)
    got = sorted(await asyncio.gather(*(th.admit(max_wait_s=3) for _ in range(6))),
                 key=lambda a: a.seq)
    gaps = [b.slot_at - a.slot_at for a, b in zip(got, got[1:], strict=False)]
    # A queued caller that asks for its slot late (a busy host) books it late: never closer.
    assert all(g >= 1.05 / 5 - EPS for g in gaps), gaps
    assert min(gaps) == pytest.approx(1.05 / 5, abs=EPS)
    # Worst case for the provider: the first call leaves jitter_s late, the sixth on time.
    assert (got[5].slot_at) - (got[0].slot_at + 0.05) >= 1.0 - EPS


async def test_late_waker_gives_up_its_slot_and_takes_a_new_one(
        client: Any, uid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that wakes later than jitter_s after its slot does not go: it re-admits behind
    the queue."""
    import usage_limits.throttle as throttle_mod

    th = ProviderThrottle(client, uid, rate=20, burst=1, jitter_s=0.01)
    real_sleep_until = throttle_mod._sleep_until
    overslept = []

    async def oversleep_once(loop: Any, when: float) -> None:
        await real_sleep_until(loop, when)
        if not overslept:
            overslept.append(when)
            await asyncio.sleep(0.08)  # a busy loop or a descheduled process

    monkeypatch.setattr(throttle_mod, "_sleep_until", oversleep_once)
    a = await th.admit(max_wait_s=2)
    assert overslept and a.seq == 2  # the first reservation was given up unused
    assert a.granted_at - a.slot_at <= 0.01 + 0.005


async def test_late_wakers_give_up_when_the_deadline_is_near(
        client: Any, uid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that keeps waking late never goes late; it ends with ProviderBusy."""
    import usage_limits.throttle as throttle_mod

    th = ProviderThrottle(client, uid, rate=20, burst=1, jitter_s=0.01)
    real_sleep_until = throttle_mod._sleep_until

    async def always_late(loop: Any, when: float) -> None:
        await real_sleep_until(loop, when)
        await asyncio.sleep(0.03)

    monkeypatch.setattr(throttle_mod, "_sleep_until", always_late)
    with pytest.raises(ProviderBusy):
        await th.acquire(max_wait_s=2)


async def test_a_light_user_is_not_queued_behind_a_heavy_users_backlog(client: Any,
                                                                        uid: str) -> None:
    """While one user has 6 requests queued, another user's single request books within one
    turn of the two users, not behind the whole backlog; each user alone keeps its order."""
    th = ProviderThrottle(client, uid, rate=20, burst=1, jitter_s=0)
    heavy = [asyncio.create_task(th.admit(max_wait_s=3, user="heavy")) for _ in range(6)]
    await asyncio.sleep(0.06)  # the heavy user's first slot is booked, 5 wait
    light = await th.admit(max_wait_s=3, user="light")
    got = await asyncio.gather(*heavy)
    booked_before = sum(1 for a in got if a.seq < light.seq)
    assert booked_before <= 3  # its first (booked), the one at its turn, at most one more
    assert sorted(a.seq for a in got) == [a.seq for a in sorted(got, key=lambda a: a.slot_at)]


async def test_a_weighted_user_gets_its_share(client: Any, uid: str) -> None:
    """Two users with 6 requests queued each, of weights 2 and 1: of the first 6 slots
    after the first, the heavier weight books 4 (within one request)."""
    th = ProviderThrottle(client, uid, rate=20, burst=1, jitter_s=0)
    await th.admit(max_wait_s=1, user="first")  # every request below queues
    tasks = [asyncio.create_task(th.admit(max_wait_s=5, user=user, weight=weight))
             for _ in range(6) for user, weight in (("gold", 2.0), ("free", 1.0))]
    got = sorted(zip(await asyncio.gather(*tasks), ["gold", "free"] * 6, strict=True),
                 key=lambda pair: pair[0].seq)
    gold = sum(1 for _, user in got[:6] if user == "gold")
    assert 3 <= gold <= 5
