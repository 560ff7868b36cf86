"""Stateful property test of paid credit across both stores: real Redis, moto DynamoDB.

Hypothesis drives one user through requests (reserve and draw, fail, settle), operator
changes (grant, void, plan change, suspend and lift, support refund), reloads and FLUSHALL,
with faults injected in both stores: DynamoDB unavailable, refusing a transaction for a
conflict, or applying a write and losing its answer; Redis losing a lowering's reply, or
re-sending it. What the request path keeps for later (a lowering whose store did not
answer) is retried before the next step, as an environment does before its next request.

The reference is small: per grant, the credit the served requests still hold (what they
drew, less what their lowerings reported given back). After every step: for every grant
0 <= consumed <= tokens and consumed = the sum of its charge records; with nothing kept,
consumed = the reference, and the credit the user's copy lets them spend = DynamoDB's;
every support refund made is audited once; a suspended user is not served.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from moto import mock_aws
from redis.asyncio.cluster import ClusterNode, RedisCluster

from tests.dynamofaults import FaultyClient
from usage_limits.budget import TokenBudget, Window, new_nonce
from usage_limits.entitlements import NotFound
from usage_limits.entitlements.cache import EntitlementCache
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.operator import Operator
from usage_limits.entitlements.plans import Plans
from usage_limits.entitlements.store import EntitlementStore
from usage_limits.exceptions import LimiterUnavailable
from usage_limits.web.charge import CreditPending

PLAN = [Window(1000, 3600), Window(4, 30 * 86400)]
PLANS = "free=1000/1h,4/30d;other=1000/1h,4/30d"
STEPS = 30
DYNAMO_FAULTS = ("down", "conflict", "lost")
REDIS_FAULTS = ("lost", "resend")


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
        self.served: dict[str, dict[str, Any]] = {}  # rid -> nonce, standing, cost
        self.kept: list[tuple[str, str, int, str, bool]] = []  # rid, nonce, target, state, served
        self.grants: list[str] = []
        self.refunds_made = 0
        self.suspended = False
        self.n = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    # ------------------------------------------------------------------ plumbing
    async def _lower(self, rid: str, nonce: str, target: int, state: str) -> Any:
        """The request path's lowering, with the Redis fault of this step if any."""
        fault, self.redis_fault = self.redis_fault, None
        real = self.budget.lower
        if fault is not None:
            async def faulty(*args: Any, **kwargs: Any) -> Any:
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
            assert standing[reference] >= 0, (rid, standing)

    def _retry_kept(self) -> None:
        kept, self.kept = self.kept, []
        for rid, nonce, target, state, served in kept:
            done = self.run(self.cache.lower(self.budget, self.user, rid, nonce, target,
                                             state=state))  # type: ignore[arg-type]
            assert done.settled
            if served and not done.returned and not done.lowered.changed:
                # the first try landed and only its answer was lost: what it gave back is
                # known from the record alone
                record = self.store.charge_record(self.user, rid, nonce)
                if record is not None:
                    self.served[rid]["standing"] = dict(record.consumed)
                    continue
            self._returned(rid, done.returned, served)

    # ------------------------------------------------------------------ rules
    @rule(tokens=st.integers(1, 8))
    def add_grant(self, tokens: int) -> None:
        reference = f"g{len(self.grants)}"
        self.run(self.operator.create_grant(self.user, tokens=tokens, kind="paid",
                                            reference=reference, expires_at_ms=None,
                                            actor="op", reason="test"))
        self.grants.append(reference)

    @rule(cost=st.integers(1, 3), fault=st.none() | st.sampled_from(DYNAMO_FAULTS))
    def request(self, cost: int, fault: str | None) -> None:
        self._retry_kept()
        self.n += 1
        rid, nonce = f"r{self.n}", new_nonce()
        r = self.run(self.cache.reserve(self.budget, self.user, rid, cost, nonce=nonce,
                                        plan_name="free"))
        if self.suspended:
            assert r.status == "suspended"
            return
        if r.status != "charged":
            return
        state = "none"
        if r.drawn:
            self.faulty.fault = fault
            state = self.run(self.cache.commit_draw(self.budget, self.user, rid, nonce, r))
            self.faulty.fault = None
        if state in ("none", "recorded"):
            standing: dict[str, int] = {}
            for reference, tokens in (r.draws if state == "recorded" else ()):
                standing[reference] = standing.get(reference, 0) + tokens
            self.served[rid] = {"nonce": nonce, "standing": standing, "cost": cost,
                                "state": state}
            return
        self._lower_or_keep(rid, nonce, 0, state, served=False)  # the 503 path: refunded

    @rule(data=st.data(), fault=st.none() | st.sampled_from(DYNAMO_FAULTS),
          redis_fault=st.none() | st.sampled_from(REDIS_FAULTS), refund=st.booleans())
    def fail_or_settle(self, data: st.DataObject, fault: str | None, redis_fault: str | None,
                       refund: bool) -> None:
        if not self.served:
            return
        self._retry_kept()
        rid = data.draw(st.sampled_from(sorted(self.served)))
        charge = self.served[rid]
        target = 0 if refund else max(0, charge["cost"] - 1)
        if target >= charge["cost"]:
            return
        charge["cost"] = target
        self.faulty.fault, self.redis_fault = fault, redis_fault
        self._lower_or_keep(rid, charge["nonce"], target, charge["state"], served=True)
        self.faulty.fault = self.redis_fault = None

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

    @rule()
    def flushall(self) -> None:
        self.run(self.client.flushall())

    @rule()
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
        if self.kept:
            return
        expected: dict[str, int] = {}
        for charge in self.served.values():
            for reference, tokens in charge["standing"].items():
                expected[reference] = expected.get(reference, 0) + tokens
        assert {r: g.consumed for r, g in truth.items()} == {
            r: expected.get(r, 0) for r in truth}
        if self.suspended:
            return
        report = self.run(self.cache.usage(self.budget, self.user, plan_name="free"))
        spendable = sum(g.tokens - g.consumed for g in truth.values() if g.voided is None)
        assert sum(g.remaining for g in report.grants) == spendable


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
                base, max_examples=max(8, base.max_examples // 5),
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
        assert machine.served[last]["standing"] == {"g0": 2}

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
        assert not created and done.credit == (("g0", 2),)
        machine.refunds_made += 1
        machine._returned(rid, done.credit, True)
        machine.books_balance()
