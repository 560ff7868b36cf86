"""Stateful property test of paid credit across both stores: real Redis, moto DynamoDB.

Hypothesis drives one user through requests (reserve and draw, confirm, fail, settle),
operator changes (grant, void, plan change, suspend and lift, support refund), reloads and
FLUSHALL, with faults injected in both stores: DynamoDB unavailable, refusing a transaction
for a conflict, or applying a write and losing its answer; Redis losing a lowering's reply,
re-sending it, or never getting it. What the request path keeps for later (a lowering whose
store did not answer) is retried before the next request, as an environment does.

Every charge is provisional for its hold (``web.holds``): a request is confirmed when it
answers, left running (its confirm comes later, racing the claims), or abandoned (its
environment killed, before or after its draw's record). The ledger runs on the model's
clock, which a rule moves (onto a hold's end, one ms short of it); a claim by a later
request, a confirm's own claim, or a refused request's, takes the expired unconfirmed
charges and refunds them, DynamoDB first (the record, or a tombstone). Costs run past the
quota (4): the model predicts each reservation's split (the quota's room first, then
credit, oldest grant first) or its refusal.

The reference is small: per grant, the credit the requests still hold in DynamoDB (what
they drew, less what their lowerings and claims gave back); per charge in the ledger, its
cost, its credit part and its hold. After every step: for every grant 0 <= consumed <=
tokens and consumed = the sum of its charge records; the ledger holds exactly the model's
charges (each once) and its quota window their quota parts; the copy never lets the user
spend more than DynamoDB; with nothing kept, consumed = the reference, and with no draw
left unrecorded the copy equals DynamoDB; every support refund made is audited once; a
suspended user is not served; a confirmed charge is never claimed, a claimed one never
confirmed, and no credit comes back twice (a grant's standing never goes negative).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from moto import mock_aws
from redis.asyncio.cluster import ClusterNode, RedisCluster

from tests.dynamofaults import FaultyClient
from usage_limits.budget import HOLD_CLAIM, Claimed, TokenBudget, Window, new_nonce
from usage_limits.entitlements import NotFound
from usage_limits.entitlements.cache import EntitlementCache
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.operator import Operator
from usage_limits.entitlements.plans import Plans
from usage_limits.entitlements.store import EntitlementStore
from usage_limits.exceptions import CostExceedsLimit, LimiterUnavailable
from usage_limits.keys import user_keys
from usage_limits.web import holds, refunds
from usage_limits.web.charge import Charge, CreditPending

PLAN = [Window(1000, 3600), Window(4, 30 * 86400)]
QUOTA = 4  # the plan's longest window: credit pays only beyond it
PLANS = "free=1000/1h,4/30d;other=1000/1h,4/30d"
STEPS = 30
#: a request's hold: holds.hold_ms for an invocation with 29 s left (29 s + 5 s)
HOLD_MS = 34_000
#: how far one step moves the model's clock: within a hold, to one ms short of its end, onto it
ADVANCES_MS = (HOLD_MS, 1, 1_000, HOLD_MS - 1)
DYNAMO_FAULTS = ("down", "conflict", "lost")
#: "dropped": the lowering never reached Redis (the charge stays, provisional or confirmed)
REDIS_FAULTS = ("lost", "resend", "dropped")
#: the ledger calls that take the caller's clock: the model's clock is passed to each
CLOCKED = ("reserve", "lower", "hold", "usage", "rebase_draw")
#: what a request does once charged: answers (its success confirms the charge), is still
#: running, or dies with its environment (never confirmed, never refunded)
OUTCOMES = ("flight", "abandon", "confirm")


@dataclass
class InLedger:
    """The model of one charge the ledger holds."""

    nonce: str
    cost: int
    draws: list[list[Any]]  # [reference, tokens] still drawn, in draw order
    at_ms: int  # when it was reserved (its hold ends HOLD_MS later)
    pv: str = "held"  # held (provisional), confirmed, claimed
    unrecorded: bool = False  # drew credit DynamoDB never recorded: the copy holds less

    @property
    def drawn(self) -> int:
        return sum(n for _, n in self.draws)


class CreditMachine(RuleBasedStateMachine):
    """One user's credit in Redis and DynamoDB, driven by Hypothesis."""

    loop: asyncio.AbstractEventLoop
    client: Any
    boto: Any

    def __init__(self) -> None:
        super().__init__()
        self.user = "m-" + uuid.uuid4().hex[:10]
        self.faulty = FaultyClient(self.boto)
        self.store = EntitlementStore(StoreSettings(table="credit-model", region="us-east-1"),
                                      client=self.faulty)
        plans = Plans.parse(PLANS, default="free")
        self.budget = TokenBudget(self.client, PLAN, entitlements=True,
                                  catalog={p.name: [Window(limit, s) for limit, s in p.windows]
                                           for p in plans.by_name.values()})
        self.cache = EntitlementCache(self.store)
        self.operator = Operator(self.store, plans, self.budget, self.cache)
        self.redis_fault: str | None = None
        # rid -> nonce, standing (its credit in DynamoDB), cost, state, phase (flight,
        # confirmed, failed, abandoned, claimed)
        self.served: dict[str, dict[str, Any]] = {}
        self.kept: list[tuple[str, str, int, str, bool]] = []  # rid, nonce, target, state, served
        self.grants: list[str] = []
        self.tokens: dict[str, int] = {}
        self.voided: set[str] = set()
        self.refunds_made = 0
        self.suspended = False
        self.n = 0
        self.clock_ms = int(time.time() * 1000)
        self.ledger: dict[str, InLedger] = {}
        for name in CLOCKED:
            self._clocked(name)
        refunds.clear()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    # ------------------------------------------------------------------ plumbing
    def _clocked(self, name: str) -> None:
        """Give the ledger's call ``name`` the model's clock; a lowering that runs also
        lowers the model's charge (with the ledger's rule: the drawn part first, in reverse
        draw order)."""
        real = getattr(self.budget, name)

        async def clocked(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("now_ms") is None:
                kwargs["now_ms"] = self.clock_ms
            out = await real(*args, **kwargs)
            if name == "lower":
                self._ledger_lower(args[1], args[2], kwargs["nonce"])
            return out

        setattr(self.budget, name, clocked)

    def _ledger_lower(self, rid: str, target: int, nonce: str) -> None:
        held = self.ledger.get(rid)
        if held is None or held.nonce != nonce or held.cost <= target:
            return
        back = min(held.cost - target, held.drawn)
        for draw in reversed(held.draws):
            take = min(back, draw[1])
            draw[1] -= take
            back -= take
        held.draws = [d for d in held.draws if d[1]]
        held.cost = target
        if target == 0:
            del self.ledger[rid]

    def _quota_used(self) -> int:
        return sum(h.cost - h.drawn for h in self.ledger.values())

    def _consumed(self) -> dict[str, int]:
        expected: dict[str, int] = {}
        for charge in self.served.values():
            for reference, tokens in charge["standing"].items():
                expected[reference] = expected.get(reference, 0) + tokens
        return expected

    def _exact(self) -> bool:
        """The copy is known to hold DynamoDB's credit: nothing kept, no unrecorded draw."""
        return not self.kept and not any(h.unrecorded for h in self.ledger.values())

    def _predict(self, cost: int) -> tuple[tuple[str, int], ...] | None:
        """The draws of a charge of ``cost``: the quota pays what it has room for, credit
        the rest, oldest grant first; None when the two cannot cover it (refused)."""
        need = max(0, cost - max(0, QUOTA - self._quota_used()))
        consumed = self._consumed()
        draws = []
        for reference in self.grants:
            left = self.tokens[reference] - consumed.get(reference, 0)
            take = min(need, left) if reference not in self.voided else 0
            if take > 0:
                draws.append((reference, take))
                need -= take
        return None if need else tuple(draws)

    def _reserve(self, rid: str, nonce: str, cost: int) -> Any:
        """The guard's reservation (None: refused for a cost beyond the quota and credit)."""
        try:
            return self.run(self.cache.reserve(self.budget, self.user, rid, cost, nonce=nonce,
                                               plan_name="free", hold_ms=HOLD_MS))
        except CostExceedsLimit:
            assert cost > QUOTA
            return None

    def _due(self) -> list[str]:
        """The charges a claim now takes: claimed ones again, then expired holds."""
        order = sorted((-1 if h.pv == "claimed" else h.at_ms + HOLD_MS, rid)
                       for rid, h in self.ledger.items() if h.pv != "confirmed")
        return [rid for score, rid in order if score <= self.clock_ms][:HOLD_CLAIM]

    def _take_kept(self) -> list[str]:
        """Move what ``web.refunds`` kept into the model's kept list."""
        taken = []
        for item in list(refunds._pending):
            c = item.charge
            self.kept.append((c.request_id, c.nonce, item.target, c.credit_state(),
                              c.request_id in self.served))
            taken.append(c.request_id)
        refunds.clear()
        return taken

    def _claim(self, claimed: tuple[Claimed, ...] | None, fault: str | None = None,
               due: list[str] | None = None) -> set[str]:
        """A claim (made now when ``claimed`` is None; ``due``: what the model expected it
        to take, when the claim was made before now) and its undoing (``holds.undo``)."""
        due = self._due() if due is None else due
        if claimed is not None:
            assert [c.request_id for c in claimed] == due, (claimed, due)
            for c in claimed:
                held = self.ledger.get(c.request_id)  # gone: its own request refunded it
                assert held is None or (c.nonce, c.cost) == (held.nonce, held.cost)
        for rid in due:
            if rid in self.ledger:
                self.ledger[rid].pv = "claimed"
        self.faulty.fault = fault
        done: set[str] = self.run(holds.undo(self.budget, self.cache, self.user, claimed,
                                             within_s=60.0))
        self.faulty.fault = None
        kept = self._take_kept()
        assert done == set(due), (done, due)
        for rid in due:
            assert rid not in self.ledger  # the claimer's refund removed that very charge
            charge = self.served.get(rid)
            if charge is None:
                continue
            if charge["phase"] in ("flight", "abandoned"):
                charge["phase"] = "claimed"
            if rid not in kept:  # its credit is back in DynamoDB (a voided grant keeps it)
                charge["standing"] = {r: n for r, n in charge["standing"].items()
                                      if r in self.voided}
        return done

    def _confirm(self, rid: str) -> None:
        """A success's confirm (``holds.confirm``): it stands only when the charge is in
        the ledger and not claimed; otherwise it answers 503 and refunds. The claims made on
        the way are undone after the answer."""
        charge = self.served[rid]
        held = self.ledger.get(rid)
        expect = held is not None and held.nonce == charge["nonce"] and held.pv != "claimed"
        confirmed, claimed = self.run(holds.confirm(
            Charge(self.budget, self.user, rid, charge["cost"], charge["nonce"],
                   entitlements=self.cache), 60.0))
        assert confirmed is expect, (rid, held)
        if confirmed:
            assert held is not None
            held.pv = "confirmed"
            charge["phase"] = "confirmed"
        due = self._due()
        if not confirmed:
            charge["phase"] = "failed"
            self._lower_or_keep(rid, charge["nonce"], 0, charge["state"], served=True)
            charge["cost"] = 0
        self._claim(claimed, due=due)

    async def _lower(self, rid: str, nonce: str, target: int, state: str) -> Any:
        """The request path's lowering, with the Redis fault of this step if any."""
        fault, self.redis_fault = self.redis_fault, None
        real = self.budget.lower
        if fault is not None:
            async def faulty(*args: Any, **kwargs: Any) -> Any:
                if fault == "dropped":
                    raise LimiterUnavailable("never sent")
                await real(*args, **kwargs)
                if fault == "resend":  # redis-py re-sends after a lost reply
                    return await real(*args, **kwargs)
                raise LimiterUnavailable("reply lost")
            self.budget.lower = faulty  # type: ignore[method-assign]
        try:
            done = await self.cache.lower(self.budget, self.user, rid, nonce, target,
                                          state=state)  # type: ignore[arg-type]
        finally:
            self.budget.lower = real  # type: ignore[method-assign]
        if not done.settled:
            raise CreditPending("kept")
        return done

    def _lower_or_keep(self, rid: str, nonce: str, target: int, state: str,
                       served: bool) -> None:
        try:
            done = self.run(self._lower(rid, nonce, target, state))
        except LimiterUnavailable:  # CreditPending included: kept, as the middleware does
            self.kept.append((rid, nonce, target, state, served))
            return
        self._returned(rid, done.returned, served)

    def _returned(self, rid: str, returned: Any, served: bool) -> None:
        if not served:
            return
        standing = self.served[rid]["standing"]
        for reference, tokens in returned:
            standing[reference] -= tokens
            assert standing[reference] >= 0, (rid, standing)  # never refunded twice

    def _retry_kept(self) -> None:
        kept, self.kept = self.kept, []
        for rid, nonce, target, state, served in kept:
            done = self.run(self.cache.lower(self.budget, self.user, rid, nonce, target,
                                             state=state))  # type: ignore[arg-type]
            assert done.settled
            if served and not done.returned:
                # the first try's DynamoDB part landed and only its answer was lost (its
                # Redis part then, or now when it never reached Redis), or a claim refunded
                # the charge meanwhile: what it gave back is known from the record alone
                record = self.store.charge_record(self.user, rid, nonce)
                if record is not None:
                    self.served[rid]["standing"] = dict(record.consumed)
                    continue
            self._returned(rid, done.returned, served)

    # ------------------------------------------------------------------ rules
    @initialize(tokens=st.integers(1, 8))
    def first_grant(self, tokens: int) -> None:
        """Most runs start with credit to spend beyond the quota."""
        self.add_grant(tokens)

    @rule(tokens=st.integers(1, 8))
    def add_grant(self, tokens: int) -> None:
        reference = f"g{len(self.grants):02d}"  # draw order among equals: by reference
        self.run(self.operator.create_grant(self.user, tokens=tokens, kind="paid",
                                            reference=reference, expires_at_ms=None,
                                            actor="op", reason="test"))
        self.grants.append(reference)
        self.tokens[reference] = tokens

    @rule(cost=st.integers(1, QUOTA + 2), fault=st.none() | st.sampled_from(DYNAMO_FAULTS),
          outcome=st.sampled_from(OUTCOMES), recorded=st.booleans())
    def request(self, cost: int, fault: str | None, outcome: str = "confirm",
                recorded: bool = True) -> None:
        """A request: reserved (a refused one claims first, then tries once more, as the
        guard does), its draw recorded, then confirmed, left running, or abandoned (its
        environment killed, before its draw's record when not ``recorded``)."""
        self._retry_kept()
        self.n += 1
        rid, nonce = f"r{self.n}", new_nonce()
        expected = self._predict(cost) if self._exact() else "?"
        r = self._reserve(rid, nonce, cost)
        if self.suspended:
            assert r is not None and r.status == "suspended"
            return
        if r is not None and r.status == "rejected" and self._claim(None):
            expected = self._predict(cost) if self._exact() else "?"
            nonce = new_nonce()
            r = self._reserve(rid, nonce, cost)
        charged = r is not None and r.status == "charged"
        if expected != "?":
            assert (r.draws if charged else None) == expected, (cost, r, expected)
        if not charged:  # refused: nothing written in either store
            assert r is None or r.status == "rejected", r
            assert rid not in self.run(self.client.hkeys(user_keys(self.user, "ev")[0]))
            assert self.store.charge_record(self.user, rid, nonce) is None
            return
        assert r.drawn == sum(n for _, n in r.draws) >= cost - QUOTA
        self.ledger[rid] = InLedger(nonce, cost, [list(d) for d in r.draws], self.clock_ms)
        state = "none"
        if r.drawn and outcome == "abandon" and not recorded:  # killed before the record
            self.ledger[rid].unrecorded = True
            self.served[rid] = {"nonce": nonce, "standing": {}, "cost": cost,
                                "state": "unknown", "phase": "abandoned"}
            return
        if r.drawn:
            self.faulty.fault = fault
            state = self.run(self.cache.commit_draw(self.budget, self.user, rid, nonce, r))
            self.faulty.fault = None
        if outcome == "abandon":  # killed after its record's write, whatever it answered
            record = self.store.charge_record(self.user, rid, nonce) if r.drawn else None
            kept = dict(record.consumed) if record is not None else {}
            self.ledger[rid].unrecorded = r.drawn > 0 and not any(kept.values())
            self.served[rid] = {"nonce": nonce, "standing": kept, "cost": cost,
                                "state": "unknown", "phase": "abandoned"}
            return
        if state in ("none", "recorded"):
            standing: dict[str, int] = {}
            for reference, tokens in (r.draws if state == "recorded" else ()):
                standing[reference] = standing.get(reference, 0) + tokens
            self.served[rid] = {"nonce": nonce, "standing": standing, "cost": cost,
                                "state": state, "phase": "flight"}
            if outcome == "confirm":
                self._confirm(rid)
            return
        self._lower_or_keep(rid, nonce, 0, state, served=False)  # the 503 path: refunded

    @precondition(lambda self: any(c["phase"] in ("flight", "claimed") and c["cost"] > 0
                                   for c in self.served.values()))
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        """A running request succeeds: its confirm races the claims made meanwhile."""
        flight = sorted(rid for rid, c in self.served.items() if c["phase"] in
                        ("flight", "claimed") and c["cost"] > 0)
        if flight:
            self._confirm(data.draw(st.sampled_from(flight)))

    @precondition(lambda self: any(h.pv != "confirmed" for h in self.ledger.values()))
    @rule(fault=st.none() | st.sampled_from(DYNAMO_FAULTS),
          ms=st.sampled_from((HOLD_MS, 0, HOLD_MS - 1)))
    def claim(self, fault: str | None, ms: int = 0) -> None:
        """``ms`` later, a request of the user (refused, or confirming its own charge
        elsewhere) claims the expired unconfirmed charges and refunds them, DynamoDB
        first."""
        self.clock_ms += ms
        self._claim(self.run(self.budget.hold(self.user)).claimed, fault)

    @precondition(lambda self: any(h.pv == "held" for h in self.ledger.values()))
    @rule(ms=st.sampled_from(ADVANCES_MS))
    def advance(self, ms: int) -> None:
        """Time passes (the ledger's clock is the model's)."""
        self.clock_ms += ms

    @precondition(lambda self: any(c["phase"] in ("flight", "confirmed")
                                   for c in self.served.values()))
    @rule(data=st.data(), fault=st.none() | st.sampled_from(DYNAMO_FAULTS),
          redis_fault=st.none() | st.sampled_from(REDIS_FAULTS), refund=st.booleans())
    def fail_or_settle(self, data: st.DataObject, fault: str | None, redis_fault: str | None,
                       refund: bool) -> None:
        """A running request settles or fails (a confirmed one: a late lowering)."""
        open_ = sorted(rid for rid, c in self.served.items()
                       if c["phase"] in ("flight", "confirmed"))
        if not open_:
            return
        self._retry_kept()
        rid = data.draw(st.sampled_from(open_))
        charge = self.served[rid]
        target = 0 if refund else max(0, charge["cost"] - 1)
        if target >= charge["cost"]:
            return
        charge["cost"] = target
        if target == 0 and charge["phase"] == "flight":
            charge["phase"] = "failed"  # answered an error: never confirmed
        self.faulty.fault, self.redis_fault = fault, redis_fault
        self._lower_or_keep(rid, charge["nonce"], target, charge["state"], served=True)
        self.faulty.fault = self.redis_fault = None

    @precondition(lambda self: bool(self.served))
    @rule(data=st.data())
    def support_refund(self, data: st.DataObject) -> None:
        if not self.served:
            return
        self._retry_kept()
        rid = data.draw(st.sampled_from(sorted(self.served)))
        try:
            done, created = self.run(self.operator.refund(self.user, rid, actor="op",
                                                          reason="support"))
        except NotFound:
            assert not any(self.served[rid]["standing"].values())
            return
        if created:
            self.refunds_made += 1
            self._returned(rid, done.credit, True)
            self.served[rid]["cost"] = 0

    @rule(data=st.data())
    def void(self, data: st.DataObject) -> None:
        if self.grants:
            reference = data.draw(st.sampled_from(self.grants))
            self.run(self.operator.void_grant(self.user, reference, actor="op", reason="r"))
            self.voided.add(reference)

    @rule(plan=st.sampled_from(["free", "other"]))
    def plan_change(self, plan: str) -> None:
        self.run(self.operator.set_plan(self.user, plan, actor="op", reason="r"))

    @rule(on=st.booleans())
    def suspension(self, on: bool) -> None:
        if on:
            self.run(self.operator.suspend(self.user, reason="r", until_ms=None, actor="op"))
        else:
            self.run(self.operator.lift_suspension(self.user, actor="op", reason="r"))
        self.suspended = on

    @rule(flush=st.sampled_from([False, False, True]))
    def lose_copy(self, flush: bool) -> None:
        """The copy is dropped (an operator's reload), or Redis loses everything."""
        if flush:
            self.flushall()
        else:
            self.reload()

    def flushall(self) -> None:
        self.run(self.client.flushall())
        self.ledger.clear()  # every charge with it: none is claimed or confirmed any more

    def reload(self) -> None:
        self.run(self.cache.refresh(self.budget, self.user))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def books_balance(self) -> None:
        held: dict[str, int] = {}
        for record in self.store.charge_records(self.user):
            for reference, tokens in record.consumed.items():
                held[reference] = held.get(reference, 0) + tokens
        truth = {g.reference: g for g in self.store.load(self.user).grants}
        for reference, g in truth.items():
            assert 0 <= g.consumed <= g.tokens
            assert g.consumed == held.get(reference, 0), (reference, g, held)
        audited = [e for e in self.store.audit(self.user, limit=500) if e.action == "refund"]
        assert len(audited) == self.refunds_made
        # the ledger holds the model's charges, each once, and counts their quota parts
        ev = self.run(self.client.hkeys(user_keys(self.user, "ev")[0]))
        assert sorted(k.decode() for k in ev) == sorted(self.ledger)
        if self.suspended:
            return
        report = self.run(self.cache.usage(self.budget, self.user, plan_name="free"))
        assert report.windows[-1].used == self._quota_used(), (report.windows, self.ledger)
        spendable = sum(g.tokens - g.consumed for g in truth.values() if g.voided is None)
        copy = sum(g.remaining for g in report.grants)
        assert copy <= spendable  # the copy never lets the user spend more than DynamoDB
        if self.kept:
            return
        expected = self._consumed()
        assert {r: g.consumed for r, g in truth.items()} == {
            r: expected.get(r, 0) for r in truth}
        if self._exact():
            assert copy == spendable


def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)


def _table() -> Any:
    """A moto DynamoDB client with the model's table (inside ``mock_aws``)."""
    import boto3

    boto = boto3.client("dynamodb", region_name="us-east-1")
    EntitlementStore(StoreSettings(table="credit-model", region="us-east-1"),
                     client=boto).create_table()
    return boto


@pytest.mark.parametrize("topology", ["standalone", pytest.param("cluster",
                                                                 marks=pytest.mark.cluster)])
def test_credit_in_both_stores_matches_the_model(topology: str, request: pytest.FixtureRequest,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Any sequence of requests, operator changes, reloads, flushes and faults in both
    stores keeps paid credit exact: DynamoDB's books, the copy and the reference agree."""
    _aws_env(monkeypatch)
    loop = asyncio.new_event_loop()
    if topology == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        client: Any = RedisCluster(startup_nodes=[ClusterNode(h, p)
                                                  for h, p in cluster.startup_nodes])
    else:
        server = request.getfixturevalue("redis_server")
        client = aioredis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5.0)
    base = settings()
    with mock_aws():

        boto = _table()
        CreditMachine.loop, CreditMachine.client, CreditMachine.boto = loop, client, boto
        try:
            run_state_machine_as_test(CreditMachine, settings=settings(
                base, max_examples=max(8, base.max_examples // 8),
                stateful_step_count=STEPS, deadline=None))
        finally:
            loop.run_until_complete(client.aclose())
            loop.close()



@contextlib.contextmanager
def _machine(redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[CreditMachine]:
    """One CreditMachine on the session's standalone server and a moto table, for the
    explicit cases of the model."""
    _aws_env(monkeypatch)
    loop = asyncio.new_event_loop()
    client = aioredis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=5.0)
    with mock_aws():
        CreditMachine.loop, CreditMachine.client, CreditMachine.boto = loop, client, _table()
        try:
            yield CreditMachine()
        finally:
            loop.run_until_complete(client.aclose())
            loop.close()


def test_a_refund_after_a_reload_leaves_the_copy_equal_to_dynamodb(
        redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit case of the model: a charge drawn, the copy reloaded, the request fails:
    DynamoDB gets the credit back and so does what the user can spend (the copy, not the
    one the charge drew from, is dropped and reloads)."""

    with _machine(redis_server, monkeypatch) as machine:
        machine.add_grant(8)
        for _ in range(3):
            machine.request(2, None)
        machine.reload()
        machine.books_balance()

        class Last:
            def draw(self, strategy: Any) -> str:
                return sorted(machine.served)[-1]

        machine.fail_or_settle(Last(), None, None, True)  # type: ignore[arg-type]
        machine.books_balance()


def test_a_refund_whose_answer_was_lost_gives_the_copy_its_credit_back(
        redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed request's refund lands in DynamoDB but its answer is lost, so the refund is
    kept; when it is retried (finding the return already made) the copy lets the user
    spend exactly what DynamoDB holds, not 2 tokens less."""
    with _machine(redis_server, monkeypatch) as machine:
        machine.add_grant(8)
        for _ in range(3):  # the quota is 4: the third request draws its 2 from credit
            machine.request(2, None)
        last = sorted(machine.served)[-1]
        assert machine.served[last]["standing"] == {"g00": 2}

        class Last:
            def draw(self, strategy: Any) -> str:
                return last

        machine.fail_or_settle(Last(), "lost", None, True)  # type: ignore[arg-type]
        assert machine.kept  # the return's answer was lost: kept, as the middleware does
        machine._retry_kept()
        machine.books_balance()


def test_a_support_refund_whose_answer_was_lost_gives_the_copy_its_credit_when_repeated(
        redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A support refund lands in DynamoDB and its answer is lost before the ledger's part;
    the operator repeats it: the repeat answers the first refund and the copy lets the user
    spend exactly what DynamoDB holds, the refunded credit included."""
    from usage_limits.entitlements import StoreUnavailable

    with _machine(redis_server, monkeypatch) as machine:
        machine.add_grant(8)
        for _ in range(3):  # the third request draws its 2 from credit
            machine.request(2, None)
        rid = sorted(machine.served)[-1]
        real = machine.store.refund_charge

        def applied_then_lost(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)
            raise StoreUnavailable("read timeout")

        machine.store.refund_charge = applied_then_lost  # type: ignore[method-assign]
        with pytest.raises(StoreUnavailable):
            machine.run(machine.operator.refund(machine.user, rid, actor="op",
                                                reason="support"))
        machine.store.refund_charge = real  # type: ignore[method-assign]
        done, created = machine.run(machine.operator.refund(machine.user, rid,
                                                            actor="op", reason="again"))
        assert not created and done.credit == (("g00", 2),)
        machine.refunds_made += 1
        machine._returned(rid, done.credit, True)
        machine.books_balance()


class Pick:
    """A ``data`` stand-in for the explicit cases: draws the request id it names."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def draw(self, strategy: Any) -> str:
        return self.rid


def test_abandoned_charges_that_drew_credit_are_refunded_once_by_a_later_claim(
        redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two charges beyond the quota are abandoned (one killed before its draw's record, one
    after): not claimable before their hold ends, then claimed by a later request and
    refunded through DynamoDB (a tombstone, the record), so both stores get the credit back
    once; a second claim finds nothing."""
    with _machine(redis_server, monkeypatch) as machine:
        machine.first_grant(8)
        machine.request(4, None)  # the quota
        machine.request(2, None, "abandon", False)
        machine.request(3, None, "abandon", True)
        r2, r3 = "r2", "r3"
        assert machine.ledger[r2].unrecorded and machine.served[r3]["standing"] == {"g00": 3}
        machine.books_balance()
        machine.advance(HOLD_MS - 1)
        machine.claim(None)
        assert {r2, r3} <= set(machine.ledger)  # not before the hold ends
        machine.advance(1)
        machine.claim(None)
        assert not {r2, r3} & set(machine.ledger)
        assert machine.store.charge_record(machine.user, r2, machine.served[r2]["nonce"])
        machine.books_balance()
        machine.claim(None)
        machine.books_balance()


@pytest.mark.parametrize("confirm_first", [True, False])
def test_a_confirm_racing_a_claim_either_wins_and_the_loser_changes_nothing(
        redis_server: Any, monkeypatch: pytest.MonkeyPatch, confirm_first: bool) -> None:
    """A running request's charge past its hold: confirmed first, no claim undoes it; claimed
    first, its confirm fails and its own refund finds the charge gone: credit back once."""
    with _machine(redis_server, monkeypatch) as machine:
        machine.first_grant(8)
        machine.request(4, None)
        machine.request(3, None, "flight")
        machine.advance(HOLD_MS)
        if confirm_first:
            machine.confirm(Pick("r2"))
            machine.claim(None)
            assert machine.served["r2"]["standing"] == {"g00": 3}
        else:
            machine.claim(None)
            machine.confirm(Pick("r2"))
            assert machine.served["r2"]["phase"] == "failed"
            assert not any(machine.served["r2"]["standing"].values())
        machine.books_balance()


def test_a_dropped_refund_claimed_then_retried_is_refunded_once(
        redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed request's refund never reaches Redis and is kept; after its hold a later
    request claims and refunds the charge; the kept refund then lands on nothing."""
    with _machine(redis_server, monkeypatch) as machine:
        machine.first_grant(8)
        machine.request(4, None)
        machine.request(2, None, "flight")
        machine.fail_or_settle(Pick("r2"), None, "dropped", True)
        assert machine.kept and "r2" in machine.ledger
        machine.advance(HOLD_MS)
        machine.claim(None)
        assert "r2" not in machine.ledger
        machine._retry_kept()
        assert not any(machine.served["r2"]["standing"].values())
        machine.books_balance()


def test_a_split_charge_settles_credit_first_and_an_uncoverable_cost_is_refused(
        redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With 1 token of quota left a cost of 3 draws 2 from credit; settled to 1 it gives back
    the 2 of credit, not quota; a cost neither can cover is refused with nothing written."""
    with _machine(redis_server, monkeypatch) as machine:
        machine.first_grant(3)
        machine.request(3, None)
        machine.request(3, None, "flight")
        assert machine.served["r2"]["standing"] == {"g00": 2}
        machine.fail_or_settle(Pick("r2"), None, None, False)
        machine.fail_or_settle(Pick("r2"), None, None, False)
        assert not any(machine.served["r2"]["standing"].values())
        assert machine._quota_used() == 4
        machine.books_balance()
        machine.request(QUOTA + 2, None)  # needs 6 of credit: 3 are left
        assert "r3" not in machine.served
        machine.books_balance()


def test_a_support_refund_of_an_unrecorded_draw_leaves_the_copy_equal_to_dynamodb(
        redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A charge whose environment was killed between its draw and the draw's record is
    refunded by support before any claim: DynamoDB gives nothing back (it holds nothing),
    and the copy, which the ledger's removal of the draw does not refill, is dropped and
    reloads exact rather than staying short of that credit."""
    with _machine(redis_server, monkeypatch) as machine:
        machine.first_grant(2)
        machine.request(4, None)
        machine.request(1, None, "abandon", False)
        assert machine.ledger["r2"].unrecorded
        machine.support_refund(Pick("r2"))
        assert "r2" not in machine.ledger and machine._exact()
        machine.books_balance()
