"""Stateful property test: the ledger on a real redis-server against the pure-Python model.

Hypothesis drives random sequences of reservations (new ids, re-sent calls with the same
nonce, second reservations of an id with another nonce, costs too large for the plan),
refunds and settles (with the charge's own nonce and with a foreign one), provisional
charges (reservations with a hold) confirmed, or claimed once their hold ended and refunded
by their claimer, usage reads,
plan changes (window sets that differ), clocks that go backwards and times exactly on
window boundaries. After every step, each window's total, remaining and reset time, and
the spend events, equal the model's; every reservation's answer (retry_after_s included)
equals the model's too. Independently of the model: a confirmed charge is never claimed,
and a claimed one is never confirmed.

The ``ci`` profile (``make test``) runs a fixed few thousand steps; ``long``
(``ATTO_PROPERTY_PROFILE=long``, run by ``make fleet``) many more with random seeds.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import redis.asyncio as aioredis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from local.redis_servers import RedisServer
from tests.ledger_model import Model
from usage_limits import CostExceedsLimit, TokenBudget, Window
from usage_limits.budget import new_nonce

T0 = 1_700_000_000_000
#: Plans a user moves between: shared, new, longer and shorter windows, lowered limits.
PLANS = [
    [Window(20, 0.1), Window(45, 0.4)],
    [Window(10, 0.1)],
    [Window(30, 0.25), Window(60, 1.0)],
    [Window(45, 0.4)],
    [Window(8, 0.05), Window(20, 0.1), Window(100, 2.0)],
]
ROUTES = ["", "/v1/structured", "GET /v1/salary"]
#: Holds of provisional charges, ms (0: not provisional).
HOLDS = [0, 0, 50, 300]
#: Steps per example; the profile's max_examples sets how many examples run.
STEPS = 100

picks = st.integers(min_value=0, max_value=10**6)


class LedgerMachine(RuleBasedStateMachine):
    """One user's ledger, driven by Hypothesis and checked against ``Model``."""

    loop: asyncio.AbstractEventLoop
    client: aioredis.Redis

    def __init__(self) -> None:
        super().__init__()
        self.user = uuid.uuid4().hex
        self.budget = TokenBudget(self.client, PLANS[0])
        self.model = Model()
        self.plan = PLANS[0]
        self.now = T0
        self.ids: list[str] = []  # every id reserved so far, live or not
        self.nonces: dict[str, str] = {}  # id -> nonce of the call that charged it last
        self.last: tuple[Any, ...] | None = None  # the last reservation's arguments
        self.confirmed: set[tuple[str, str]] = set()  # (id, nonce) confirmed
        self.claimed: set[tuple[str, str]] = set()  # (id, nonce) claimed

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    # ------------------------------------------------------------------ reservations
    def _reserve(self, rid: str, cost: int, route: str, nonce: str, now: int,
                 plan: list[Window], hold_ms: int = 0) -> None:
        self.last = (rid, cost, route, nonce, now, plan, hold_ms)
        if cost > min(w.limit for w in plan):
            try:
                self.run(self.budget.reserve(self.user, rid, cost, route=route, windows=plan,
                                             now_ms=now, nonce=nonce))
            except CostExceedsLimit:
                return
            raise AssertionError("a cost above a window's limit must raise CostExceedsLimit")
        d = self.run(self.budget.reserve(self.user, rid, cost, route=route, windows=plan,
                                         now_ms=now, nonce=nonce, hold_ms=hold_ms))
        before = self.model.events.get(rid)
        want = self.model.reserve(rid, cost, route, nonce, now, plan, hold_ms)
        if self.model.events.get(rid) is not before:  # a new charge (a late copy may make
            self.confirmed.discard((rid, nonce))      # one again after a refund): a new
            self.claimed.discard((rid, nonce))        # provisional charge
        assert (d.allowed, d.duplicate, round(d.retry_after_s * 1000)) == (
            want.allowed, want.duplicate, want.retry_after_ms)
        assert (d.remaining, d.limit, d.window_s) == (want.remaining, want.limit, want.window_s)
        assert [(w.used, w.remaining, w.resets_at_ms) for w in d.windows] == [
            (w.used, w.remaining, w.resets_at_ms) for w in want.windows]
        assert d.nonce == nonce
        if rid in self.model.events:  # the caller that owns the charge knows its nonce
            self.nonces[rid] = self.model.events[rid].nonce

    def _known(self, pick: int) -> str:
        live = sorted(self.model.events)
        if live and pick % 4:
            return live[pick % len(live)]
        return self.ids[pick % len(self.ids)] if self.ids else "never"

    @rule(cost=st.integers(1, 12), route=st.sampled_from(ROUTES), hold=st.sampled_from(HOLDS))
    def reserve_new(self, cost: int, route: str, hold: int) -> None:
        """A reservation of a new id (provisional with a hold)."""
        rid = f"r{len(self.ids)}"
        self.ids.append(rid)
        self._reserve(rid, cost, route, new_nonce(), self.now, self.plan, hold)

    @precondition(lambda self: self.ids)
    @rule(pick=picks, cost=st.integers(1, 12), hold=st.sampled_from(HOLDS))
    def reserve_same_id_other_nonce(self, pick: int, cost: int, hold: int) -> None:
        """A second reservation of an id already used, by another call (another nonce): a
        client's retry of a key, after the first charge was refunded or claimed."""
        self._reserve(self._known(pick), cost, "", new_nonce(), self.now, self.plan, hold)

    # ------------------------------------------------------------------ provisional charges
    def _hold(self, rid: str, nonce: str, now: int) -> None:
        got = self.run(self.budget.hold(self.user, rid, nonce=nonce, now_ms=now, claim=100))
        want = self.model.hold(rid, nonce, now)
        if rid not in want.maybe:
            assert got.confirmed == want.confirmed, (got, want)
        self._claimed(got.claimed, want)
        if got.confirmed:
            assert (rid, nonce) not in self.claimed  # a claimed charge is never confirmed
            self.confirmed.add((rid, nonce))

    def _claimed(self, got: Any, want: Any) -> None:
        claimed = {(c.request_id, c.nonce, c.cost) for c in got}
        assert want.claimed <= claimed, (got, want)
        assert {c[0] for c in claimed - want.claimed} <= want.maybe, (got, want)
        for c in got:
            assert not c.drew
            assert (c.request_id, c.nonce) not in self.confirmed  # a success is never undone
            self.claimed.add((c.request_id, c.nonce))

    @rule(pick=picks, own=st.booleans(), lag=st.sampled_from([0, 0, 40, 400]))
    def confirm(self, pick: int, own: bool, lag: int) -> None:
        """A request confirms its charge (or another call's nonce tries), and claims what
        expired, at a clock that may lag behind."""
        rid = self._known(pick)
        self._hold(rid, self.nonces.get(rid, "none") if own else new_nonce(), self.now - lag)

    @rule(lag=st.sampled_from([0, 0, 40, 400]))
    def claim_and_refund(self, lag: int) -> None:
        """A request of the user claims the expired provisional charges and refunds them
        with their nonces, as the claimer does."""
        got = self.run(self.budget.hold(self.user, now_ms=self.now - lag, claim=100))
        self._claimed(got.claimed, self.model.hold("", "", self.now - lag))
        for c in got.claimed:
            refunded = self.run(self.budget.refund(self.user, c.request_id, nonce=c.nonce))
            assert refunded == self.model.lower(c.request_id, 0, c.nonce)

    @precondition(lambda self: self.last is not None)
    @rule()
    def resend_last_reservation(self) -> None:
        """redis-py re-sends the last reservation as it was (same nonce, same clock)."""
        assert self.last is not None
        self._reserve(*self.last)

    # ------------------------------------------------------------------ refunds and settles
    @rule(pick=picks)
    def refund_own(self, pick: int) -> None:
        """A refund by the call that made the charge (or of an id gone already)."""
        rid = self._known(pick)
        nonce = self.nonces.get(rid, "none")
        got = self.run(self.budget.refund(self.user, rid, nonce=nonce))
        assert got == self.model.lower(rid, 0, nonce)

    @rule(pick=picks)
    def refund_foreign(self, pick: int) -> None:
        """A refund by a call that did not make the charge removes nothing."""
        rid = self._known(pick)
        nonce = new_nonce()
        got = self.run(self.budget.refund(self.user, rid, nonce=nonce))
        assert got is False and self.model.lower(rid, 0, nonce) is False

    @rule(pick=picks, new_cost=st.integers(0, 12), own=st.booleans())
    def settle(self, pick: int, new_cost: int, own: bool) -> None:
        """A settle to a lower (or not lower) cost, by the charge's caller or another."""
        rid = self._known(pick)
        nonce = self.nonces.get(rid, "none") if own else new_nonce()
        got = self.run(self.budget.settle(self.user, rid, new_cost, nonce=nonce))
        assert got == self.model.lower(rid, new_cost, nonce)

    # ------------------------------------------------------------------ reads and plans
    @rule(lag=st.sampled_from([0, 0, 1, 50, 700]))
    def usage(self, lag: int) -> None:
        """A usage read with the current plan, sometimes from a clock that lags behind."""
        self._check_usage(self.now - lag, self.plan)

    @rule(plan=st.sampled_from(PLANS))
    def change_plan(self, plan: list[Window]) -> None:
        """The user's plan changes (an operator override, an upgrade)."""
        self.plan = plan

    # ------------------------------------------------------------------ clocks
    @rule(ms=st.sampled_from([0, 1, 7, 30, 99, 100, 101, 250, 399, 400, 401, 1500, 2500]))
    def advance(self, ms: int) -> None:
        """Time moves on, by a little or past every window."""
        self.now += ms

    @rule(ms=st.integers(1, 600))
    def clock_goes_back(self, ms: int) -> None:
        """The next caller's clock is behind the ledger's (another host's clock)."""
        self.now -= ms

    @precondition(lambda self: self.model.events)
    @rule(pick=picks, offset=st.sampled_from([-1, 0, 1]))
    def to_a_window_boundary(self, pick: int, offset: int) -> None:
        """The clock lands exactly on (or 1 ms around) the moment an event leaves a window."""
        events = sorted(self.model.events.values(), key=lambda e: e.at)
        event = events[pick % len(events)]
        window = self.plan[pick % len(self.plan)]
        self.now = event.at + window.ms + offset

    # ------------------------------------------------------------------ after every step
    def _check_usage(self, now: int, plan: list[Window]) -> None:
        usage = self.run(self.budget.usage(self.user, windows=plan, now_ms=now, events=1000))
        clock, windows, events = self.model.usage(now, plan)
        assert usage.now_ms == clock
        assert [(w.used, w.remaining, w.resets_at_ms) for w in usage.windows] == [
            (w.used, w.remaining, w.resets_at_ms) for w in windows]
        assert [(e.request_id, e.at_ms, e.cost, e.route) for e in usage.events] == events

    @invariant()
    def ledger_equals_model(self) -> None:
        """Every window the ledger keeps, read at its own clock (so nothing moves), and
        every event equal the model's."""
        if not self.model.started:
            self._check_usage(self.now, self.plan)
            return
        kept = {w.ms: w for plan in PLANS for w in plan if w.ms in self.model.lengths}
        self._check_usage(self.model.clk, sorted(kept.values(), key=lambda w: w.ms))


def test_ledger_matches_the_model(redis_server: RedisServer) -> None:
    """Any sequence of ledger calls leaves totals, remaining, resets, Retry-After and the
    spend events exactly as the pure-Python model computes them."""
    loop = asyncio.new_event_loop()
    client = aioredis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=5.0)
    LedgerMachine.loop, LedgerMachine.client = loop, client
    try:
        run_state_machine_as_test(LedgerMachine,
                                  settings=settings(settings(), stateful_step_count=STEPS))
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
