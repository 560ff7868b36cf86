"""A drawing reservation and a credit-returning refund through every network fault.

As in test_budget_faults.py, the faulty client is configured as production
(``REDIS_RETRIES=1``) and reaches Redis through the fault proxy: one fault is absorbed by
redis-py's re-send (the script may run twice), two make the call fail and its caller
retries later. Whatever happens, a grant is drawn at most once per charge and gets its
credit back at most once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from local.redis_servers import RedisServer
from tests.faultproxy import Fault, FaultProxy
from tests.ledger_rig import CASES, IDS, RUNS, LedgerRig, ledger_rig
from usage_limits import LimiterUnavailable, TokenBudget, Window
from usage_limits.budget import LiveGrant, new_nonce

T0 = 1_700_000_000_000
MIN = 60_000
PLAN = [Window(limit=10, seconds=60), Window(limit=20, seconds=3600)]


class Rig(LedgerRig):
    """A user with a grant, faulty and direct."""

    async def credit(self) -> int:
        usage = await self.direct.usage(self.user, now_ms=T0 + 3 * MIN, events=0)
        return sum(g.remaining for g in usage.grants)

    async def quota(self) -> tuple[int, int]:
        """(full costs in the hour, the quota's used: what grants did not cover)."""
        plain = TokenBudget(self.direct.redis, PLAN)
        full = (await plain.usage(self.user, now_ms=T0 + 3 * MIN, events=0)).windows[1].used
        quota = (await self.direct.usage(self.user, now_ms=T0 + 3 * MIN)).windows[1].used
        return full, quota


@pytest.fixture
async def rig(redis_server: RedisServer, fault_proxy: FaultProxy) -> AsyncIterator[Rig]:
    """A user with a 10-token grant and a full hourly quota, reached faulty and direct."""
    async with ledger_rig(Rig, redis_server.port, fault_proxy, PLAN,
                          entitlements=True) as made:
        assert await made.direct.load_entitlements(
            made.user, epoch=1, plan=None, suspended_until_ms=None,
            grants=[LiveGrant("inv-1", 10, 10, None, "paid")])
        for i in range(2):
            assert (await made.direct.reserve(made.user, f"fill{i}", 10,
                                              now_ms=T0 + i * MIN)).allowed
        yield made


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_a_drawing_reserve_draws_once(rig: Rig, fault: Fault, times: int) -> None:
    """A drawing reservation through a fault draws once; its kept refund returns it once."""
    nonce = new_nonce()
    rig.arm("budget_reserve", fault, times)
    if times == 1:
        d = await rig.faulty.reserve(rig.user, "a", 3, now_ms=T0 + 2 * MIN, nonce=nonce)
        assert (d.status, d.draws, d.drawn, d.epoch) == ("charged", (("inv-1", 3),), 3, 1)
        assert await rig.credit() == 7
        assert await rig.quota() == (23, 20)
        return
    with pytest.raises(LimiterUnavailable):
        await rig.faulty.reserve(rig.user, "a", 3, now_ms=T0 + 2 * MIN, nonce=nonce)
    ran = RUNS[fault]
    assert await rig.credit() == (7 if ran else 10)
    other = await rig.direct.reserve(rig.user, "a", 2, now_ms=T0 + 2 * MIN)  # a client retry
    assert other.status == ("duplicate" if ran else "charged")
    lowered = await rig.direct.lower(rig.user, "a", 0, nonce=nonce, now_ms=T0 + 2 * MIN)
    assert lowered.returned == ((("inv-1", 3),) if ran else ())
    assert await rig.credit() == (10 if ran else 8)
    assert await rig.quota() == ((20, 20) if ran else (22, 20))


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_a_refund_returns_credit_once(rig: Rig, fault: Fault, times: int) -> None:
    """A credit-returning refund through a fault gives the credit back exactly once."""
    mine = await rig.direct.reserve(rig.user, "a", 3, now_ms=T0 + 2 * MIN)
    assert mine.draws == (("inv-1", 3),)
    rig.arm("budget_refund", fault, times)
    if times == 1:
        lowered = await rig.faulty.lower(rig.user, "a", 0, nonce=mine.nonce,
                                         now_ms=T0 + 2 * MIN)
        first_run_lost = fault in (Fault.DROP_COMMAND, Fault.CUT_COMMAND)
        # a re-send after the refund ran finds nothing left and returns nothing
        assert lowered.returned == ((("inv-1", 3),) if first_run_lost else ())
        assert await rig.credit() == 10
        assert await rig.quota() == (20, 20)
        return
    with pytest.raises(LimiterUnavailable):
        await rig.faulty.lower(rig.user, "a", 0, nonce=mine.nonce, now_ms=T0 + 2 * MIN)
    ran = RUNS[fault]
    assert await rig.credit() == (10 if ran else 7)
    retried = await rig.direct.lower(rig.user, "a", 0, nonce=mine.nonce, now_ms=T0 + 2 * MIN)
    assert retried.returned == (() if ran else (("inv-1", 3),))
    assert await rig.credit() == 10
    assert await rig.quota() == (20, 20)
