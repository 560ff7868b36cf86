"""A plain Python model of one user's ledger: what every budget call should answer.

It keeps every live charge and computes each answer the slow obvious way (sums over the
events, a walk over the oldest ones), so it can be compared with the Lua scripts' running
totals after any sequence of calls. It follows the ledger's documented rules:

- the clock is clamped: a call's time is max(its now_ms, the latest time seen);
- a reservation of an id already charged charges nothing; it reports success when the
  nonce is the charge's own (a re-send of the same call), ``duplicate`` otherwise;
- a refund or settle lowers a charge only when its nonce is the charge's;
- every window length the user has had is kept up to date, and events older than the
  longest of them are forgotten (a window seen for the first time counts what is left);
- ``usage`` of a user who never reserved answers zeros and changes nothing;
- a reservation with a hold is provisional until confirmed; from its hold's end on, a
  ``hold`` call claims it (its own request can no longer confirm it) until it is refunded.
  An event that left every window may still be stored (deleted in batches): what ``hold``
  answers about it is not decided here (``Held.maybe``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from usage_limits import Window


@dataclass(frozen=True)
class Event:
    """One live charge."""

    at: int
    cost: int
    route: str
    nonce: str


@dataclass(frozen=True)
class WindowState:
    """What the ledger should report of one window."""

    used: int
    remaining: int
    resets_at_ms: int | None


@dataclass(frozen=True)
class Answer:
    """What ``TokenBudget.reserve`` should answer."""

    allowed: bool
    duplicate: bool
    retry_after_ms: int
    remaining: int
    limit: int
    window_s: float
    windows: tuple[WindowState, ...]


@dataclass(frozen=True)
class Held:
    """What ``TokenBudget.hold`` should answer.

    Attributes:
        confirmed: as ``Held.confirmed`` (unless the id is in ``maybe``).
        claimed: (id, nonce, cost) of each charge claimed.
        maybe: ids of charges that left every window: the ledger may answer either way.
    """

    confirmed: bool | None
    claimed: set[tuple[str, str, int]]
    maybe: set[str]


@dataclass
class Model:
    """One user's ledger, computed from every live event."""

    clk: int = 0
    started: bool = False  # the user has keys: some reservation reached the ledger
    lengths: set[int] = field(default_factory=set)  # window lengths kept up to date, ms
    events: dict[str, Event] = field(default_factory=dict)
    #: id -> when its provisional charge may be claimed, ms (-1: claimed)
    holds: dict[str, int] = field(default_factory=dict)
    #: id -> nonce of its charge that left every window (the ledger may still store it)
    dead: dict[str, str] = field(default_factory=dict)

    def tick(self, now_ms: int, plan: list[Window]) -> int:
        """Clamp the clock, take the plan's windows on, forget what left the longest."""
        self.clk = max(self.clk, now_ms)
        self.lengths |= {w.ms for w in plan}
        cut = self.clk - max(self.lengths)
        for k, e in self.events.items():
            if e.at <= cut:
                self.dead[k] = e.nonce
        self.events = {k: e for k, e in self.events.items() if e.at > cut}
        return self.clk

    def inside(self, w: Window) -> list[tuple[int, str, int]]:
        """(at, id, cost) of the events window ``w`` counts, oldest first (as the log sorts)."""
        return sorted((e.at, rid, e.cost) for rid, e in self.events.items()
                      if e.at > self.clk - w.ms)

    def used(self, w: Window) -> int:
        return sum(cost for _, _, cost in self.inside(w))

    def resets_at(self, w: Window) -> int | None:
        inside = self.inside(w)
        return inside[0][0] + w.ms if inside else None

    def state(self, w: Window) -> WindowState:
        used = self.used(w)
        return WindowState(used, max(0, w.limit - used), self.resets_at(w))

    def wait_ms(self, w: Window, cost: int) -> int:
        """When enough of the oldest events have left ``w`` for ``cost`` to fit, ms from now."""
        need, freed = self.used(w) + cost - w.limit, 0
        for at, _, c in self.inside(w):
            freed += c
            if freed >= need:
                return at + w.ms - self.clk
        raise AssertionError("a cost within the limit always fits eventually")

    def reserve(self, rid: str, cost: int, route: str, nonce: str, now_ms: int,
                plan: list[Window], hold_ms: int = 0) -> Answer:
        """The answer to a reservation (the caller checks ``cost`` against the plan first)."""
        self.started = True
        self.tick(now_ms, plan)
        allowed, duplicate, wait, binding = True, False, 0, -1
        if rid in self.events:
            duplicate = self.events[rid].nonce != nonce
        else:
            for i, w in enumerate(plan):
                if self.used(w) + cost > w.limit:
                    allowed = False
                    wait_w = self.wait_ms(w, cost)
                    if wait_w > wait:
                        wait, binding = wait_w, i
            if allowed:
                self.events[rid] = Event(self.clk, cost, route, nonce)
                self.dead.pop(rid, None)
                if hold_ms:
                    self.holds[rid] = self.clk + hold_ms
                else:  # a charge that is not provisional is never claimed
                    self.holds.pop(rid, None)
        states = tuple(self.state(w) for w in plan)
        least = min(s.remaining for s in states)
        if binding < 0:  # allowed: the window with the least room (the shortest on a tie)
            binding = next(i for i, s in enumerate(states) if s.remaining == least)
        return Answer(allowed, duplicate, wait, least, plan[binding].limit,
                      float(plan[binding].seconds), states)

    def lower(self, rid: str, new_cost: int, nonce: str) -> bool:
        """A settle to ``new_cost`` (0: a refund) by the caller holding ``nonce``."""
        event = self.events.get(rid)
        if event is None or event.nonce != nonce or new_cost >= event.cost:
            return False
        if new_cost == 0:
            del self.events[rid]
        else:
            self.events[rid] = Event(event.at, new_cost, event.route, event.nonce)
        return True

    def hold(self, rid: str, nonce: str, now_ms: int) -> Held:
        """``TokenBudget.hold``: confirm ``rid``'s charge (unless ``rid`` is ''), then
        claim every provisional charge whose hold ended by ``now_ms`` (the caller's clock)."""
        confirmed: bool | None = None
        maybe: set[str] = set()
        if rid:
            event = self.events.get(rid)
            if event is not None and event.nonce == nonce:
                confirmed = self.holds.get(rid, 0) >= 0
                if confirmed:
                    self.holds.pop(rid, None)
            elif self.dead.get(rid) == nonce:
                maybe.add(rid)
            else:
                confirmed = False
        claimed = set()
        for key, at in sorted(self.holds.items()):
            if at > now_ms:
                continue
            if key in self.events:
                self.holds[key] = -1
                claimed.add((key, self.events[key].nonce, self.events[key].cost))
            elif key in self.dead:
                maybe.add(key)
            else:
                del self.holds[key]
        return Held(confirmed, claimed, maybe)

    def usage(self, now_ms: int, plan: list[Window]) -> tuple[int, tuple[WindowState, ...],
                                                             list[tuple[str, int, int, str]]]:
        """(clock, windows, events most recent first as (id, at, cost, route))."""
        if not self.started:  # no keys: zeros, and nothing is written
            return now_ms, tuple(WindowState(0, w.limit, None) for w in plan), []
        self.tick(now_ms, plan)
        events = sorted(self.events.items(), key=lambda kv: (kv[1].at, kv[0]), reverse=True)
        return (self.clk, tuple(self.state(w) for w in plan),
                [(rid, e.at, e.cost, e.route) for rid, e in events])
