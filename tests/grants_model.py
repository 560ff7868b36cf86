"""A plain Python model of one user's ledger with credit grants (entitlements on).

It extends ``ledger_model.Model`` (which computes every window from the live events) with
grants and draws, computed the slow obvious way, following the documented rules:

- the plan's longest window is the quota; its used is the sum over the events it counts of
  cost minus what each drew; shorter windows count full costs;
- a charge that fits the shorter windows but exceeds the quota by need draws
  min(need, cost) from the live grants (now < expiry, or none), earliest expiry first (none
  last), promo before paid, older first, then by reference; short credit rejects it, and the
  quota's wait counts each event's quota part;
- a cost above a shorter window's limit is refused ("too_big", nothing changes); a cost
  above the quota's is served with credit paying at least cost - quota, refused "too_big"
  while the live credit is short of that, and otherwise, when rejected, waits until the
  quota frees need - credit tokens;
- lowering a charge by delta gives back min(delta, drawn) in reverse draw order, each part
  to its grant only when the grant is still loaded, not expired, and the draw was made
  under the current load epoch;
- a load replaces the grants and the epoch; the draws of live charges stay as recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.ledger_model import Event, Model, WindowState
from usage_limits import Window

NEVER = float("inf")


@dataclass
class Grant:
    """One loaded grant."""

    ref: str
    remaining: int
    tokens: int
    expires: int | None
    kind: str
    created: int

    def live(self, now: int) -> bool:
        return self.expires is None or now < self.expires

    def order(self) -> tuple[float, int, int, str]:
        return (NEVER if self.expires is None else self.expires,
                0 if self.kind == "promo" else 1, self.created, self.ref)


@dataclass(frozen=True)
class GrantAnswer:
    """What ``TokenBudget.reserve`` should answer with entitlements on."""

    status: str
    retry_after_ms: int
    used: tuple[int, ...]
    draws: tuple[tuple[str, int], ...]
    credit: int | None
    epoch: int


@dataclass
class GrantModel(Model):
    """One user's ledger and grants."""

    epoch: int = 0
    grants: dict[str, Grant] = field(default_factory=dict)
    draws: dict[str, tuple[int, list[tuple[str, int]]]] = field(default_factory=dict)

    def tick(self, now_ms: int, plan: list[Window]) -> int:
        clk = super().tick(now_ms, plan)
        self.draws = {k: v for k, v in self.draws.items() if k in self.events}
        return clk

    def drawn(self, rid: str) -> int:
        return sum(n for _, n in self.draws.get(rid, (0, []))[1])

    def quota_used(self, w: Window) -> int:
        return sum(cost - self.drawn(rid) for _, rid, cost in self.inside(w))

    def used_of(self, w: Window, plan: list[Window]) -> int:
        return self.quota_used(w) if w is plan[-1] else self.used(w)

    def live(self, now: int) -> list[Grant]:
        return sorted((g for g in self.grants.values() if g.live(now)), key=Grant.order)

    def credit(self, now: int) -> int:
        return sum(g.remaining for g in self.live(now))

    def quota_wait(self, w: Window, need: int) -> int:
        freed = 0
        for at, rid, cost in self.inside(w):
            freed += cost - self.drawn(rid)
            if freed >= need:
                return at + w.ms - self.clk
        raise AssertionError("a cost within the quota always fits eventually")

    def load(self, epoch: int, grants: list[Grant]) -> None:
        """A load at a newer epoch: the grants as given."""
        self.epoch = epoch
        self.grants = {g.ref: g for g in grants}

    def reserve_entitled(self, rid: str, cost: int, route: str, nonce: str, now_ms: int,
                         plan: list[Window]) -> GrantAnswer:
        """The answer to a reservation by a loaded, not suspended user."""
        if any(cost > w.limit for w in plan[:-1]) and not (
                rid in self.events and self.events[rid].nonce == nonce):
            return GrantAnswer("too_big", 0, (), (), None, self.epoch)
        quota = plan[-1]
        if cost > quota.limit:  # refused before anything is written (the clock included)
            clk = max(self.clk, now_ms)
            cut = clk - max(self.lengths | {w.ms for w in plan})
            charged = rid in self.events and self.events[rid].at > cut
            if not charged and self.credit(clk) < cost - quota.limit:
                return GrantAnswer("too_big", 0, (), (), self.credit(clk), self.epoch)
        self.started = True
        self.tick(now_ms, plan)
        draws: list[tuple[str, int]] = []
        credit: int | None = None
        epoch = self.epoch
        if rid in self.events:
            same = self.events[rid].nonce == nonce
            status = "charged" if same else "duplicate"
            if same:  # a re-send reports its draws and the live credit
                credit = self.credit(self.clk)
                if rid in self.draws:
                    epoch, draws = self.draws[rid][0], list(self.draws[rid][1])
            return GrantAnswer(status, 0, self._used(plan), tuple(draws), credit, epoch)
        wait, short = 0, False
        for w in plan[:-1]:
            if self.used(w) + cost > w.limit:
                short = True
                wait = max(wait, self.wait_ms(w, cost))
        need = self.quota_used(quota) + cost - quota.limit
        if need > 0:
            credit = self.credit(self.clk)
            want = min(need, cost)
            if credit < want:
                short = True
                # a cost above the quota waits until the credit covers the rest
                free = need - credit if cost > quota.limit else need
                wait = max(wait, self.quota_wait(quota, free))
            elif not short:
                for g in self.live(self.clk):
                    n = min(want, g.remaining)
                    if n > 0:
                        draws.append((g.ref, n))
                        g.remaining -= n
                        want -= n
                credit -= sum(n for _, n in draws)
        if short:  # a rejection reports the live credit
            return GrantAnswer("rejected", wait, self._used(plan), (), self.credit(self.clk),
                               epoch)
        self.events[rid] = Event(self.clk, cost, route, nonce)
        if draws:
            self.draws[rid] = (self.epoch, draws)
        if credit is None:  # a charge reports the live credit after it
            credit = self.credit(self.clk)
        return GrantAnswer("charged", 0, self._used(plan), tuple(draws), credit, epoch)

    def _used(self, plan: list[Window]) -> tuple[int, ...]:
        return tuple(self.used_of(w, plan) for w in plan)

    def lower_entitled(self, rid: str, new_cost: int, nonce: str,
                       now_ms: int) -> tuple[bool, tuple[tuple[str, int], ...]]:
        """(changed, credit returned) of a settle to ``new_cost`` (0: a refund)."""
        event = self.events.get(rid)
        if event is None or event.nonce != nonce or new_cost >= event.cost:
            return False, ()
        now = max(now_ms, self.clk)
        delta = event.cost - new_cost
        returned = []
        if rid in self.draws:
            epoch, draws = self.draws[rid]
            left = delta
            for k in range(len(draws) - 1, -1, -1):
                if left == 0:
                    break
                ref, n = draws[k]
                part = min(left, n)
                left -= part
                draws[k] = (ref, n - part)
                g = self.grants.get(ref)
                if g is not None and epoch == self.epoch and g.live(now):
                    g.remaining = min(g.tokens, g.remaining + part)
                    returned.append((ref, part))
            kept = [(ref, n) for ref, n in draws if n > 0]
            if kept and new_cost > 0:
                self.draws[rid] = (epoch, kept)
            else:
                del self.draws[rid]
        self.lower(rid, new_cost, nonce)
        return True, tuple(returned)

    def usage_entitled(self, now_ms: int, plan: list[Window]) -> tuple[
            int, tuple[WindowState, ...], list[tuple[str, int, tuple[tuple[str, int], ...]]],
            list[tuple[str, int]]]:
        """(clock, windows, events (id, cost, draws) most recent first, live grants)."""
        if not self.started:
            states = tuple(WindowState(0, w.limit, None) for w in plan)
            return now_ms, states, [], [(g.ref, g.remaining) for g in self.live(now_ms)]
        self.tick(now_ms, plan)
        states = []
        for w in plan:
            used = self.used_of(w, plan)
            states.append(WindowState(used, max(0, w.limit - used), self.resets_at(w)))
        events = sorted(self.events.items(), key=lambda kv: (kv[1].at, kv[0]), reverse=True)
        return (self.clk, tuple(states),
                [(rid, e.cost, tuple(self.draws.get(rid, (0, []))[1])) for rid, e in events],
                [(g.ref, g.remaining) for g in self.live(self.clk)])
