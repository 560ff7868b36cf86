"""Every budget script through every network fault, with the client configured as production.

The client reaches Redis through the fault-injecting proxy and is made by
``redis_from_env`` with ``REDIS_RETRIES=1``: a command whose reply is lost is re-sent once,
so a script may run twice. One fault (``times=1``) is absorbed by that re-send; two
(``times=2``) make the call fail with ``LimiterUnavailable``, and the caller then retries
its call later, after another caller may have charged the same request id (the client's
retry served by another environment). In every case: nothing is charged twice, nothing is
refunded or lowered that was not this caller's, and the totals are exact afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from local.redis_servers import RedisServer
from tests.faultproxy import Fault, FaultProxy, script_sha
from usage_limits import LimiterUnavailable, TokenBudget, Window
from usage_limits._scripts import script
from usage_limits.budget import new_nonce
from usage_limits.connection import redis_from_env

T0 = 1_700_000_000_000
PLAN = [Window(limit=50, seconds=60), Window(limit=200, seconds=3600)]
SOCKET_TIMEOUT_S = 0.25
#: Faults and whether the script ran on Redis before the client lost it.
RUNS = {Fault.DROP_COMMAND: False, Fault.CUT_COMMAND: False, Fault.DROP_REPLY: True,
        Fault.DELAY: True, Fault.CUT_REPLY: True, Fault.DUPLICATE: True}
CASES = [(fault, times) for fault in Fault for times in (1, 2)
         if not (fault is Fault.DUPLICATE and times == 2)]  # a duplicate never fails a call
IDS = [f"{f.value}x{t}" for f, t in CASES]


@dataclass
class Rig:
    faulty: TokenBudget  # through the proxy, configured as production
    direct: TokenBudget  # straight to Redis: what the ledger really holds
    proxy: FaultProxy
    user: str

    def arm(self, name: str, fault: Fault, times: int) -> None:
        self.proxy.inject(fault, match=script_sha(script(name).sha), times=times,
                          delay_s=2 * SOCKET_TIMEOUT_S)

    async def used(self) -> list[int]:
        return [w.used for w in (await self.direct.usage(self.user, now_ms=T0 + 10)).windows]

    async def events(self) -> list[tuple[str, int]]:
        usage = await self.direct.usage(self.user, now_ms=T0 + 10)
        return sorted((e.request_id, e.cost) for e in usage.events)


@pytest.fixture
async def rig(redis_server: RedisServer, fault_proxy: FaultProxy) -> AsyncIterator[Rig]:
    """A faulty and a direct ledger over the same redis-server, and a fresh user."""
    faulty_client = redis_from_env(url=fault_proxy.url, retries=1,
                                   socket_timeout_s=SOCKET_TIMEOUT_S)
    direct_client = aioredis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=5)
    try:
        yield Rig(TokenBudget(faulty_client, PLAN), TokenBudget(direct_client, PLAN),
                  fault_proxy, uuid.uuid4().hex)
    finally:
        fault_proxy.clear()
        await faulty_client.aclose()
        await direct_client.aclose()


async def _other_caller_charges(rig: Rig, rid: str, cost: int) -> bool:
    """Another environment reserves ``rid`` (the client's retry); True when it charged."""
    d = await rig.direct.reserve(rig.user, rid, cost, now_ms=T0 + 5)
    assert d.allowed
    return not d.duplicate


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_reserve_charges_once(rig: Rig, fault: Fault, times: int) -> None:
    """A reservation through a fault charges at most once; when it failed, its caller's
    refund later removes its own charge and never the other caller's."""
    await rig.direct.reserve(rig.user, "bystander", 3, now_ms=T0)
    nonce = new_nonce()
    rig.arm("budget_reserve", fault, times)
    if times == 1:
        d = await rig.faulty.reserve(rig.user, "a", 5, now_ms=T0 + 1, nonce=nonce)
        assert d.allowed and not d.duplicate  # a re-send is recognised as the same call
        assert [w.used for w in d.windows] == [8, 8]
        assert await rig.used() == [8, 8]
        assert await rig.events() == [("a", 5), ("bystander", 3)]
        return
    with pytest.raises(LimiterUnavailable):
        await rig.faulty.reserve(rig.user, "a", 5, now_ms=T0 + 1, nonce=nonce)
    ran = RUNS[fault]
    assert await rig.used() == ([8, 8] if ran else [3, 3])  # charged once, or not at all
    other_charged = await _other_caller_charges(rig, "a", 7)
    assert other_charged is not ran
    # the kept refund of the failed call, once Redis answers again
    assert await rig.direct.refund(rig.user, "a", nonce=nonce) is ran
    assert await rig.events() == ([("a", 7)] if other_charged else []) + [("bystander", 3)]
    assert await rig.used() == ([10, 10] if other_charged else [3, 3])


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_refund_removes_only_its_own_charge(rig: Rig, fault: Fault, times: int) -> None:
    """A refund through a fault removes its caller's charge once, and a refund retried
    after it failed leaves the charge that another caller made since."""
    await rig.direct.reserve(rig.user, "bystander", 3, now_ms=T0)
    mine = await rig.direct.reserve(rig.user, "a", 5, now_ms=T0 + 1)
    rig.arm("budget_refund", fault, times)
    if times == 1:
        removed = await rig.faulty.refund(rig.user, "a", nonce=mine.nonce)
        # a re-send after the refund ran finds nothing left and says so
        assert removed is (fault in (Fault.DROP_COMMAND, Fault.CUT_COMMAND))
        assert await rig.events() == [("bystander", 3)]
        assert await rig.used() == [3, 3]
        return
    with pytest.raises(LimiterUnavailable):
        await rig.faulty.refund(rig.user, "a", nonce=mine.nonce)
    ran = RUNS[fault]
    assert await rig.used() == ([3, 3] if ran else [8, 8])
    other_charged = await _other_caller_charges(rig, "a", 7)
    assert other_charged is ran
    assert await rig.direct.refund(rig.user, "a", nonce=mine.nonce) is not ran  # kept refund
    assert await rig.events() == ([("a", 7)] if other_charged else []) + [("bystander", 3)]
    assert await rig.used() == ([10, 10] if other_charged else [3, 3])


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_settle_lowers_once_and_only_its_own(rig: Rig, fault: Fault, times: int) -> None:
    """A settle through a fault lowers its caller's charge to the new cost exactly once;
    retried after a failure it never lowers another caller's charge."""
    await rig.direct.reserve(rig.user, "bystander", 3, now_ms=T0)
    mine = await rig.direct.reserve(rig.user, "a", 9, now_ms=T0 + 1)
    rig.arm("budget_refund", fault, times)  # settle runs the refund script
    if times == 1:
        lowered = await rig.faulty.settle(rig.user, "a", 4, nonce=mine.nonce)
        assert lowered is (fault in (Fault.DROP_COMMAND, Fault.CUT_COMMAND))
        assert await rig.events() == [("a", 4), ("bystander", 3)]
        assert await rig.used() == [7, 7]
        return
    with pytest.raises(LimiterUnavailable):
        await rig.faulty.settle(rig.user, "a", 4, nonce=mine.nonce)
    ran = RUNS[fault]
    assert await rig.used() == ([7, 7] if ran else [12, 12])
    # a stranger's settle of the same id lowers nothing
    assert await rig.direct.settle(rig.user, "a", 1, nonce=new_nonce()) is False
    assert await rig.direct.settle(rig.user, "a", 4, nonce=mine.nonce) is not ran  # retried
    assert await rig.events() == [("a", 4), ("bystander", 3)]
    assert await rig.used() == [7, 7]


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_usage_reads_the_same_through_faults(rig: Rig, fault: Fault, times: int) -> None:
    """A usage read through a fault answers the true totals (or fails) and changes nothing."""
    await rig.direct.reserve(rig.user, "a", 5, now_ms=T0)
    await rig.direct.reserve(rig.user, "b", 3, now_ms=T0 + 1)
    rig.arm("budget_usage", fault, times)
    if times == 1:
        usage = await rig.faulty.usage(rig.user, now_ms=T0 + 10)
        assert [w.used for w in usage.windows] == [8, 8]
        assert sorted((e.request_id, e.cost) for e in usage.events) == [("a", 5), ("b", 3)]
    else:
        with pytest.raises(LimiterUnavailable):
            await rig.faulty.usage(rig.user, now_ms=T0 + 10)
    assert await rig.used() == [8, 8]
    assert await rig.events() == [("a", 5), ("b", 3)]
