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

from collections.abc import AsyncIterator

import pytest

from local.redis_servers import RedisServer
from tests.faultproxy import Fault, FaultProxy
from tests.ledger_rig import CASES, IDS, RUNS, LedgerRig, ledger_rig
from usage_limits import LimiterUnavailable, Window
from usage_limits.budget import new_nonce

T0 = 1_700_000_000_000
PLAN = [Window(limit=50, seconds=60), Window(limit=200, seconds=3600)]


class Rig(LedgerRig):
    """A fresh user's ledger, faulty and direct."""

    async def used(self) -> list[int]:
        return [w.used for w in (await self.direct.usage(self.user, now_ms=T0 + 10)).windows]

    async def events(self) -> list[tuple[str, int]]:
        usage = await self.direct.usage(self.user, now_ms=T0 + 10)
        return sorted((e.request_id, e.cost) for e in usage.events)


@pytest.fixture
async def rig(redis_server: RedisServer, fault_proxy: FaultProxy) -> AsyncIterator[Rig]:
    """A faulty and a direct ledger over the same redis-server, and a fresh user."""
    async with ledger_rig(Rig, redis_server.port, fault_proxy, PLAN) as made:
        yield made


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


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_confirm_through_faults_confirms_once_or_leaves_it_provisional(
        rig: Rig, fault: Fault, times: int) -> None:
    """A confirm through a fault either confirms the charge (no later claim takes it) or,
    when it never ran, leaves it provisional, to be claimed once its hold ended."""
    mine = await rig.direct.reserve(rig.user, "a", 5, now_ms=T0, hold_ms=100)
    rig.arm("budget_hold", fault, times)
    if times == 1:
        held = await rig.faulty.hold(rig.user, "a", nonce=mine.nonce, now_ms=T0 + 10)
        assert held.confirmed is True  # a re-send answers as the first run did
        ran = True
    else:
        with pytest.raises(LimiterUnavailable):
            await rig.faulty.hold(rig.user, "a", nonce=mine.nonce, now_ms=T0 + 10)
        ran = RUNS[fault]
    later = await rig.direct.hold(rig.user, now_ms=T0 + 1_000)
    assert [c.request_id for c in later.claimed] == ([] if ran else ["a"])
    assert await rig.used() == [5, 5]  # nothing undone by the confirm itself
    # the request answered 503 when its confirm failed: its refund removes the charge once
    assert await rig.direct.refund(rig.user, "a", nonce=mine.nonce) is True
    assert await rig.used() == [0, 0]


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_claim_through_faults_tells_the_charge_until_it_is_refunded(
        rig: Rig, fault: Fault, times: int) -> None:
    """A claim through a fault claims an expired charge once; whether or not its answer came
    back, the next claim tells it again, its own request can no longer confirm it once a
    claim ran, and its refund by nonce removes it once."""
    mine = await rig.direct.reserve(rig.user, "a", 5, now_ms=T0, hold_ms=100)
    rig.arm("budget_hold", fault, times)
    if times == 1:
        held = await rig.faulty.hold(rig.user, now_ms=T0 + 200)
        assert [(c.request_id, c.nonce) for c in held.claimed] == [("a", mine.nonce)]
    else:
        with pytest.raises(LimiterUnavailable):
            await rig.faulty.hold(rig.user, now_ms=T0 + 200)
    again = await rig.direct.hold(rig.user, now_ms=T0 + 200)
    assert [(c.request_id, c.cost) for c in again.claimed] == [("a", 5)]
    assert (await rig.direct.hold(rig.user, "a", nonce=mine.nonce)).confirmed is False
    assert await rig.direct.refund(rig.user, "a", nonce=mine.nonce) is True
    assert await rig.direct.refund(rig.user, "a", nonce=mine.nonce) is False
    assert (await rig.direct.hold(rig.user, now_ms=T0 + 300)).claimed == ()
    assert await rig.used() == [0, 0]
