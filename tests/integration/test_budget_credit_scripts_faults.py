"""The newer entitlement scripts through every network fault, and under errors raised
mid-script: a draw moved onto a reloaded copy (budget_draw_rebase.lua), the mark a load
begins with (budget_ent_mark.lua), one charge read by its id (budget_charge.lua), and a
refund's credit argument (the record of truth's return, ARGV[7]) and its uncross
argument (budget_refund.lua).

As in test_budget_grants_faults.py the faulty client is configured as production
(``REDIS_RETRIES=1``) and reaches Redis through the fault proxy: one fault is absorbed by
redis-py's re-send (the script may run twice), two make the call fail and its caller
retries. Whatever happens, money moves exactly once or not at all.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from local.redis_servers import RedisServer
from tests.faultproxy import Fault, FaultProxy
from tests.ledger_rig import CASES, IDS, RUNS, LedgerRig, ledger_rig
from usage_limits import LimiterUnavailable, TokenBudget, Window
from usage_limits._scripts import error_kind
from usage_limits.budget import LiveGrant
from usage_limits.thresholds import Thresholds

T0 = 1_700_000_000_000
MIN = 60_000
PLAN = [Window(limit=10, seconds=60), Window(limit=20, seconds=3600)]
GRANT = [LiveGrant("inv-1", 10, 10, None, "paid")]


class Rig(LedgerRig):
    """A user with a 10-token grant and a full hourly quota, faulty and direct."""

    async def credit(self, user: str | None = None) -> int:
        usage = await self.direct.usage(user or self.user, now_ms=T0 + 2 * MIN + 1, events=0)
        return sum(g.remaining for g in usage.grants)

    async def used(self, user: str | None = None) -> list[int]:
        """Each window's used tokens just after the test's charge (the quota window counts
        what credit did not pay)."""
        usage = await self.direct.usage(user or self.user, now_ms=T0 + 2 * MIN + 1, events=0)
        return [w.used for w in usage.windows]


@pytest.fixture
async def rig(redis_server: RedisServer, fault_proxy: FaultProxy) -> AsyncIterator[Rig]:
    """The rig's user has its copy at epoch 1 and a full hourly quota: charges draw."""
    async with ledger_rig(Rig, redis_server.port, fault_proxy, PLAN, entitlements=True,
                          thresholds=Thresholds((80, 100), 5)) as made:
        assert await made.direct.load_entitlements(
            made.user, epoch=1, plan=None, suspended_until_ms=None, grants=GRANT)
        for i in range(2):
            assert (await made.direct.reserve(made.user, f"fill{i}", 10,
                                              now_ms=T0 + i * MIN)).allowed
        yield made


async def _reloaded_after_a_draw(rig: Rig) -> str:
    """A charge drew 3 from the copy at epoch 1; then a load at epoch 2 installed the
    record of truth, which never recorded that draw. Returns the charge's nonce."""
    d = await rig.direct.reserve(rig.user, "a", 3, now_ms=T0 + 2 * MIN)
    assert d.draws == (("inv-1", 3),) and await rig.credit() == 7
    assert await rig.direct.load_entitlements(rig.user, epoch=2, plan=None,
                                              suspended_until_ms=None, grants=GRANT)
    assert await rig.credit() == 10
    return d.nonce


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_a_rebase_moves_the_draw_once(rig: Rig, fault: Fault, times: int) -> None:
    """Moving a draw onto the reloaded copy through a fault takes its credit from the new
    copy once; a retry after a failed call finds it moved and takes nothing more."""
    nonce = await _reloaded_after_a_draw(rig)
    rig.arm("budget_draw_rebase", fault, times)
    if times == 1:
        assert await rig.faulty.rebase_draw(rig.user, "a", nonce=nonce,
                                            now_ms=T0 + 2 * MIN) == (1, 2)
        assert await rig.credit() == 7
        return
    with pytest.raises(LimiterUnavailable):
        await rig.faulty.rebase_draw(rig.user, "a", nonce=nonce, now_ms=T0 + 2 * MIN)
    assert await rig.credit() == (7 if RUNS[fault] else 10)
    assert await rig.direct.rebase_draw(rig.user, "a", nonce=nonce,
                                        now_ms=T0 + 2 * MIN) == (1, 2)
    assert await rig.credit() == 7
    lowered = await rig.direct.lower(rig.user, "a", 0, nonce=nonce, now_ms=T0 + 2 * MIN)
    assert lowered.returned == (("inv-1", 3),)  # the draw stands once, and comes back once
    assert await rig.credit() == 10


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_a_mark_never_moves_credit(rig: Rig, fault: Fault, times: int) -> None:
    """A load's mark through a fault leaves a loaded copy as it was; on a user without a
    copy it is made at most once, and a marked load is written only when it was made."""
    fresh = uuid.uuid4().hex
    if times == 1:
        rig.arm("budget_ent_mark", fault, times)
        assert await rig.faulty.mark_entitlements(rig.user) is False  # a copy is there
        rig.arm("budget_ent_mark", fault, times)
        marked = await rig.faulty.mark_entitlements(fresh)
        # a re-send after the mark was made finds it made
        assert marked is (fault in (Fault.DROP_COMMAND, Fault.CUT_COMMAND))
        made = True
    else:
        for user in (rig.user, fresh):
            rig.arm("budget_ent_mark", fault, times)
            with pytest.raises(LimiterUnavailable):
                await rig.faulty.mark_entitlements(user)
        made = RUNS[fault]
    assert await rig.credit() == 10 and await rig.used() == [0, 20]  # nothing moved
    written = await rig.direct.load_entitlements(fresh, epoch=1, plan=None,
                                                 suspended_until_ms=None, grants=GRANT,
                                                 marked=True)
    assert written is made
    assert await rig.credit(fresh) == (10 if made else 0)


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_reading_a_charge_changes_nothing(rig: Rig, fault: Fault, times: int) -> None:
    """One charge read by its id through a fault is the charge as stored, or an error;
    the ledger and the copy are unchanged either way."""
    d = await rig.direct.reserve(rig.user, "a", 3, now_ms=T0 + 2 * MIN)
    stored = await rig.direct.charge(rig.user, "a")
    assert stored is not None and stored.draws == (("inv-1", 3),) and stored.nonce == d.nonce
    rig.arm("budget_charge", fault, times)
    if times == 1:
        assert await rig.faulty.charge(rig.user, "a") == stored
    else:
        with pytest.raises(LimiterUnavailable):
            await rig.faulty.charge(rig.user, "a")
    assert await rig.direct.charge(rig.user, "a") == stored
    assert await rig.credit() == 7 and await rig.used() == [3, 20]


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_a_refund_with_the_records_credit_gives_it_once(rig: Rig, fault: Fault,
                                                              times: int) -> None:
    """A refund carrying what the record of truth returned (ARGV[7]) gives exactly that
    back to the copy once through a fault; a retry after a failed call gives nothing more."""
    mine = await rig.direct.reserve(rig.user, "a", 3, now_ms=T0 + 2 * MIN)
    credit = (("inv-1", 3),)
    rig.arm("budget_refund", fault, times)
    if times == 1:
        lowered = await rig.faulty.lower(rig.user, "a", 0, nonce=mine.nonce,
                                         now_ms=T0 + 2 * MIN, credit=credit)
        first_run_lost = fault in (Fault.DROP_COMMAND, Fault.CUT_COMMAND)
        assert lowered.returned == (credit if first_run_lost else ())
    else:
        with pytest.raises(LimiterUnavailable):
            await rig.faulty.lower(rig.user, "a", 0, nonce=mine.nonce, now_ms=T0 + 2 * MIN,
                                   credit=credit)
        assert await rig.credit() == (10 if RUNS[fault] else 7)
        retried = await rig.direct.lower(rig.user, "a", 0, nonce=mine.nonce,
                                         now_ms=T0 + 2 * MIN, credit=credit)
        assert retried.returned == (() if RUNS[fault] else credit)
    assert await rig.credit() == 10
    assert await rig.used() == [0, 20]


@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
async def test_an_uncrossing_refund_restores_the_levels_once(rig: Rig, fault: Fault,
                                                             times: int) -> None:
    """A refund that undoes a charge's unreported crossings restores the levels once
    through a fault: the next charge that crosses 80% reports it, and the tokens are back
    once."""
    user = uuid.uuid4().hex
    assert await rig.direct.load_entitlements(user, epoch=1, plan=None,
                                              suspended_until_ms=None, grants=())
    undone = await rig.direct.reserve(user, "undone", 8, now_ms=T0)  # 8 of 10: crosses 80
    assert [c.threshold for c in undone.crossings] == [80]
    rig.arm("budget_refund", fault, times)
    if times == 1:
        await rig.faulty.lower(user, "undone", 0, nonce=undone.nonce, now_ms=T0,
                               uncross=undone.crossings)
    else:
        with pytest.raises(LimiterUnavailable):
            await rig.faulty.lower(user, "undone", 0, nonce=undone.nonce, now_ms=T0,
                                   uncross=undone.crossings)
        await rig.direct.lower(user, "undone", 0, nonce=undone.nonce, now_ms=T0,
                               uncross=undone.crossings)  # the kept refund, later
    assert (await rig.direct.usage(user, now_ms=T0, events=0)).windows[0].used == 0
    again = await rig.direct.reserve(user, "next", 8, now_ms=T0)
    assert [c.threshold for c in again.crossings] == [80]


# --------------------------------------------------------------- errors raised mid-script


def _client(port: int) -> aioredis.Redis:
    return aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=2.0, retry=None)


async def _script_calls(budget: TokenBudget, user: str, nonce: str) -> dict[str, object]:
    """Run the newer scripts that write (and the read of a charge) once against
    ``budget``; what each raised (or returned)."""
    from tests.breakable import outcomes

    calls = {"rebase": lambda: budget.rebase_draw(user, "a", nonce=nonce, now_ms=T0 + 2 * MIN),
             "mark": lambda: budget.mark_entitlements(uuid.uuid4().hex),
             "charge": lambda: budget.charge(user, "a")}
    return await outcomes(calls)


@pytest.fixture
async def reloaded(breakable_server: RedisServer) -> AsyncIterator[tuple[TokenBudget, str, str]]:
    """The test's own server: a charge that drew 3 at epoch 1, then a load at epoch 2."""
    client = _client(breakable_server.port)
    budget = TokenBudget(client, PLAN, entitlements=True)
    user = uuid.uuid4().hex
    assert await budget.load_entitlements(user, epoch=1, plan=None, suspended_until_ms=None,
                                          grants=GRANT)
    for i in range(2):
        assert (await budget.reserve(user, f"fill{i}", 10, now_ms=T0 + i * MIN)).allowed
    d = await budget.reserve(user, "a", 3, now_ms=T0 + 2 * MIN)
    assert await budget.load_entitlements(user, epoch=2, plan=None, suspended_until_ms=None,
                                          grants=GRANT)
    try:
        yield budget, user, d.nonce
    finally:
        await client.aclose()


async def _unmoved(budget: TokenBudget, user: str) -> tuple[int, list[int]]:
    usage = await budget.usage(user, now_ms=T0 + 2 * MIN, events=0)
    return sum(g.remaining for g in usage.grants), [w.used for w in usage.windows]


async def test_out_of_memory_mid_script_moves_nothing(
        reloaded: tuple[TokenBudget, str, str]) -> None:
    """Under maxmemory with noeviction the writing scripts raise LimiterUnavailable (OOM)
    and move nothing; the read of a charge still answers."""
    budget, user, nonce = reloaded
    before = await _unmoved(budget, user)
    await budget.redis.config_set("maxmemory-policy", "noeviction")
    await budget.redis.config_set("maxmemory", "1")
    try:
        out = await _script_calls(budget, user, nonce)
    finally:
        await budget.redis.config_set("maxmemory", "0")
    for name in ("rebase", "mark"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "OOM"  # type: ignore[arg-type]
    assert getattr(out["charge"], "cost", None) == 3
    assert await _unmoved(budget, user) == before == (10, [3, 20])


@pytest.mark.parametrize("uncross", [False, True])
async def test_a_refund_under_out_of_memory_moves_money_once(
        reloaded: tuple[TokenBudget, str, str], uncross: bool) -> None:
    """A refund with the record's credit (or undoing crossings) under maxmemory: Redis lets
    a script that frees memory run, so it either fails having moved nothing, or refunds the
    charge once; the copy (newer than the draw) gets no credit it never lost, and a retry
    afterwards moves nothing more."""
    budget, user, nonce = reloaded
    kwargs: dict[str, object] = {"credit": (("inv-1", 3),)}
    if uncross:
        kwargs = {"credit": (), "uncross": ()}
    await budget.redis.config_set("maxmemory-policy", "noeviction")
    await budget.redis.config_set("maxmemory", "1")
    try:
        first: object = await budget.lower(user, "a", 0, nonce=nonce, now_ms=T0 + 2 * MIN,
                                           **kwargs)  # type: ignore[arg-type]
    except LimiterUnavailable as exc:
        first = exc
    finally:
        await budget.redis.config_set("maxmemory", "0")
    if isinstance(first, LimiterUnavailable):
        assert error_kind(first.__cause__) == "OOM"  # type: ignore[arg-type]
        assert await _unmoved(budget, user) == (10, [3, 20])
    else:
        assert first.changed and first.returned == ()  # type: ignore[attr-defined]
    again = await budget.lower(user, "a", 0, nonce=nonce, now_ms=T0 + 2 * MIN,
                               **kwargs)  # type: ignore[arg-type]
    assert again.changed is isinstance(first, LimiterUnavailable)
    assert await _unmoved(budget, user) == (10, [0, 20])


async def test_a_replica_mid_script_moves_nothing(
        breakable_server: RedisServer, reloaded: tuple[TokenBudget, str, str]) -> None:
    """On a replica the writing scripts raise LimiterUnavailable (READONLY) and the
    primary's money is unmoved; the read of a charge answers from the replica."""
    import asyncio
    import time

    from usage_limits.keys import user_keys

    budget, user, nonce = reloaded
    before = await _unmoved(budget, user)
    with RedisServer(extra=["--replicaof", "127.0.0.1", str(breakable_server.port)]) as rep:
        client = _client(rep.port)
        try:
            deadline = time.monotonic() + 10
            while await client.exists(*user_keys(user, "dr")) == 0:
                assert time.monotonic() < deadline, "the replica never synced"
                await asyncio.sleep(0.05)
            on_replica = TokenBudget(client, PLAN, entitlements=True)
            out = await _script_calls(on_replica, user, nonce)
            for name, kwargs in (("refund_credit", {"credit": (("inv-1", 3),)}),
                                 ("refund_uncross", {"credit": (), "uncross": ()})):
                try:
                    out[name] = await on_replica.lower(user, "a", 0, nonce=nonce,
                                                       now_ms=T0 + 2 * MIN,
                                                       **kwargs)  # type: ignore[arg-type]
                except LimiterUnavailable as exc:
                    out[name] = exc
        finally:
            await client.aclose()
    for name in ("rebase", "mark", "refund_credit", "refund_uncross"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "READONLY"  # type: ignore[arg-type]
    assert await _unmoved(budget, user) == before == (10, [3, 20])

