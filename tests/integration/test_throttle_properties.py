"""The throttle's scripts against a small pure-Python reference model (Hypothesis stateful).

Random steps run the real scripts on the session's redis-server with explicit caller clocks
(clocks that run behind or ahead, times exactly on a lease's, a queue entry's or a pause's
end) and the same steps on the model; after every step Redis must hold exactly the model's
state and every reply must be the model's. Three users (weights drawn per example) ask for
slots, queue and come back. Independently of the model, every step checks:

- the limit (GCRA spacing): bookings are in order, no span [s_i, s_j] of slots holds more
  than (s_j - s_i) / T + burst cost units, a booked wait is within the caller's limit and
  horizon and a refused one beyond its limit, and nothing is booked before a pause ends;
- fairness (docs/throttle.md): only the head of the fair queue books (passing over entries
  whose callers are late for their told slot: those lose both bounds for that turn); and
  while two users
  i and j both have requests queued (and neither lost one to its deadline or expiry), the
  cost booked to them, W_i and W_j, keeps |W_i / w_i - W_j / w_j| <= c_max / w_i +
  c_max / w_j;
- no starvation: the cost booked ahead of a queued request by requests that arrived after
  it is at most the sum over the other users u of w_u * (S - V) + c_max, where S is its
  start tag and V the virtual time when it arrived;
- leases: never more live leases than the cap, and a lease whose holder died (never
  released) counts until the shared clock reaches its grant time plus the lease time, and
  not after;
- a call sent again (a lost reply re-sent, or a late copy) answers as the first did and
  changes nothing.

The lease scripts trust a caller's clock only within a bound of the server's (the library
sends 0); here that bound is larger than any offset of the clocks from the server's, so the
explicit clocks decide and the model can follow them. test_throttle_resend.py checks the
library's bound with the server's clock.

Key expiry is real time, the clocks here are not: each script runs in a transaction that
also reads and removes the expiry of every key it may write, so no key can expire in real
time between steps (a step slowed down past a key's expiry once lost the provider's state),
and after each step the test checks that every key the step wrote would have lived at least
as long as its entries need.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from local.redis_servers import RedisServer
from usage_limits._scripts import script
from usage_limits.keys import provider_keys

#: The clocks' origin, ms since the epoch (any value; the scripts only take differences).
BASE_MS = 1_800_000_000_000.0
#: Answers are kept longer than any example runs (the production value is 10 s).
ANSWER_TTL_MS = 600_000
#: The lease scripts' trust in the caller's clock here, ms: more than any clock's offset from
#: the server's (the clocks start at BASE_MS and move by at most minutes).
TRUST_MS = 1e13
#: Steps per example (at most): ci runs 100 examples of up to 80 steps (about 8,000 steps
#: in all), long 2,000 examples of up to 200.
STEPS = 80 if settings().max_examples <= 100 else 200
NAMES = ("throttle_acquire", "throttle_confirm", "throttle_pause", "throttle_lease_acquire",
         "throttle_lease_release")
USERS = ("a", "b", "c")


def fmt(x: float) -> str:
    return f"{x:.3f}"


def fmt_up(x: float) -> str:
    return f"{math.ceil(x * 1000) / 1000:.3f}"


def tag_text(x: float) -> str:
    return "%.17g" % x  # noqa: UP031 - the same text as Lua's string.format('%.17g')


def _b(value: Any) -> Any:
    """A reply with bytes decoded, for comparison with the model's."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [_b(v) for v in value]
    return value


# ------------------------------------------------------------------------- the reference model

@dataclass
class Model:
    """What the four scripts keep, in plain Python."""

    interval: float
    burst: int
    limit: int
    lease_ms: float
    waiter_ttl: float
    grace: float = 5.0
    weights: dict[str, float] = field(default_factory=dict)    # user -> weight
    state: dict[str, str] = field(default_factory=dict)        # the GCRA hash, as text
    queue: dict[str, float] = field(default_factory=dict)      # entry -> start tag
    entries: dict[str, str] = field(default_factory=dict)      # entry -> "cost deadline user"
    expiry: dict[str, float] = field(default_factory=dict)     # entry -> expiry
    users: dict[str, float] = field(default_factory=dict)      # user -> finish tag
    answers: dict[str, Any] = field(default_factory=dict)      # call key -> its answer
    lclock: str | None = None
    leases: dict[str, float] = field(default_factory=dict)
    waiters: dict[str, float] = field(default_factory=dict)
    wexpiry: dict[str, float] = field(default_factory=dict)
    released: dict[str, float] = field(default_factory=dict)

    def _num(self, name: str) -> float:
        return float(self.state[name]) if name in self.state else 0.0

    def _answered(self, answer: str, now: float) -> list[Any] | None:
        if answer not in self.answers:
            return None
        status, slot, seq, entry = self.answers[answer]
        return [status, fmt(float(slot) - now), slot, seq, entry]

    def _start(self, now: float) -> tuple[float, float, float, float]:
        """tat, clock, pause, vt after a call's first write and the queue's purge."""
        clock = max(self._num("clock"), now)
        self.state["clock"] = fmt(clock)
        for entry in [e for e, at in self.expiry.items() if at <= float(fmt(clock))]:
            self._drop(entry)
        return self._num("tat"), clock, self._num("pause"), self._num("vt")

    def _drop(self, entry: str) -> None:
        for table in (self.queue, self.entries, self.expiry):
            table.pop(entry, None)

    def _ahead(self, tag: float, entry: str | None, late: float = -math.inf) -> float:
        return sum(float(self.entries[e].split()[0]) for e, s in self.queue.items()
                   if (s < tag or (s == tag and (entry is None or e < entry)))
                   and float(self.entries[e].split()[2]) >= late)

    def _slot(self, tat: float, clock: float, pause: float, units: float) -> float:
        base = max(tat, clock, pause)
        return max(clock, pause, base + units * self.interval - self.burst * self.interval)

    def _book(self, tat: float, clock: float, pause: float, cost: float, vt: float) -> int:
        seq = int(self.state.get("seq", "0")) + 1
        self.state.update(seq=str(seq), vt=tag_text(vt),
                          tat=fmt_up(max(tat, clock, pause) + cost * self.interval))
        return seq

    def _keep(self, answer: str, reply: list[Any]) -> list[Any]:
        self.answers[answer] = (reply[0], reply[2], reply[3], reply[4])
        return reply

    def acquire(self, answer: str, now: float, cost: int, max_wait: float, horizon: float,
                user: str, rid: str) -> list[Any]:
        kept = self._answered(answer, now)
        if kept is not None:
            return kept
        tat, clock, pause, vt = self._start(now)
        self.users = {u: f for u, f in self.users.items() if f > vt}
        start = max(vt, self.users.get(user, vt))
        weight = self.weights[user]
        queued = bool(self.queue)
        slot = self._slot(tat, clock, pause, (self._ahead(start, None) if queued else 0) + cost)
        wait = slot - now
        if wait > max_wait:
            return self._keep(answer, [0, fmt(wait), fmt(slot), 0, ""])
        self.users[user] = float(tag_text(start + cost / weight))
        if not queued and wait <= horizon:
            seq = self._book(tat, clock, pause, cost, start)
            return self._keep(answer, [1, fmt(wait), fmt(slot), seq, ""])
        qseq = int(self.state.get("qseq", "0")) + 1
        self.state["qseq"] = str(qseq)
        entry = f"{qseq:015d}:{rid}"
        deadline = now + max_wait
        self.queue[entry] = float(tag_text(start))
        self.entries[entry] = f"{fmt(cost)} {fmt(deadline)} {fmt(slot)} {user}"
        self.expiry[entry] = float(fmt(min(deadline, slot + self.grace)))
        return self._keep(answer, [3, fmt(wait), fmt(slot), 0, entry])

    def confirm(self, answer: str, now: float, max_wait: float, horizon: float,
                entry: str, reach: float) -> list[Any]:
        kept = self._answered(answer, now)
        if kept is not None:
            return kept
        tat, clock, pause, vt = self._start(now)
        if entry not in self.entries:
            return self._keep(answer, [4, fmt(0), fmt(now), 0, ""])
        cost_text, deadline_text, _, user = self.entries[entry].split(" ", 3)
        cost, deadline = float(cost_text), float(deadline_text)
        start = self.queue[entry]
        ahead = self._ahead(start, entry, clock - reach)
        slot = self._slot(tat, clock - reach, pause, ahead + cost)
        wait = slot - now
        if wait > max_wait:
            self._drop(entry)
            return self._keep(answer, [0, fmt(wait), fmt(slot), 0, ""])
        if ahead == 0 and wait <= horizon:
            self._drop(entry)
            seq = self._book(tat, clock - reach, pause, cost, max(vt, start))
            return self._keep(answer, [1, fmt(wait), fmt(slot), seq, ""])
        self.entries[entry] = f"{cost_text} {deadline_text} {fmt(slot)} {user}"
        self.expiry[entry] = float(fmt(min(deadline, slot + self.grace)))
        return self._keep(answer, [3, fmt(wait), fmt(slot), 0, entry])

    def pause(self, answer: str, now: float, pause_ms: float) -> str:
        if answer in self.answers:
            return str(self.answers[answer])
        clock = max(self._num("clock"), now)
        text = fmt(math.ceil(max(self._num("pause"), clock + pause_ms) * 1000) / 1000)
        self.state.update(pause=text, clock=fmt(clock))
        self.answers[answer] = text
        return text

    def lease_acquire(self, now_arg: float, lid: str, queue: bool) -> list[Any]:
        now = max(float(self.lclock) if self.lclock else 0.0, now_arg)
        self.lclock = fmt(now)
        for table in (self.leases, self.released):
            for key in [k for k, score in table.items() if score <= now]:
                del table[key]
        for key in [k for k, score in self.wexpiry.items() if score <= now]:
            del self.wexpiry[key]
            self.waiters.pop(key, None)
        held = len(self.leases)
        free = self.limit - held
        at = fmt(now)
        if lid in self.leases:
            return [1, -1, free, "", at]
        if lid in self.released:
            return [0, -1, free, "", at]
        order = sorted(self.waiters, key=lambda k: (self.waiters[k], k))
        if lid in self.waiters:
            rank = order.index(lid)
        else:
            rank = len(self.waiters)
            if rank >= free and queue:
                self.waiters[lid] = max(self.waiters.values(), default=0.0) + 1
        if rank < free:
            self.waiters.pop(lid, None)
            self.wexpiry.pop(lid, None)
            self.leases[lid] = now + self.lease_ms
            return [1, -1, free - 1, "", at]
        if not queue:
            return [0, -1, free, "", at]
        self.wexpiry[lid] = now + self.waiter_ttl
        need = rank - free + 1
        expiry = None
        if held > 0:
            by_expiry = sorted(self.leases.items(), key=lambda kv: (kv[1], kv[0]))
            expiry = by_expiry[min(need, held) - 1][1]
        first = min(self.wexpiry.items(), key=lambda kv: (kv[1], kv[0]))
        if first[0] != lid and (expiry is None or first[1] < expiry):
            expiry = first[1]
        return [0, rank, free, "" if expiry is None else fmt(expiry), at]

    def lease_release(self, lid: str, now_arg: float) -> int:
        if lid in self.released:
            score = self.released[lid]
            return 0 if math.floor(score) == score else 1
        now = max(float(self.lclock) if self.lclock else 0.0, now_arg)
        live = lid in self.leases and self.leases[lid] > now
        for table in (self.leases, self.waiters, self.wexpiry):
            table.pop(lid, None)
        answer = 1 if live else 0
        self.released[lid] = math.ceil(now + self.lease_ms) + 0.5 * answer
        return answer


# --------------------------------------------------------------------------- the state machine

@dataclass(frozen=True)
class Call:
    """One script call as sent, and how the model answers it."""

    name: str
    keys: list[str]
    args: list[Any]
    model: Callable[[], Any]
    reply: Any


HORIZONS = st.sampled_from([0.0, 0.25, 5.0, 20.0])
SKEWS = st.one_of(st.just(0.0), st.sampled_from([-0.25, 0.25, -3.0, 3.0]),
                  st.sampled_from(["-lease", "+lease", "-big", "+big"]))


class ThrottleMachine(RuleBasedStateMachine):
    """One provider's throttle and in-flight cap, driven by random calls with explicit clocks."""

    client: redis.Redis

    def __init__(self) -> None:
        super().__init__()
        self.uid = uuid.uuid4().hex[:12]
        self.scripts = {n: self.client.register_script(script(n).source) for n in NAMES}
        self.state_key, self.answer_prefix, *self.queue_keys = provider_keys(
            self.uid, "gcra", "gcra:call:", "fq", "fq:entries", "fq:expiry", "fq:users")
        self.lease_keys = provider_keys(self.uid, "leases", "waiters", "wexpiry", "lclock",
                                        "released")
        self.t = BASE_MS
        self.calls: list[Call] = []
        self.bookings: list[tuple[int, float, int]] = []   # (seq, slot, cost)
        self.booked: set[str] = set()                      # answer keys of the bookings
        self.served = dict.fromkeys(USERS, 0.0)            # cost booked per user
        self.since: dict[tuple[str, str], tuple[float, float]] = {}  # joint backlog start
        self.arrived: dict[str, tuple[float, float, float]] = {}  # entry -> (S, V, displaced)
        self.owners: dict[str, str] = {}                   # entry -> its user
        self.granted: dict[str, float] = {}                # lease id -> grant clock
        self.gone: set[str] = set()                        # released ids
        self.ids: list[str] = []
        self.ttls: dict[str, int] = {}                     # expiries set since the last check
        self.model = Model(10.0, 1, 1, 40.0, 30.0)

    @initialize(interval=st.sampled_from([10.0, 12.5, 100.0]), burst=st.integers(1, 3),
                limit=st.integers(1, 3), lease_ms=st.sampled_from([40.0, 100.0]),
                waiter_ttl=st.sampled_from([30.0, 60.0]), grace=st.sampled_from([5.0, 50.0]),
                weights=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=3, max_size=3))
    def configure(self, interval: float, burst: int, limit: int, lease_ms: float,
                  waiter_ttl: float, grace: float = 5.0,
                  weights: list[float] | None = None) -> None:
        self.model = Model(interval, burst, limit, lease_ms, waiter_ttl, grace,
                           dict(zip(USERS, weights or [1.0] * 3, strict=True)))

    # ---------------------------------------------------------------- helpers

    def now(self, skew: float | str) -> float:
        big = 3 * max(self.model.interval, self.model.lease_ms)
        offsets = {"-lease": -self.model.lease_ms, "+lease": self.model.lease_ms,
                   "-big": -big, "+big": big}
        return self.t + (offsets[skew] if isinstance(skew, str) else skew)

    def send(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run a script with PTTL and PERSIST of every key, atomically (see the docstring)."""
        watched = [self.state_key, *self.queue_keys, *self.lease_keys]
        pipe = self.client.pipeline(transaction=True)
        self.scripts[name](keys=keys, args=args, client=pipe)
        for key in watched:
            pipe.pttl(key)
        for key in watched:
            pipe.persist(key)
        out = pipe.execute()
        self.ttls.update((key, ttl) for key, ttl in zip(watched, out[1:], strict=False)
                         if ttl >= 0)
        return _b(out[0])

    def run(self, name: str, keys: list[str], args: list[Any], model: Callable[[], Any]) -> Any:
        reply = self.send(name, keys, args)
        expected = model()
        assert reply == expected, (name, args, reply, expected)
        self.calls.append(Call(name, keys, args, model, reply))
        return reply

    def snapshot(self) -> dict[str, Any]:
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.state_key)
        for key in self.lease_keys[:3] + self.lease_keys[4:]:
            pipe.zrange(key, 0, -1, withscores=True)
        pipe.get(self.lease_keys[3])
        queue, entries, expiry, users = self.queue_keys
        pipe.zrange(queue, 0, -1, withscores=True)
        pipe.hgetall(entries)
        pipe.zrange(expiry, 0, -1, withscores=True)
        pipe.zrange(users, 0, -1, withscores=True)
        (state, leases, waiters, wexpiry, released, lclock, *fair) = pipe.execute()
        return {"state": {k.decode(): v.decode() for k, v in state.items()},
                "queue": {k.decode(): s for k, s in fair[0]},
                "entries": {k.decode(): v.decode() for k, v in fair[1].items()},
                "expiry": {k.decode(): s for k, s in fair[2]},
                "users": {k.decode(): s for k, s in fair[3]},
                "leases": {k.decode(): s for k, s in leases},
                "waiters": {k.decode(): s for k, s in waiters},
                "wexpiry": {k.decode(): s for k, s in wexpiry},
                "released": {k.decode(): s for k, s in released},
                "lclock": lclock.decode() if lclock else None}

    def model_snapshot(self) -> dict[str, Any]:
        m = self.model
        return {"state": dict(m.state), "queue": dict(m.queue), "entries": dict(m.entries),
                "expiry": dict(m.expiry), "users": dict(m.users),
                "leases": dict(m.leases), "waiters": dict(m.waiters),
                "wexpiry": dict(m.wexpiry), "released": dict(m.released), "lclock": m.lclock}

    def lease_args(self, now: float, lid: str, queue: bool) -> list[Any]:
        m = self.model
        return [fmt(now), m.limit, fmt(m.lease_ms), lid, fmt(m.waiter_ttl), 1 if queue else 0,
                fmt(TRUST_MS)]

    # ---------------------------------------------------------------- rules: time

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 5.0, "interval", "lease", "ttl", "long"]))
    def tick(self, dt: float | str) -> None:
        """The true time moves on."""
        steps = {"interval": self.model.interval, "lease": self.model.lease_ms,
                 "ttl": self.model.waiter_ttl, "long": 10 * self.model.lease_ms}
        self.t += steps[dt] if isinstance(dt, str) else dt

    @rule(data=st.data())
    def to_a_boundary(self, data: st.DataObject) -> None:
        """The true time jumps to exactly an end: a lease's, a queue entry's, a pause's, tat."""
        if self.ends():
            self.t = data.draw(st.sampled_from(self.ends())) - data.draw(
                st.sampled_from([0.0, 0.25]))

    def ends(self) -> list[float]:
        """The ends still ahead of the true time, earliest first."""
        m = self.model
        ends = [*m.leases.values(), *m.wexpiry.values(), *m.released.values(),
                *m.expiry.values(), m._num("pause"), m._num("tat")]
        return sorted(e for e in ends if e > self.t)

    # ---------------------------------------------------------------- rules: the rate

    @rule(skew=SKEWS, cost=st.integers(1, 3), wait=st.sampled_from([0.0, 5.0, 30.0, 300.0]),
          horizon=HORIZONS, user=st.sampled_from(USERS))
    def acquire(self, skew: float | str, cost: int, wait: float, horizon: float,
                user: str) -> None:
        """A user's request asks for a slot: booked, queued or refused."""
        cost = min(cost, self.model.burst)
        now = self.now(skew)
        answer = self.answer_prefix + uuid.uuid4().hex
        rid = uuid.uuid4().hex[:8]
        pause_before = self.model._num("pause")
        vt = self.model._num("vt")
        args = [fmt(now), repr(self.model.interval), str(self.model.burst), str(cost),
                fmt(wait), ANSWER_TTL_MS, fmt(horizon), user, repr(self.model.weights[user]),
                fmt(self.model.grace), rid]
        before = dict(self.model.queue)
        reply = self.run("throttle_acquire", [self.state_key, answer, *self.queue_keys], args,
                         lambda: self.model.acquire(answer, now, cost, wait, horizon, user, rid))
        status, wait_ms, slot = reply[0], float(reply[1]), float(reply[2])
        if status == 1:
            assert wait_ms <= min(wait, horizon) and slot >= pause_before
            assert not self.model.queue  # it books at once only when nobody is left waiting
            self.book(answer, reply, cost, user, None)
        elif status == 3:
            assert wait_ms <= wait
            self.arrived[reply[4]] = (self.model.queue[reply[4]], vt, 0.0)
            self.owners[reply[4]] = user
        else:
            assert status == 0 and wait_ms > wait
        self.note_removals(before, None)

    @rule(skew=SKEWS, wait=st.sampled_from([0.0, 5.0, 30.0, 300.0]), horizon=HORIZONS,
          reach=st.sampled_from([0.0, 0.25, 5.0]), data=st.data())
    def confirm(self, skew: float | str, wait: float, horizon: float, reach: float,
                data: st.DataObject) -> None:
        """A queued request asks again (or one whose entry is gone)."""
        known = sorted(self.arrived)
        if not known:
            return
        entry = data.draw(st.sampled_from(known))
        now = self.now(skew)
        answer = self.answer_prefix + uuid.uuid4().hex
        pause_before = self.model._num("pause")
        before = dict(self.model.queue)
        args = [fmt(now), repr(self.model.interval), str(self.model.burst), fmt(wait),
                ANSWER_TTL_MS, fmt(horizon), entry, fmt(self.model.grace), fmt(reach)]
        info = self.model.entries.get(entry)
        reply = self.run("throttle_confirm", [self.state_key, answer, *self.queue_keys], args,
                         lambda: self.model.confirm(answer, now, wait, horizon, entry, reach))
        status, wait_ms, slot = reply[0], float(reply[1]), float(reply[2])
        if status == 1:
            assert info is not None and wait_ms <= min(wait, horizon) and slot >= pause_before
            assert wait_ms >= -reach  # a late head's slot lies at most reach before its clock
            # only the head of the fair queue books, passing over callers late for their turn
            late = float(self.model.state["clock"]) - reach
            passed = [e for e, s in self.model.queue.items() if (s, e) < (before[entry], entry)]
            assert all(float(self.model.entries[e].split()[2]) < late for e in passed)
            for e in passed:  # a caller late for its turn is owed neither bound for it
                self.forget(e)
            self.book(answer, reply, int(float(info.split()[0])), info.split(" ", 3)[3], entry)
        elif status == 3:
            assert wait_ms <= wait
        elif status == 0:
            assert wait_ms > wait
        else:
            assert status == 4 and entry not in self.model.entries
        self.note_removals(before, entry if status == 1 else None)

    @rule(skew=SKEWS, pause_ms=st.sampled_from([0.0, 0.25, 7.0, 50.0, 1000.0]))
    def pause(self, skew: float | str, pause_ms: float) -> None:
        """An upstream 429: the provider is paused for every caller."""
        now = self.now(skew)
        answer = self.answer_prefix + uuid.uuid4().hex
        before = self.model._num("pause")
        reply = self.run("throttle_pause", [self.state_key, answer, self.queue_keys[2]],
                         [fmt(now), fmt(pause_ms), ANSWER_TTL_MS],
                         lambda: self.model.pause(answer, now, pause_ms))
        assert float(reply) >= max(before, now + pause_ms)

    # ---------------------------------------------------------------- rules: leases

    @rule(skew=SKEWS, queue=st.booleans(), data=st.data())
    def lease_acquire(self, skew: float | str, queue: bool, data: st.DataObject) -> None:
        """A caller asks for a lease: a new one, or a queued caller coming back."""
        waiting = sorted(self.model.waiters)
        lid = data.draw(st.sampled_from(waiting)) if waiting and data.draw(st.booleans()) \
            else f"id{len(self.ids)}"
        if lid not in self.ids:
            self.ids.append(lid)
        now = self.now(skew)
        reply = self.run("throttle_lease_acquire", self.lease_keys,
                         self.lease_args(now, lid, queue),
                         lambda: self.model.lease_acquire(now, lid, queue))
        self.note_grant(lid, reply)

    @rule(skew=SKEWS, data=st.data())
    def lease_release(self, skew: float | str, data: st.DataObject) -> None:
        """A holder gives its lease back (or a waiter gives up, or an unknown id is released)."""
        known = sorted(set(self.model.leases) | set(self.model.waiters) | set(self.ids))
        self.release(data.draw(st.sampled_from(known)) if known else "nobody", skew)

    def release(self, lid: str, skew: float | str) -> None:
        """Release ``lid`` at the caller's clock ``skew`` off the true time."""
        now = self.now(skew)
        self.run("throttle_lease_release", self.lease_keys,
                 [lid, f"{self.uid}-free", fmt(now), fmt(self.model.lease_ms), fmt(TRUST_MS)],
                 lambda: self.model.lease_release(lid, now))
        self.gone.add(lid)

    # ---------------------------------------------------------------- rules: re-sent calls

    @rule()
    def resend_last(self) -> None:
        """The last call is sent again (its reply was lost): same answer, nothing changes."""
        if not self.calls:
            return
        call = self.calls[-1]
        before = self.snapshot()
        reply = self.send(call.name, call.keys, call.args)
        assert reply == call.reply, (call, reply)
        assert call.model() == call.reply
        assert self.snapshot() == before

    @rule(data=st.data())
    def late_copy(self, data: st.DataObject) -> None:
        """An earlier call arrives again, late: what it promised holds."""
        if self.calls:
            self.copy(data.draw(st.sampled_from(self.calls)))

    def copy(self, call: Call) -> None:
        """``call`` arrives again, late."""
        before = self.snapshot()
        reply = self.send(call.name, call.keys, call.args)
        assert reply == call.model()
        self.calls.append(Call(call.name, call.keys, call.args, call.model, reply))
        if call.name in ("throttle_pause", "throttle_acquire", "throttle_confirm"):
            # Every answer is kept: a late copy changes nothing and answers the same.
            assert reply == call.reply and self.snapshot() == before
        if call.name == "throttle_lease_release":
            # No other caller's lease or place is touched (its own id may have been granted
            # again by a copy later than the lease time; a tombstone may be set again).
            after, lid = self.snapshot(), call.args[0]
            for k in ("leases", "waiters", "wexpiry"):
                assert {i: v for i, v in after[k].items() if i != lid} == {
                    i: v for i, v in before[k].items() if i != lid}
            if lid not in after["leases"]:
                self.gone.add(lid)
        if call.name == "throttle_lease_acquire":
            lid = call.args[3]
            if lid in self.model.released:  # its tombstone is still there
                assert reply[0] == 0  # a released id is not granted again
            self.note_grant(lid, reply)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def redis_holds_the_model_state(self) -> None:
        """Every key holds what the model holds, and every expiry set covered its entries."""
        got, expected = self.snapshot(), self.model_snapshot()
        assert got == expected, {k: (got[k], expected[k]) for k in got if got[k] != expected[k]}
        ttls, self.ttls = self.ttls, {}
        m = self.model
        last = max(m.expiry.values(), default=0.0)
        if self.state_key in ttls:
            needed = max(m._num("tat"), m._num("pause"), last) - m._num("clock")
            assert ttls[self.state_key] >= needed
        for key in self.queue_keys:
            if key in ttls:
                assert ttls[key] >= last - m._num("clock")
        clock = float(m.lclock) if m.lclock else 0.0
        for key, table in zip(self.lease_keys[:3], (m.leases, m.waiters, m.wexpiry),
                              strict=True):
            if key in ttls and table and key != self.lease_keys[1]:
                assert ttls[key] >= max(table.values()) - clock

    @invariant()
    def gcra_spacing_holds(self) -> None:
        """Booking numbers increase and no span [s_i, s_j] of slots holds more cost than its
        share plus burst (a late head may book a slot before one booked ahead of it)."""
        if not self.bookings:
            return
        seqs = [b[0] for b in self.bookings]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        by_slot = sorted((slot, cost) for _, slot, cost in self.bookings)
        for j, (j_slot, _) in enumerate(by_slot):
            units = 0
            for i_slot, i_cost in reversed(by_slot[:j + 1]):
                units += i_cost
                assert units <= (j_slot - i_slot) / self.model.interval + self.model.burst + 1e-9

    @invariant()
    def lease_cap_holds(self) -> None:
        """Never more live leases (on the shared clock) than the cap."""
        clock = float(self.model.lclock) if self.model.lclock else 0.0
        assert sum(1 for e in self.model.leases.values() if e > clock) <= self.model.limit

    @invariant()
    def shares_are_fair(self) -> None:
        """Two users with requests queued throughout got cost in proportion to their weights,
        within one largest cost each (start-time fair queuing's bound)."""
        w, c_max = self.model.weights, float(self.model.burst)
        waiting = {info.split(" ", 3)[3] for info in self.model.entries.values()}
        for pair in [(i, j) for i in USERS for j in USERS if i < j]:
            if not set(pair) <= waiting:
                self.since.pop(pair, None)
                continue
            i, j = pair
            if pair not in self.since:
                self.since[pair] = (self.served[i], self.served[j])
                continue
            w_i = (self.served[i] - self.since[pair][0]) / w[i]
            w_j = (self.served[j] - self.since[pair][1]) / w[j]
            assert abs(w_i - w_j) <= c_max / w[i] + c_max / w[j] + 1e-9, (pair, w_i, w_j)

    def book(self, answer: str, reply: list[Any], cost: int, user: str,
             entry: str | None) -> None:
        """Record the booking ``reply`` kept under ``answer``, once; check that no queued
        request was displaced by later arrivals more than its bound."""
        if answer in self.booked:
            return
        self.booked.add(answer)
        self.bookings.append((reply[3], float(reply[2]), cost))
        self.served[user] += cost
        if entry is None:
            return
        w, c_max = self.model.weights, float(self.model.burst)
        for other, (start, vt, displaced) in list(self.arrived.items()):
            if other > entry or other not in self.model.queue:
                continue  # arrived after the booked one, or no longer waiting
            displaced += cost
            owner = self.model.entries[other].split(" ", 3)[3]
            bound = sum(w[u] * (start - vt) + c_max for u in USERS if u != owner)
            assert displaced <= bound + 1e-9, (other, displaced, bound)
            self.arrived[other] = (start, vt, displaced)

    def forget(self, entry: str) -> None:
        """End the joint backlogs of ``entry``'s user and stop tracking its displacement."""
        self.arrived.pop(entry, None)
        user = self.owners[entry]
        for pair in [p for p in self.since if user in p]:
            del self.since[pair]

    def note_removals(self, before: dict[str, float], booked: str | None) -> None:
        """A queued request that left without booking (deadline, expiry) ends the joint
        backlog of its user: the fairness bound counts from the next step."""
        for entry in set(before) - set(self.model.queue) - {booked}:
            user = self.model_user(entry)
            for pair in [p for p in self.since if user in p]:
                del self.since[pair]

    def model_user(self, entry: str) -> str:
        """The user of a queue entry (kept by the machine past the entry's removal)."""
        return self.owners[entry]

    def note_grant(self, lid: str, reply: list[Any]) -> None:
        """Record a new grant (not the answer to a re-sent call), then check the leases."""
        clock = float(self.model.lclock or 0)
        if reply[0] == 1 and (lid not in self.granted
                              or self.granted[lid] + self.model.lease_ms <= clock
                              or lid in self.gone):
            self.granted[lid] = clock
            self.gone.discard(lid)
        self.check_dead_holders()

    def check_dead_holders(self) -> None:
        """After a lease acquire: exactly the unreleased leases younger than lease_ms count."""
        clock = float(self.model.lclock or 0)
        alive = {lid for lid, at in self.granted.items()
                 if lid not in self.gone and at + self.model.lease_ms > clock}
        assert set(self.snapshot()["leases"]) == alive


def test_throttle_matches_its_model(redis_server: RedisServer) -> None:
    """The throttle scripts on a real redis-server behave exactly as the reference model."""
    client = redis.Redis(port=redis_server.port)
    try:
        ThrottleMachine.client = client
        run_state_machine_as_test(ThrottleMachine,
                                  settings=settings(settings(), stateful_step_count=STEPS))
    finally:
        client.close()


# Examples the long profile found, kept as explicit cases.

@pytest.fixture
def machine(redis_server: RedisServer) -> Iterator[ThrottleMachine]:
    """A state machine on the session's server, for a fixed sequence of steps."""
    client = redis.Redis(port=redis_server.port)
    ThrottleMachine.client = client
    try:
        yield ThrottleMachine()
    finally:
        client.close()


def checked(machine: ThrottleMachine) -> None:
    """Every invariant of the machine, as Hypothesis checks them after a step."""
    machine.redis_holds_the_model_state()
    machine.gcra_spacing_holds()
    machine.lease_cap_holds()
    machine.shares_are_fair()


def test_paused_state_outlives_a_slow_step(machine: ThrottleMachine) -> None:
    """After a reservation, a long pause, a re-send, late copies and a jump to the pause's end,
    Redis holds the model's state and no key has an expiry left that real time could reach."""
    machine.configure(interval=10.0, burst=1, limit=1, lease_ms=40.0, waiter_ttl=30.0)
    machine.acquire(skew=0.0, cost=1, wait=300.0, horizon=20.0, user="a")
    checked(machine)
    machine.pause(skew=0.0, pause_ms=1000.0)
    checked(machine)
    machine.resend_last()
    checked(machine)
    for call in list(machine.calls[:2]):
        machine.copy(call)
        checked(machine)
    machine.t = machine.ends()[-1]
    assert machine.t == float(machine.model.state["pause"])
    keys = [machine.state_key, *machine.queue_keys, *machine.lease_keys]
    assert {key: machine.client.pttl(key) for key in keys
            if machine.client.exists(key)} == {machine.state_key: -1,
                                               machine.queue_keys[3]: -1}
    checked(machine)
    assert machine.snapshot()["state"]["seq"] == "1"


def test_a_call_long_after_the_last_booking_keeps_the_state(machine: ThrottleMachine) -> None:
    """A request that queues and asks again with a clock seconds past every booking, pause
    and queue entry leaves the provider's state in place (an expiry of 0 would delete it and
    start the booking numbers again)."""
    machine.configure(interval=10.0, burst=1, limit=1, lease_ms=100.0, waiter_ttl=30.0)
    machine.acquire(skew=0.0, cost=1, wait=300.0, horizon=20.0, user="a")
    machine.acquire(skew=0.0, cost=1, wait=300.0, horizon=0.0, user="b")
    checked(machine)
    machine.t += 5000.0
    machine.confirm(skew="+big", wait=0.0, horizon=0.0, reach=0.0,
                    data=_Drawn(machine.calls[-1].reply[4]))
    checked(machine)
    assert machine.snapshot()["state"]["seq"] == "1"


class _Drawn:
    """Stands in for Hypothesis' ``data``: every draw gives ``value``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def draw(self, strategy: Any) -> Any:
        return self.value
