"""Credit events: the reservation script's grant crossings, published once per crossing.

Real Redis (the session's servers) runs the reservation script; EventBridge is moto's, run
as a server on a private port so that several OS processes publish to one bus, and a rule
forwards the bus's events to an SQS queue the test reads. The plan is one window of 10
tokens an hour (the included quota): once it is used up, every token a charge costs is
drawn from the user's grant.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import uuid
from typing import Any

import boto3
import pytest

from local.lambda_events import fresh_environment, http_event, invoke, lambda_loop
from local.redis_servers import RedisServer
from tests.eventbus import EventBus
from usage_limits import TokenBudget, Window
from usage_limits.budget import CreditCrossing, LiveGrant
from usage_limits.web import create_app, events
from usage_limits.web import observability as obs

PROCESSES = 8
T0 = 1_700_000_000_000
PLAN = [Window(10, 3600)]
LOW_PERCENT = 20
AWS = {"region_name": "us-east-1", "aws_access_key_id": "testing",
       "aws_secret_access_key": "testing"}
AWS_ENV = {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}


def _bus(endpoint: str) -> EventBus:
    """A fresh bus on moto's server, read back through its queue."""
    return EventBus(f"credit-{uuid.uuid4().hex[:12]}", endpoint=endpoint)


def _publisher(bus: EventBus) -> events.EventPublisher:
    """A publisher to ``bus`` (a generous bound: the machine is shared)."""
    return events.EventPublisher(events.EventSettings(bus=bus.name, timeout_s=10),
                                 client=bus.events)


def _received(bus: EventBus) -> list[tuple[str, dict[str, Any]]]:
    """(detail-type, detail) of every event published since the last call."""
    got = bus.received()
    assert all(e["source"] == events.SOURCE for e in got), got
    return [(e["detail-type"], e["detail"]) for e in got]


def _budget(client: Any) -> TokenBudget:
    """The ledger under test: entitlements on, one plan ``free``, low at 20%."""
    return TokenBudget(client, PLAN, catalog={"free": PLAN}, entitlements=True,
                       credit_low_percent=LOW_PERCENT)


async def _with_quota_used(budget: TokenBudget, user: str, *grants: LiveGrant) -> None:
    """Load ``grants`` for ``user`` and use up the plan's quota (nothing drawn)."""
    assert await budget.load_entitlements(user, epoch=1, plan=None, suspended_until_ms=None,
                                          grants=list(grants))
    d = await budget.reserve(user, "fill", 10, now_ms=T0, plan_name="free")
    assert (d.status, d.drawn) == ("charged", 0)


async def test_low_then_exhausted_are_reported_once_each_and_published(
        redis_client: Any, moto_endpoint: str, uid: str) -> None:
    """A draw taking a grant to 20% reports one low crossing, the one emptying it one
    exhausted crossing; each becomes one event on the bus, with the grant's fields."""
    budget, bus = _budget(redis_client), _bus(moto_endpoint)
    publisher = _publisher(bus)
    await _with_quota_used(budget, uid, LiveGrant("promo:welcome", 10, 10, None, "promo"))
    seen: list[tuple[CreditCrossing, ...]] = []
    for i, cost in enumerate((7, 1, 1, 1)):  # the grant goes 10 -> 3 -> 2 -> 1 -> 0
        d = await budget.reserve(uid, f"r{i}", cost, now_ms=T0 + i + 1, plan_name="free")
        assert (d.status, d.drawn) == ("charged", cost)
        seen.append(d.credit_crossings)
        made = events.credit_events(uid, d.plan_name, d.credit_crossings,
                                    low_percent=LOW_PERCENT)
        assert await publisher.publish(made) is True
    assert seen == [(), (CreditCrossing("promo:welcome", "low", 2, 10, "promo"),), (),
                    (CreditCrossing("promo:welcome", "exhausted", 0, 10, "promo"),)]
    fields = {"user": uid, "plan": "free", "reference": "promo:welcome", "grant_kind": "promo",
              "tokens": 10, "low_percent": LOW_PERCENT}
    assert _received(bus) == [(events.CREDIT_LOW, {**fields, "remaining": 2}),
                              (events.CREDIT_EXHAUSTED, {**fields, "remaining": 0})]
    rejected = await budget.reserve(uid, "r-over", 1, now_ms=T0 + 9, plan_name="free")
    assert (rejected.status, rejected.credit_crossings) == ("rejected", ())


async def test_one_charge_emptying_a_grant_reports_low_and_exhausted(
        redis_client: Any, uid: str) -> None:
    """A charge from above 20% straight to 0 reports low, then exhausted, for that grant
    only; the next grant drawn by the same charge reports what it crossed."""
    budget = _budget(redis_client)
    await _with_quota_used(budget, uid, LiveGrant("first", 5, 5, T0 + 3_600_000, "paid"),
                           LiveGrant("second", 100, 100, None, "paid"))
    d = await budget.reserve(uid, "big", 9, now_ms=T0 + 1, plan_name="free")
    assert d.draws == (("first", 5), ("second", 4))
    assert d.credit_crossings == (CreditCrossing("first", "low", 0, 5, "paid"),
                                  CreditCrossing("first", "exhausted", 0, 5, "paid"))
    made = events.credit_events(uid, "free", d.credit_crossings, low_percent=LOW_PERCENT)
    assert [e.detail_type for e in made] == [events.CREDIT_LOW, events.CREDIT_EXHAUSTED]


def _process_draws(url: str, user: str, count: int, bus: str, endpoint: str,
                   start: Any, out: Any) -> None:
    """One environment in its own process: ``count`` charges of 1 token, each crossing
    published to ``bus``; puts (statuses, crossings, all published) on ``out``."""
    import redis.asyncio as aioredis

    async def run() -> tuple[list[str], list[tuple[str, str, int, int]], bool]:
        client = aioredis.Redis.from_url(url, socket_timeout=10)
        budget = _budget(client)
        publisher = events.EventPublisher(
            events.EventSettings(bus=bus, timeout_s=10),
            client=boto3.client("events", endpoint_url=endpoint, **AWS))
        await client.ping()  # connect before the race starts
        await asyncio.to_thread(start.wait)
        statuses, crossings, published = [], [], True
        for _ in range(count):
            d = await budget.reserve(user, uuid.uuid4().hex, 1, now_ms=T0 + 1,
                                     plan_name="free")
            statuses.append(d.status)
            crossings += [(c.reference, c.kind, c.remaining, c.tokens)
                          for c in d.credit_crossings]
            made = events.credit_events(user, d.plan_name, d.credit_crossings,
                                        low_percent=LOW_PERCENT)
            published = await publisher.publish(made) and published
        await client.aclose()
        return statuses, crossings, published

    out.put(asyncio.run(run()))


@pytest.mark.slow
async def test_eight_processes_drawing_one_grant_cross_low_and_exhausted_once(
        redis_server: RedisServer, standalone_client: Any, moto_endpoint: str) -> None:
    """8 processes race 120 one-token draws on a 100-token grant: exactly 100 are charged,
    and exactly one low and one exhausted crossing (and event) come out of all of them."""
    user, bus = uuid.uuid4().hex, _bus(moto_endpoint)
    await _with_quota_used(_budget(standalone_client), user,
                           LiveGrant("inv-42", 100, 100, None, "paid"))
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_process_draws,
                         args=(redis_server.url, user, 15, bus.name, moto_endpoint, start, out))
             for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    start.set()
    results = [await asyncio.to_thread(out.get, timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    statuses = [s for r in results for s in r[0]]
    crossings = sorted(c for r in results for c in r[1])
    assert statuses.count("charged") == 100 and statuses.count("rejected") == 20
    assert crossings == [("inv-42", "exhausted", 0, 100), ("inv-42", "low", 20, 100)]
    assert all(r[2] for r in results)
    got = sorted((kind, d["remaining"]) for kind, d in _received(bus))
    assert got == [(events.CREDIT_EXHAUSTED, 0), (events.CREDIT_LOW, 20)]


# --- the request path: a failed PutEvents never fails the request -------------------------


def _handler(budget_url: str) -> Any:
    """An app whose route draws credit and publishes its crossings as the guard does."""
    import redis.asyncio as aioredis

    app = create_app("credit events test")
    ledgers: dict[str, TokenBudget] = {}

    @app.post("/draw/{user}")
    async def draw(user: str) -> dict[str, int]:
        if "b" not in ledgers:  # one client per event loop (the handler's)
            ledgers["b"] = _budget(aioredis.Redis.from_url(budget_url))
        d = await ledgers["b"].reserve(user, uuid.uuid4().hex, 10, now_ms=T0 + 1,
                                       plan_name="free")
        events.publish_soon(events.credit_events(user, d.plan_name, d.credit_crossings))
        return {"crossings": len(d.credit_crossings)}

    return app


@pytest.fixture
def emf(capsys: pytest.CaptureFixture[str]) -> Any:
    """A reader of the request EMF lines written since the last read."""
    capsys.readouterr()

    def lines() -> list[dict[str, Any]]:
        out = capsys.readouterr().out
        return [json.loads(line) for line in out.splitlines() if '"_aws"' in line]

    return lines


async def _prepare(url: str, user: str, *grants: LiveGrant) -> None:
    """``_with_quota_used`` over a client of its own (for a test without an event loop)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        await _with_quota_used(_budget(client), user, *grants)
    finally:
        await client.aclose()


@pytest.mark.parametrize("where", ["no such bus", "a hung endpoint"])
def test_a_failed_put_events_never_fails_the_drawing_request(
        where: str, monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer,
        moto_endpoint: str, emf: Any) -> None:
    """PutEvents refused (the bus is missing) or never answered: the request whose draw
    crossed low and exhausted still answers 200, and both events count as EventsFailed."""
    import socket

    from mangum import Mangum

    user = uuid.uuid4().hex
    asyncio.run(_prepare(redis_server.url, user, LiveGrant("g", 10, 10, None, "paid")))
    endpoint = moto_endpoint
    hung = None
    if where == "a hung endpoint":  # the kernel accepts into the backlog; nobody answers
        hung = socket.create_server(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
    for name, value in {**AWS_ENV, "ATTO_EVENT_BUS": "no-such-bus", "ATTO_ENV": "dev",
                        "ATTO_EVENTS_TIMEOUT_S": "0.5", "REDIS_URL": redis_server.url,
                        "AWS_ENDPOINT_URL_EVENTBRIDGE": endpoint}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("POWERTOOLS_METRICS_DISABLED", raising=False)
    fresh_environment()
    events.publisher.cache_clear()
    try:
        with lambda_loop():
            res = invoke(Mangum(_handler(redis_server.url), lifespan="off"),
                         http_event("POST", f"/draw/{user}", body={}, user=user))
    finally:
        fresh_environment()
        events.publisher.cache_clear()
        if hung is not None:
            hung.close()
    assert (res.status, res.body) == (200, {"crossings": 2})
    (line,) = [line for line in emf() if obs.PROVIDER not in line]
    assert float(sum(line[obs.EVENTS_FAILED])) == 2
