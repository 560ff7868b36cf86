"""Stateful property test: grants on a real redis-server against the pure-Python model.

Hypothesis drives random sequences of grant loads (new grants of either kind, with and
without expiry, voids), reservations that draw or not (and re-sends of the last one),
refunds and settles (which give credit back or not), costs above the quota (credit pays
beyond it) and above a shorter window (refused), plan changes (so the quota window
moves) and clock moves past grant expiries and window boundaries. After every step the
windows (the quota counting t - d), the spend events with their draws, and the live grants
equal ``GrantModel``'s; every reservation's status, draws, credit, epoch and Retry-After do
too. The ``ci`` profile keeps it to a few hundred steps (a few seconds).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
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
from tests.grants_model import Grant, GrantModel
from usage_limits import CostExceedsLimit, TokenBudget, Window
from usage_limits.budget import LiveGrant, new_nonce

T0 = 1_700_000_000_000
#: Plans with different quotas (their longest windows), sharing some window lengths.
PLANS = [
    [Window(30, 0.1), Window(15, 0.4)],
    [Window(20, 0.4)],
    [Window(12, 0.1), Window(12, 1.0)],
]
STEPS = 50
picks = st.integers(min_value=0, max_value=10**6)


class GrantsMachine(RuleBasedStateMachine):
    """One user's ledger with grants, driven by Hypothesis and checked against GrantModel."""

    loop: asyncio.AbstractEventLoop
    client: aioredis.Redis

    def __init__(self) -> None:
        super().__init__()
        self.user = uuid.uuid4().hex
        self.budget = TokenBudget(self.client, PLANS[0], entitlements=True)
        self.model = GrantModel()
        self.plan = PLANS[0]
        self.now = T0
        self.ids: list[str] = []
        self.nonces: dict[str, str] = {}
        self.last: tuple[Any, ...] | None = None
        self.created = 2
        # every example starts with a promo grant that expires and a paid one that does not
        self._load([Grant("g1", 20, 20, T0 + 300, "promo", 1),
                    Grant("g2", 40, 40, None, "paid", 2)])

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    # ------------------------------------------------------------------ grants
    def _load(self, grants: list[Grant]) -> None:
        epoch = self.model.epoch + 1
        live = [LiveGrant(g.ref, g.remaining, g.tokens, g.expires, g.kind,  # type: ignore[arg-type]
                          g.created) for g in grants]
        assert self.run(self.budget.load_entitlements(
            self.user, epoch=epoch, plan=None, suspended_until_ms=None, grants=live))
        self.model.load(epoch, grants)

    @rule(tokens=st.integers(1, 30), expires_in=st.sampled_from([None, 50, 150, 600]),
          kind=st.sampled_from(["paid", "promo"]))
    def create_grant(self, tokens: int, expires_in: int | None, kind: str) -> None:
        """An operator creates a grant: a new load holds it beside the others."""
        self.created += 1
        expires = None if expires_in is None else self.now + expires_in
        new = Grant(f"g{self.created}", tokens, tokens, expires, kind, self.created)
        self._load([*self.model.grants.values(), new])

    @precondition(lambda self: self.model.grants)
    @rule(pick=picks)
    def void_grant(self, pick: int) -> None:
        """An operator voids a grant: the next load leaves it out."""
        refs = sorted(self.model.grants)
        gone = refs[pick % len(refs)]
        self._load([g for ref, g in sorted(self.model.grants.items()) if ref != gone])

    # ------------------------------------------------------------------ reservations
    def _reserve(self, rid: str, cost: int, nonce: str, now: int, plan: list[Window]) -> None:
        self.last = (rid, cost, nonce, now, plan)
        want = self.model.reserve_entitled(rid, cost, "", nonce, now, plan)
        if want.status == "too_big":  # a shorter window's limit, or short credit
            with pytest.raises(CostExceedsLimit) as refused:
                self.run(self.budget.reserve(self.user, rid, cost, windows=plan, now_ms=now,
                                             nonce=nonce))
            assert refused.value.credit == want.credit
            return
        d = self.run(self.budget.reserve(self.user, rid, cost, windows=plan, now_ms=now,
                                         nonce=nonce))
        assert (d.status, round(d.retry_after_s * 1000)) == (want.status, want.retry_after_ms)
        assert tuple(w.used for w in d.windows) == want.used
        assert (d.draws, d.drawn, d.credit, d.epoch) == (
            want.draws, sum(n for _, n in want.draws), want.credit, want.epoch)
        if rid in self.model.events:
            self.nonces[rid] = self.model.events[rid].nonce

    @rule(cost=st.integers(1, 12) | st.integers(13, 40))
    def reserve_new(self, cost: int) -> None:
        """A reservation of a new id (draws when it exceeds the quota; a cost above the
        quota itself is paid by credit beyond it, above a shorter window is refused)."""
        rid = f"r{len(self.ids)}"
        self.ids.append(rid)
        self._reserve(rid, cost, new_nonce(), self.now, self.plan)

    @rule(costs=st.lists(st.integers(1, 10), min_size=2, max_size=3))
    def reserve_burst(self, costs: list[int]) -> None:
        """Several reservations at once: the quota fills and the grants start to pay."""
        for cost in costs:
            self.reserve_new(cost)

    @precondition(lambda self: self.last is not None)
    @rule()
    def resend_last_reservation(self) -> None:
        """redis-py re-sends the last reservation: same draws reported, nothing drawn twice."""
        assert self.last is not None
        self._reserve(*self.last)

    def _known(self, pick: int) -> str:
        live = sorted(self.model.events)
        if live and pick % 4:
            return live[pick % len(live)]
        return self.ids[pick % len(self.ids)] if self.ids else "never"

    @precondition(lambda self: self.model.draws)
    @rule(pick=picks, new_cost=st.sampled_from([0, 0, 1, 3, 6]))
    def lower_drawn(self, pick: int, new_cost: int) -> None:
        """A refund (0) or settle of a charge that drew: credit goes back, or is gone."""
        drew = sorted(self.model.draws)
        self.lower(drew[pick % len(drew)], new_cost)

    @precondition(lambda self: self.model.events)
    @rule(pick=picks, new_cost=st.sampled_from([0, 0, 1, 3, 6]))
    def lower_any(self, pick: int, new_cost: int) -> None:
        """A refund (0) or settle of any charge (or of one gone already)."""
        self.lower(self._known(pick), new_cost)

    def lower(self, rid: str, new_cost: int) -> None:
        """A refund or settle by the charge's own caller, checked against the model."""
        nonce = self.nonces.get(rid, "none")
        got = self.run(self.budget.lower(self.user, rid, new_cost, nonce=nonce,
                                         now_ms=self.now))
        changed, returned = self.model.lower_entitled(rid, new_cost, nonce, self.now)
        assert (got.changed, got.returned) == (changed, returned)
        assert got.epoch == (self.model.epoch if returned else 0)

    @rule(plan=st.sampled_from(PLANS))
    def change_plan(self, plan: list[Window]) -> None:
        """The user's plan changes, and with it the quota window."""
        self.plan = plan

    @rule(ms=st.sampled_from([0, 1, 49, 50, 99, 100, 151, 400, 401, 1000, 1001, 2500]))
    def advance(self, ms: int) -> None:
        """Time moves on: past grant expiries, window boundaries, or everything."""
        self.now += ms

    # ------------------------------------------------------------------ after every step
    @invariant()
    def ledger_equals_model(self) -> None:
        """Windows, events with their draws, and live grants equal the model's."""
        usage = self.run(self.budget.usage(self.user, windows=self.plan, now_ms=self.now,
                                           events=1000))
        clock, windows, events, grants = self.model.usage_entitled(self.now, self.plan)
        assert usage.now_ms == clock
        assert [(w.used, w.remaining, w.resets_at_ms) for w in usage.windows] == [
            (w.used, w.remaining, w.resets_at_ms) for w in windows]
        assert [(e.request_id, e.cost, e.draws) for e in usage.events] == events
        assert [(g.reference, g.remaining) for g in usage.grants] == grants
        assert usage.loaded and usage.epoch == self.model.epoch


def test_grants_match_the_model(redis_server: RedisServer) -> None:
    """Any sequence of grant calls leaves ledger, draws and grants as the model computes."""
    loop = asyncio.new_event_loop()
    client = aioredis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=5.0)
    GrantsMachine.loop, GrantsMachine.client = loop, client
    base = settings()
    try:
        run_state_machine_as_test(GrantsMachine, settings=settings(
            base, max_examples=max(10, base.max_examples // 4), stateful_step_count=STEPS))
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
