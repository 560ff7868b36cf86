"""Usage-threshold events: detected by the reservation script, published once per crossing.

EventBridge is moto's, run as a server on a private port so that several OS processes
publish to one bus; a rule forwards the bus's events to an SQS queue the test reads.
"""

from __future__ import annotations

import multiprocessing as mp
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import Depends

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
