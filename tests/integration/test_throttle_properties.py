"""The throttle's scripts against a small pure-Python reference model (Hypothesis stateful).

Random steps run the real scripts on the session's redis-server with explicit caller clocks
(clocks that run behind or ahead, times exactly on a lease's, a queue entry's or a pause's
end) and the same steps on the model; after every step Redis must hold exactly the model's
state and every reply must be the model's. Independently of the model, every step checks:

- GCRA spacing: reservations are FIFO, no span [s_i, s_j] of slots holds more than
  (s_j - s_i) / T + burst cost units, an admitted wait is within the caller's limit and a
  refused one beyond it, and nothing is admitted before a pause ends;
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
NAMES = ("throttle_acquire", "throttle_pause", "throttle_lease_acquire",
         "throttle_lease_release")


def fmt(x: float) -> str:
    return f"{x:.3f}"


def fmt_up(x: float) -> str:
    return f"{math.ceil(x * 1000) / 1000:.3f}"


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
    state: dict[str, str] = field(default_factory=dict)        # the GCRA hash, as text
    answers: dict[str, Any] = field(default_factory=dict)      # call key -> its answer
    lclock: str | None = None
    leases: dict[str, float] = field(default_factory=dict)
    waiters: dict[str, float] = field(default_factory=dict)
    wexpiry: dict[str, float] = field(default_factory=dict)
    released: dict[str, float] = field(default_factory=dict)

    def _num(self, name: str) -> float:
        return float(self.state[name]) if name in self.state else 0.0

    def acquire(self, answer: str, now: float, cost: int, max_wait: float,
                recheck: bool, call_at: float) -> list[Any]:
        if answer in self.answers:
            slot, seq = self.answers[answer]
            return [1, fmt(float(slot) - now), slot, seq]
        tat, pause = self._num("tat"), self._num("pause")
        clock = max(self._num("clock"), now)
        if recheck and pause <= call_at:
            return [2, "0", fmt(now), 0]
        new_tat = max(tat, clock, pause) + cost * self.interval
        slot = max(clock, pause, new_tat - self.burst * self.interval)
        wait = slot - now
        if wait > max_wait:
            return [0, fmt(wait), fmt(slot), 0]
        seq = int(self.state.get("seq", "0")) + 1
        self.state.update(seq=str(seq), tat=fmt_up(new_tat), clock=fmt(clock))
        self.answers[answer] = (fmt(slot), seq)
        return [1, fmt(wait), fmt(slot), seq]

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


SKEWS = st.one_of(st.just(0.0), st.sampled_from([-0.25, 0.25, -3.0, 3.0]),
                  st.sampled_from(["-lease", "+lease", "-big", "+big"]))


class ThrottleMachine(RuleBasedStateMachine):
    """One provider's throttle and in-flight cap, driven by random calls with explicit clocks."""

    client: redis.Redis

    def __init__(self) -> None:
        super().__init__()
        self.uid = uuid.uuid4().hex[:12]
        self.scripts = {n: self.client.register_script(script(n).source) for n in NAMES}
        self.state_key, self.answer_prefix = provider_keys(self.uid, "gcra", "gcra:call:")
        self.lease_keys = provider_keys(self.uid, "leases", "waiters", "wexpiry", "lclock",
                                        "released")
        self.t = BASE_MS
        self.calls: list[Call] = []
        self.bookings: list[tuple[int, float, int]] = []   # (seq, slot, cost)
        self.booked: set[str] = set()                      # answer keys of the bookings
        self.granted: dict[str, float] = {}                # lease id -> grant clock
        self.gone: set[str] = set()                        # released ids
        self.ids: list[str] = []
        self.ttls: dict[str, int] = {}                     # expiries set since the last check
        self.model = Model(10.0, 1, 1, 40.0, 30.0)

    @initialize(interval=st.sampled_from([10.0, 12.5, 100.0]), burst=st.integers(1, 3),
                limit=st.integers(1, 3), lease_ms=st.sampled_from([40.0, 100.0]),
                waiter_ttl=st.sampled_from([30.0, 60.0]))
    def configure(self, interval: float, burst: int, limit: int, lease_ms: float,
                  waiter_ttl: float) -> None:
        self.model = Model(interval, burst, limit, lease_ms, waiter_ttl)

    # ---------------------------------------------------------------- helpers

    def now(self, skew: float | str) -> float:
        big = 3 * max(self.model.interval, self.model.lease_ms)
        offsets = {"-lease": -self.model.lease_ms, "+lease": self.model.lease_ms,
                   "-big": -big, "+big": big}
        return self.t + (offsets[skew] if isinstance(skew, str) else skew)

    def send(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run a script with PTTL and PERSIST of every key, atomically (see the docstring)."""
        watched = [self.state_key, *self.lease_keys]
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
        state, leases, waiters, wexpiry, released, lclock = pipe.execute()
        return {"state": {k.decode(): v.decode() for k, v in state.items()},
                "leases": {k.decode(): s for k, s in leases},
                "waiters": {k.decode(): s for k, s in waiters},
                "wexpiry": {k.decode(): s for k, s in wexpiry},
                "released": {k.decode(): s for k, s in released},
                "lclock": lclock.decode() if lclock else None}

    def model_snapshot(self) -> dict[str, Any]:
        m = self.model
        return {"state": dict(m.state), "leases": dict(m.leases), "waiters": dict(m.waiters),
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
                m._num("pause"), m._num("tat")]
        return sorted(e for e in ends if e > self.t)

    # ---------------------------------------------------------------- rules: the rate

    @rule(skew=SKEWS, cost=st.integers(1, 3), wait=st.sampled_from([0.0, 5.0, 30.0, 300.0]),
          recheck=st.booleans(), lead=st.sampled_from([0.0, 0.25, 2.0]))
    def acquire(self, skew: float | str, cost: int, wait: float, recheck: bool,
                lead: float) -> None:
        """A caller asks for a slot (or, about to call at its slot, rechecks for a pause)."""
        cost = min(cost, self.model.burst)
        now = self.now(skew)
        call_at = now + lead if recheck else now
        answer = self.answer_prefix + uuid.uuid4().hex
        pause_before = self.model._num("pause")
        args = [fmt(now), repr(self.model.interval), str(self.model.burst), str(cost),
                fmt(wait), ANSWER_TTL_MS, 1 if recheck else 0, fmt(call_at)]
        reply = self.run("throttle_acquire", [self.state_key, answer], args,
                         lambda: self.model.acquire(answer, now, cost, wait, recheck, call_at))
        admitted, wait_ms, slot = reply[0], float(reply[1]), float(reply[2])
        if admitted == 1:
            assert wait_ms <= wait
            assert slot >= pause_before
            self.book(answer, reply, cost)
        elif admitted == 0:
            assert wait_ms > wait
        else:
            assert recheck and pause_before <= call_at

    @rule(skew=SKEWS, pause_ms=st.sampled_from([0.0, 0.25, 7.0, 50.0, 1000.0]))
    def pause(self, skew: float | str, pause_ms: float) -> None:
        """An upstream 429: the provider is paused for every caller."""
        now = self.now(skew)
        answer = self.answer_prefix + uuid.uuid4().hex
        before = self.model._num("pause")
        reply = self.run("throttle_pause", [self.state_key, answer],
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
        if call.name == "throttle_pause" or (
                call.name == "throttle_acquire" and call.reply[0] == 1):
            assert reply == call.reply and self.snapshot() == before  # kept answers
        elif call.name == "throttle_acquire" and reply[0] == 1:
            # A late copy of a refused call (or of a recheck told to go) may reserve a slot
            # nobody uses: wasted, never over the rate (the spacing invariant includes it).
            # A further copy gets that kept answer: the same booking, not a new one.
            self.book(call.keys[1], reply, int(call.args[3]))
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
        assert self.snapshot() == self.model_snapshot()
        ttls, self.ttls = self.ttls, {}
        m = self.model
        if self.state_key in ttls:
            needed = max(m._num("tat"), m._num("pause")) - m._num("clock")
            assert ttls[self.state_key] >= needed
        clock = float(m.lclock) if m.lclock else 0.0
        for key, table in zip(self.lease_keys[:3], (m.leases, m.waiters, m.wexpiry),
                              strict=True):
            if key in ttls and table and key != self.lease_keys[1]:
                assert ttls[key] >= max(table.values()) - clock

    @invariant()
    def gcra_spacing_holds(self) -> None:
        """Reservations are FIFO and no span of slots holds more than its share plus burst."""
        if not self.bookings:
            return
        seqs = [b[0] for b in self.bookings]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        slots = [b[1] for b in self.bookings]
        assert slots == sorted(slots)
        j_seq, j_slot, _ = self.bookings[-1]
        units = 0
        for _, i_slot, i_cost in reversed(self.bookings):
            units += i_cost
            assert units <= (j_slot - i_slot) / self.model.interval + self.model.burst + 1e-9

    @invariant()
    def lease_cap_holds(self) -> None:
        """Never more live leases (on the shared clock) than the cap."""
        clock = float(self.model.lclock) if self.model.lclock else 0.0
        assert sum(1 for e in self.model.leases.values() if e > clock) <= self.model.limit

    def book(self, answer: str, reply: list[Any], cost: int) -> None:
        """Record the reservation ``reply`` kept under ``answer``, once."""
        if answer not in self.booked:
            self.booked.add(answer)
            self.bookings.append((reply[3], float(reply[2]), cost))

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


def test_late_copies_of_a_recheck_told_to_go_book_one_slot(machine: ThrottleMachine) -> None:
    """A recheck told to go, sent twice more after a pause, reserves one slot, kept for both."""
    machine.configure(interval=10.0, burst=1, limit=1, lease_ms=40.0, waiter_ttl=30.0)
    for step in (lambda: machine.release("nobody", 0.0),
                 lambda: machine.acquire(skew=-0.25, cost=1, wait=5.0, recheck=True, lead=0.0),
                 lambda: machine.pause(skew=0.0, pause_ms=0.0)):
        step()
        checked(machine)
    recheck = machine.calls[1]
    assert recheck.reply[0] == 2  # not paused: go at the slot held
    for _ in range(2):
        machine.copy(recheck)
        checked(machine)
    assert [c.reply[0] for c in machine.calls[-2:]] == [1, 1]
    assert machine.calls[-1].reply == machine.calls[-2].reply  # the kept answer
    assert [seq for seq, _, _ in machine.bookings] == [1]


def test_paused_state_outlives_a_slow_step(machine: ThrottleMachine) -> None:
    """After a reservation, a long pause, a re-send, late copies and a jump to the pause's end,
    Redis holds the model's state and no key has an expiry left that real time could reach."""
    machine.configure(interval=10.0, burst=1, limit=1, lease_ms=40.0, waiter_ttl=30.0)
    machine.acquire(skew=0.0, cost=1, wait=300.0, recheck=False, lead=0.0)
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
    keys = [machine.state_key, *machine.lease_keys]
    assert {key: machine.client.pttl(key) for key in keys
            if machine.client.exists(key)} == {machine.state_key: -1}
    checked(machine)
    assert machine.snapshot()["state"]["seq"] == "1"
