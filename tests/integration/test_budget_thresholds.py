"""Usage-threshold events: detected by the reservation script, published once per crossing.

EventBridge is moto's, run as a server on a private port so that several OS processes
publish to one bus; a rule forwards the bus's events to an SQS queue the test reads.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from fastapi import Depends
from hypothesis import example, given, settings
from hypothesis import strategies as st

from local.lambda_events import fresh_environment, http_event, invoke, lambda_loop
from local.redis_servers import RedisServer
from tests.conftest import StartEnvironment
from tests.eventbus import EventBus
from tests.metered import handler, metered_app
from usage_limits import TokenBudget, Window
from usage_limits.thresholds import Thresholds
from usage_limits.web import events, require_tokens

PROCESSES = 8
AWS_ENV = {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}


def _environment(redis_url: str, endpoint: str, bus: str, budget: str) -> dict[str, str]:
    return {**AWS_ENV, "REDIS_URL": redis_url, "ATTO_BUDGET": budget, "ATTO_EVENT_BUS": bus,
            "AWS_ENDPOINT_URL_EVENTBRIDGE": endpoint, "ATTO_EVENTS_TIMEOUT_S": "30",
            "POWERTOOLS_METRICS_DISABLED": "true"}


def _handler() -> Any:
    app = metered_app("thresholds test", ok="/ten", cost=10)

    @app.post("/one", dependencies=[Depends(require_tokens(cost=1))])
    async def one() -> dict[str, bool]:
        return {"ok": True}

    return handler(app)


@pytest.fixture
def web(lambda_env: StartEnvironment, redis_server: RedisServer,
        moto_endpoint: str) -> Iterator[tuple[Any, EventBus]]:
    """A metered app (routes costing 10 and 1 of a 100/1h plan) publishing to a fresh bus."""
    bus = EventBus(endpoint=moto_endpoint)
    lambda_env(_environment(redis_server.url, moto_endpoint, bus.name, "100/1h"),
               unset=["ATTO_ENV", "ATTO_USAGE_THRESHOLDS", "ATTO_USAGE_THRESHOLD_MARGIN"])
    yield _handler(), bus


def _charge(handler: Any, user: str, route: str = "/ten") -> int:
    return invoke(handler, http_event("POST", route, body={}, user=user)).status


def test_no_event_while_the_user_stays_below(web: tuple[Any, EventBus]) -> None:
    """Charges up to just under 80% of the window publish nothing."""
    handler, bus = web
    user = uuid.uuid4().hex
    for _ in range(7):
        assert _charge(handler, user) == 200
    for _ in range(9):
        assert _charge(handler, user, "/one") == 200  # 79 of 100
    assert bus.details(events.USAGE_THRESHOLD) == []


def test_each_threshold_is_published_once_with_its_fields(web: tuple[Any, EventBus]) -> None:
    """Crossing 80% and then 100% publishes one event each, with user, plan and window."""
    handler, bus = web
    user = uuid.uuid4().hex
    for _ in range(8):
        assert _charge(handler, user) == 200
    assert bus.details(events.USAGE_THRESHOLD) == [{"user": user, "plan": "default",
                                                    "window_s": 3600, "threshold": 80,
                                                    "used": 80, "limit": 100}]
    assert _charge(handler, user) == 200  # 90: nothing new
    assert bus.details(events.USAGE_THRESHOLD) == []
    assert _charge(handler, user) == 200  # 100
    assert [e["threshold"] for e in bus.details(events.USAGE_THRESHOLD)] == [100]
    assert _charge(handler, user) == 429  # rejected: nothing charged, nothing published
    assert bus.details(events.USAGE_THRESHOLD) == []


def test_the_event_names_the_users_plan(web: tuple[Any, EventBus],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With named plans, the event carries the plan the charge was made under and its limit."""
    handler, bus = web
    monkeypatch.setenv("ATTO_PLANS", "free=100/1h;pro=200/1h")
    monkeypatch.setenv("ATTO_DEFAULT_PLAN", "free")
    monkeypatch.setenv("ATTO_PLAN_CLAIM", "atto_plan")
    fresh_environment()
    user = uuid.uuid4().hex
    for _ in range(16):
        event = http_event("POST", "/ten", body={}, user=user)
        event["requestContext"]["authorizer"]["jwt"]["claims"]["atto_plan"] = "pro"
        assert invoke(handler, event).status == 200
    assert bus.details(events.USAGE_THRESHOLD) == [{"user": user, "plan": "pro",
                                                    "window_s": 3600, "threshold": 80,
                                                    "used": 160, "limit": 200}]


def _process_charges(env: dict[str, str], user: str, count: int, start: Any, out: Any) -> None:
    """One Lambda environment in its own process: ``count`` requests of 1 token each."""
    import os

    os.environ.update(env)
    from local.lambda_events import fresh_environment, http_event, invoke

    fresh_environment()
    statuses = []
    with lambda_loop():
        handler = _handler()
        invoke(handler, http_event("GET", "/missing", user="warm-up"))  # connect first
        start.wait()
        for _ in range(count):
            statuses.append(invoke(handler, http_event("POST", "/one", body={},
                                                       user=user)).status)
    out.put(statuses)


@pytest.mark.slow
def test_eight_processes_charging_one_user_publish_each_crossing_once(
        redis_server: RedisServer, moto_endpoint: str) -> None:
    """8 processes race one user past 80% and 100%: exactly one event per threshold."""
    bus = EventBus(endpoint=moto_endpoint)
    env = _environment(redis_server.url, moto_endpoint, bus.name, "100/1h")
    user = uuid.uuid4().hex
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_process_charges, args=(env, user, 15, start, out))
             for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    start.set()
    statuses = [s for _ in procs for s in out.get(timeout=120)]
    for p in procs:
        p.join(timeout=30)
    assert statuses.count(200) == 100 and statuses.count(429) == PROCESSES * 15 - 100
    got = bus.details(events.USAGE_THRESHOLD)
    assert sorted(e["threshold"] for e in got) == [80, 100]
    assert {(e["threshold"], e["used"]) for e in got} == {(80, 80), (100, 100)}


# --- the script's rules, read from the reservation's reply -------------------------------


@pytest.fixture
async def budget(redis_client: Any) -> TokenBudget:
    """A 100/1h ledger reporting 80% and 100% with a margin of 5 points (standalone, cluster)."""
    return TokenBudget(redis_client, [Window(100, 3600)],
                       thresholds=Thresholds((80, 100), 5))


async def _crossed(budget: TokenBudget, user: str, cost: int, now_ms: int) -> list[int]:
    reservation = await budget.reserve(user, uuid.uuid4().hex, cost, now_ms=now_ms)
    assert reservation.allowed
    return [c.threshold for c in reservation.crossings]


async def test_a_refund_within_the_margin_does_not_rearm(budget: TokenBudget) -> None:
    """A refund that leaves usage under 80% but within the margin (>= 75%) re-reports nothing."""
    user, now = uuid.uuid4().hex, 1_700_000_000_000
    await budget.reserve(user, "base", 76, now_ms=now)
    extra = await budget.reserve(user, "extra", 6, now_ms=now)  # 82: crosses 80
    assert [c.threshold for c in extra.crossings] == [80]
    assert await budget.refund(user, "extra", nonce=extra.nonce)  # 76: within 5 points
    assert await _crossed(budget, user, 6, now) == []  # 82 again: already reported
    assert await _crossed(budget, user, 18, now) == [100]


async def test_a_refund_beyond_the_margin_rearms(budget: TokenBudget) -> None:
    """Once usage was more than the margin under 80%, crossing it again is reported again."""
    user, now = uuid.uuid4().hex, 1_700_000_000_000
    base = await budget.reserve(user, "base", 70, now_ms=now)
    assert await _crossed(budget, user, 15, now) == [80]  # 85
    assert await _crossed(budget, user, 5, now) == []  # 90
    assert await budget.refund(user, "base", nonce=base.nonce)  # 20: far below 75
    assert await _crossed(budget, user, 60, now) == [80]  # 80 again
    assert await _crossed(budget, user, 20, now) == [100]


async def test_falling_exactly_to_the_margin_keeps_the_report(budget: TokenBudget) -> None:
    """Usage at exactly 75% (80 - 5) is not beyond the margin: 80% stays reported."""
    user, now = uuid.uuid4().hex, 1_700_000_000_000
    first = await budget.reserve(user, "a", 75, now_ms=now)
    assert await _crossed(budget, user, 5, now) == [80]  # 80
    last = await budget.reserve(user, "b", 5, now_ms=now)  # 85
    assert await budget.refund(user, "b", nonce=last.nonce)  # 80
    assert await budget.settle(user, "a", 70, nonce=first.nonce)  # 75
    assert await _crossed(budget, user, 5, now) == []
    assert await budget.settle(user, "a", 69, nonce=first.nonce)  # 79: was 74 before
    assert await _crossed(budget, user, 1, now) == []  # 80 from 79: not beyond, still quiet


async def test_the_window_turning_over_rearms(budget: TokenBudget) -> None:
    """When the charges leave the window, usage starts again from 0 and 80% is new again."""
    user, now = uuid.uuid4().hex, 1_700_000_000_000
    assert await _crossed(budget, user, 90, now) == [80]
    later = now + 3_600_001
    assert await _crossed(budget, user, 10, later) == []
    assert await _crossed(budget, user, 75, later) == [80]


async def test_one_charge_crossing_two_thresholds_reports_both(budget: TokenBudget) -> None:
    """A single charge from 50% to 100% reports 80 and 100."""
    user, now = uuid.uuid4().hex, 1_700_000_000_000
    await budget.reserve(user, "a", 50, now_ms=now)
    assert await _crossed(budget, user, 50, now) == [80, 100]


async def test_a_resent_reservation_reports_no_second_crossing(budget: TokenBudget) -> None:
    """The same call re-sent (same nonce, after a lost reply) reports no crossing again."""
    from usage_limits._scripts import script
    from usage_limits.budget import _decode_reservation

    user, now = uuid.uuid4().hex, 1_700_000_000_000
    keys, args = budget._reserve_call(user, "r1", 85, "", budget.windows, now, "nonce1")
    first = await script("budget_reserve")(budget.redis, keys, args)
    again = await script("budget_reserve")(budget.redis, keys, args)
    assert int(first[0]) == 1 and int(again[0]) == 1  # both report the charge
    decoded = [_decode_reservation(reply, 85, budget.windows, "nonce1")
               for reply in (first, again)]
    assert [c.threshold for c in decoded[0].crossings] == [80]
    assert decoded[1].crossings == ()


async def test_no_thresholds_reports_nothing(standalone_client: Any) -> None:
    """A ledger without thresholds (``ATTO_USAGE_THRESHOLDS=none``) never reports."""
    plain = TokenBudget(standalone_client, [Window(100, 3600)], thresholds=Thresholds(()))
    reservation = await plain.reserve(uuid.uuid4().hex, "a", 100, now_ms=1_700_000_000_000)
    assert reservation.allowed and reservation.crossings == ()


async def test_a_charge_undone_at_once_restores_the_levels_it_set(budget: TokenBudget) -> None:
    """A charge whose crossings were never reported (it was undone at once: its draw could
    not be recorded) gives its levels back with its refund: the next charge that crosses
    reports them, 80 and 100 alike, and a re-sent refund changes nothing more."""
    user, now = uuid.uuid4().hex, 1_700_000_000_000
    await budget.reserve(user, "base", 76, now_ms=now)
    undone = await budget.reserve(user, "undone", 24, now_ms=now)  # 100: crosses 80 and 100
    assert [c.threshold for c in undone.crossings] == [80, 100]
    assert await budget.refund(user, "undone", nonce=undone.nonce, uncross=undone.crossings)
    assert not await budget.refund(user, "undone", nonce=undone.nonce,
                                   uncross=undone.crossings)
    assert await _crossed(budget, user, 6, now) == [80]  # 82: reported now
    assert await _crossed(budget, user, 18, now) == [100]


# --- across plan changes: the script against a reference model -----------------------------

#: Plans a user moves between, each one window of the same length with its own limit.
SWITCHED_PLANS = [40, 100, 1000]
MARGIN = 5


class SwitchModel:
    """The thresholds of one window, as docs/operations.md states them: a charge reports p
    when it takes usage from below p% of its plan's limit to p% or more and p is above the
    level; the level forgets the thresholds usage was found more than the margin below."""

    def __init__(self) -> None:
        self.used = 0
        self.level = 0

    def charge(self, cost: int, limit: int) -> list[int] | None:
        """The thresholds crossed, or None when the charge does not fit."""
        if self.used + cost > limit:
            return None
        before, after = self.used, self.used + cost
        kept = max([p for p in (80, 100)
                    if p <= self.level and before * 100 >= (p - MARGIN) * limit], default=0)
        crossed = [p for p in (80, 100) if p > kept and before * 100 < p * limit <= after * 100]
        self.used, self.level = after, max([kept, *crossed])
        return crossed


@pytest.mark.parametrize("seed_plan", [0, 2])
def test_thresholds_across_plan_changes_match_the_model(redis_server: RedisServer,
                                                        seed_plan: int) -> None:
    """Any sequence of charges and refunds under plans of one window length with different
    limits reports exactly the crossings the model computes: only a charge that itself
    takes usage across a threshold of its plan reports it, so moving between plans never
    reports a threshold again while usage stays past it."""
    steps = st.lists(st.tuples(st.sampled_from(["charge", "charge", "refund"]),
                               st.integers(0, 2), st.integers(1, 10)), max_size=40)

    @settings(max_examples=60, deadline=None)
    @given(steps=steps)
    # past 80% of the 40-token plan under the 1000-token one, then charged under it
    @example(steps=[("charge", 2, 10)] * 3 + [("charge", 2, 4), ("charge", 0, 2)])
    def run(steps: list[tuple[str, int, int]]) -> None:
        loop = asyncio.new_event_loop()
        client = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
        budget = TokenBudget(client, [Window(SWITCHED_PLANS[seed_plan], 3600)],
                             thresholds=Thresholds((80, 100), MARGIN))
        user, now, model = uuid.uuid4().hex, 1_700_000_000_000, SwitchModel()
        charges: list[tuple[str, str, int]] = []
        try:
            for i, (kind, plan, cost) in enumerate(steps):
                limit = SWITCHED_PLANS[plan]
                if kind == "refund":
                    if charges:
                        rid, nonce, back = charges.pop(cost % len(charges))
                        assert loop.run_until_complete(budget.refund(user, rid, nonce=nonce))
                        model.used -= back
                    continue
                want = model.charge(cost, limit)
                got = loop.run_until_complete(budget.reserve(
                    user, f"r{i}", cost, windows=[Window(limit, 3600)], now_ms=now))
                assert got.allowed is (want is not None), (i, steps)
                assert [c.threshold for c in got.crossings] == (want or []), (i, steps)
                if got.allowed:
                    charges.append((f"r{i}", got.nonce, cost))
        finally:
            loop.run_until_complete(client.aclose())
            loop.close()

    run()
