"""The auditor's expiry sweep (``entitlements.expiry_sweep``): a grant that expired with
tokens unused is recorded and reported once whether or not its user comes back, once in
all when a load races it, through a lost answer, and across a run that ran out of time.

Real DynamoDB semantics from the local server (moto behind HTTP, so botocore's own
retries run; faults from ``DynamoServer.inject``); the load path's copy lives in the test's
Redis. The clock is passed in (``NOW``...), so the expiry index's hours are fixed.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis

from local.dynamodb import DynamoServer
from local.redis_servers import RedisServer
from tests.dynamo import local_dynamo
from usage_limits import TokenBudget, Window
from usage_limits.entitlements.auditor import Auditor, AuditSettings
from usage_limits.entitlements.cache import EntitlementCache
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.expiry_sweep import OVERLAP_MS, ExpirySweep, SweepResult
from usage_limits.entitlements.models import iso
from usage_limits.entitlements.store import EntitlementStore, expiry_hour
from usage_limits.entitlements.usage_store import UsageSettings, UsageStore

NOW = 1_800_000_000_000  # 2027-01-15T08:00:00Z: an hour's start
EXPIRES = NOW + 3_600_000 + 600_000  # the promo grants' expiry: 10 minutes into the next hour
LATER = EXPIRES + 1_000  # the runs below run past it
PLAN = [Window(limit=10, seconds=60)]


@pytest.fixture(scope="module")
def dynamo() -> Iterator[DynamoServer]:
    """The local DynamoDB server (moto over HTTP) with the entitlements and usage tables."""
    with local_dynamo("sweep") as server:
        yield server


@dataclass
class Env:
    """A store over the local server, a sweep and a load-path cache that both report into
    ``published``, and a Redis-backed ledger for the load path."""

    store: EntitlementStore
    sweep: ExpirySweep
    cache: EntitlementCache
    budget: TokenBudget
    published: list[tuple[str, str, int]] = field(default_factory=list)

    def report(self, user: str, grants: list[Any]) -> None:
        self.published += [(user, g.reference, g.remaining) for g in grants]

    def promo(self, user: str, *, tokens: int = 10, expires_at_ms: int = EXPIRES,
              reference: str = "promo") -> str:
        """Give ``user`` an unused promo grant expiring at ``expires_at_ms``."""
        self.store.create_grant(user, tokens=tokens, kind="promo", reference=reference,
                                expires_at_ms=expires_at_ms, actor="test", reason="sweep",
                                now_ms=NOW)
        return user

    def recorded(self, user: str, reference: str = "promo") -> tuple[int | None, int | None]:
        """What the record of truth holds of a grant's expiry: (expired_at, forfeited)."""
        g = self.store.grant(user, reference)
        assert g is not None
        return g.expired_at_ms, g.forfeited


@pytest.fixture
async def env(dynamo: DynamoServer, redis_server: RedisServer) -> AsyncIterator[Env]:
    """A fresh table, with the sweep's mark at ``NOW`` (a sweep ran then)."""
    store = EntitlementStore(StoreSettings(table=dynamo.table, endpoint_url=dynamo.url,
                                           region="us-east-1"))
    client = aioredis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=5)
    made = Env(store, ExpirySweep(store), EntitlementCache(store),
               TokenBudget(client, PLAN, entitlements=True))
    made.sweep.on_forfeit = made.cache.on_forfeit = made.report
    made.sweep.set_mark(NOW)
    try:
        yield made
    finally:
        dynamo.clear()
        wipe(store)
        await client.aclose()


def wipe(store: EntitlementStore) -> None:
    """Delete every item of the table: each test sweeps an index of its own grants only."""
    s = store
    for page in s.client.get_paginator("scan").paginate(TableName=s.table,
                                                        ProjectionExpression="pk, sk"):
        for item in page.get("Items", []):
            s.client.delete_item(TableName=s.table, Key=item)


def user() -> str:
    return uuid.uuid4().hex


async def test_a_user_who_never_returns_has_the_expiry_recorded_and_reported_once(
        env: Env) -> None:
    """A grant expiring while its user is away is recorded (expired_at, forfeited) and
    reported by the next sweep, with its user, reference and forfeited tokens; a second
    sweep reports nothing, and neither does the user's later load."""
    alice = env.promo(user())
    done = await env.sweep.run(now_ms=LATER)
    assert (done.swept, done.checked, done.complete) == (1, 1, True)
    assert done.from_ms == NOW - OVERLAP_MS and done.until_ms == LATER
    assert env.recorded(alice) == (LATER, 10)
    assert env.published == [(alice, "promo", 10)]
    again = await env.sweep.run(now_ms=LATER + 60_000)
    assert (again.swept, again.from_ms) == (0, LATER - OVERLAP_MS)
    assert await env.cache.load(env.budget, alice, now_ms=LATER + 120_000)
    assert env.recorded(alice) == (LATER, 10) and len(env.published) == 1


async def test_a_scheduled_audit_run_sweeps_first_and_counts_it_in_its_report(
        env: Env, dynamo: DynamoServer) -> None:
    """A scheduled run (the active users, moving the mark) sweeps and reports the count in
    its report and JSON; a run over given users or one that leaves the mark does not."""
    usage = UsageStore(UsageSettings(table=dynamo.usage_table, endpoint_url=dynamo.url,
                                     region="us-east-1"))
    bob, carol = env.promo(user()), env.promo(user())
    auditor = Auditor(env.store, None, usage, settings=AuditSettings(recheck_s=0))
    auditor.on_forfeit = env.report
    for kwargs in ({"users": [bob]}, {"move_mark": False}):
        report = await auditor.run(now_ms=LATER, **kwargs)
        assert report.grants_expired_swept == 0 and report.expiry_swept_until_ms is None
    assert env.published == []
    report = await auditor.run(now_ms=LATER)
    assert report.grants_expired_swept == 2
    assert report.to_json()["grants_expired_swept"] == 2
    assert report.to_json()["expiry_swept_until"] == "2027-01-15T09:10:01.000Z"
    assert sorted(env.published) == sorted([(bob, "promo", 10), (carol, "promo", 10)])


async def test_a_load_racing_the_sweep_records_and_reports_once_in_all(env: Env) -> None:
    """The user's load (GET /v1/usage's read) and the sweep seeing the same expired grant at
    once: the expiry is recorded once and reported once between them."""
    users = [env.promo(user()) for _ in range(4)]
    swept, *_ = await asyncio.gather(env.sweep.run(now_ms=LATER),
                                     *(env.cache.history(u, now_ms=LATER) for u in users))
    assert isinstance(swept, SweepResult) and swept.complete and swept.checked == 4
    assert sorted(env.published) == sorted((u, "promo", 10) for u in users)
    assert all(env.recorded(u) == (LATER, 10) for u in users)


async def test_a_load_between_the_sweeps_read_and_its_write_wins_alone(
        env: Env, patch: pytest.MonkeyPatch) -> None:
    """The user's read records the expiry after the sweep read the grant and before the
    sweep writes: the sweep's write fails its condition and reports nothing; and the other
    way round, a sweep between a load's read and its write leaves the load nothing."""
    heidi, ivan = env.promo(user()), env.promo(user())
    read = env.store.grant

    def grant_then_load(user_id: str, reference: str) -> Any:
        found = read(user_id, reference)
        if user_id == heidi:  # the load lands in between (on a loop of its own)
            asyncio.run(env.cache.history(heidi, now_ms=LATER + 5))
        return found

    load = env.store.load

    def load_then_sweep(user_id: str) -> Any:
        found = load(user_id)
        if user_id == ivan:
            asyncio.run(env.sweep.run(now_ms=LATER + 7))
        return found

    patch.setattr(env.store, "grant", grant_then_load)
    done = await env.sweep.run(now_ms=LATER)
    patch.setattr(env.store, "grant", read)
    assert env.recorded(heidi) == (LATER + 5, 10) and done.swept == 1  # ivan's only
    assert env.recorded(ivan) == (LATER, 10)
    env.promo(ivan, reference="second")
    patch.setattr(env.store, "load", load_then_sweep)
    await env.cache.history(ivan, now_ms=LATER + 10)
    patch.setattr(env.store, "load", load)
    assert env.recorded(ivan, "second") == (LATER + 7, 10)
    assert sorted(env.published) == sorted([(heidi, "promo", 10), (ivan, "promo", 10),
                                            (ivan, "second", 10)])


async def test_voided_spent_and_live_grants_are_left_alone(env: Env) -> None:
    """A voided grant, one spent to the last token and one not expired yet are neither
    recorded nor reported, though the index lists them all."""
    dave = user()
    env.promo(dave, reference="voided")
    env.store.void_grant(dave, "voided", actor="test", reason="sweep", now_ms=NOW + 1)
    env.promo(dave, reference="spent")
    s = env.store
    s._call(s.client.update_item, TableName=s.table,  # planted: every token consumed
            Key=s._ser({"pk": f"U#{dave}", "sk": "E#G#spent"}),
            UpdateExpression="SET #c = :n", ExpressionAttributeNames={"#c": "consumed"},
            ExpressionAttributeValues=s._ser({":n": 10}))
    env.promo(dave, reference="live", expires_at_ms=LATER + 60_000)  # same hour, later
    done = await env.sweep.run(now_ms=LATER)
    assert (done.swept, done.checked, done.complete) == (0, 2, True)
    assert [env.recorded(dave, r) for r in ("voided", "spent", "live")] == [(None, None)] * 3
    assert env.published == []
    later = await env.sweep.run(now_ms=LATER + 120_000)
    assert later.swept == 1 and env.published == [(dave, "live", 10)]


async def test_a_lost_answer_on_the_mark_is_recorded_and_reported_once(
        env: Env, dynamo: DynamoServer) -> None:
    """The sweep's mark lands and its answer is lost; botocore's re-send meets the
    condition, and the sweep still knows the write was its own (``expired_by``): the
    expiry is recorded once with its values and reported once."""
    erin = env.promo(user())
    lost = dynamo.injected.get("lost", 0)
    dynamo.inject("lost", operations=("UpdateItem",), count=1)
    done = await env.sweep.run(now_ms=LATER)
    assert dynamo.injected.get("lost", 0) == lost + 1
    assert done.swept == 1 and env.recorded(erin) == (LATER, 10)
    assert env.published == [(erin, "promo", 10)]
    assert (await env.sweep.run(now_ms=LATER + 1)).swept == 0 and len(env.published) == 1


async def test_a_sweep_out_of_time_leaves_its_mark_and_the_next_run_continues(
        env: Env) -> None:
    """A sweep that runs out of time stops before a grant and leaves its mark at that
    grant's expiry; the next run starts there (less the overlap) and sweeps the rest, each
    grant reported once, across two hours of the index."""
    first = [env.promo(user(), expires_at_ms=NOW + 60_000 + i) for i in range(3)]  # hour 1
    second = [env.promo(user(), expires_at_ms=EXPIRES + i) for i in range(2)]  # hour 2
    assert expiry_hour(NOW + 60_000) != expiry_hour(EXPIRES)
    budget = iter(range(4, -1, -1))  # two pages (hours 0 and 1), two grants; then no time

    def time_left_s() -> float:
        return float(next(budget, -1))

    short = await env.sweep.run(now_ms=LATER, time_left_s=time_left_s)
    assert (short.swept, short.complete, short.until_ms) == (2, False, NOW + 60_002)
    assert env.sweep.last_mark() == NOW + 60_002
    rest = await env.sweep.run(now_ms=LATER + 1)
    assert rest.from_ms == NOW + 60_002 - OVERLAP_MS and rest.complete
    assert rest.swept == 3 and env.sweep.last_mark() == LATER + 1
    assert sorted(env.published) == sorted((u, "promo", 10) for u in first + second)


async def test_a_failing_store_stops_the_sweep_and_the_next_run_retries(
        env: Env, dynamo: DynamoServer) -> None:
    """DynamoDB refusing the mark's or the index's read stops the sweep without failing it,
    the mark stays, and the next run sweeps the grant."""
    frank = env.promo(user())
    dynamo.inject("down", operations=("GetItem",), count=10)  # more than botocore's retries
    done = await env.sweep.run(now_ms=LATER)
    assert (done.swept, done.until_ms, done.complete) == (0, None, False)
    dynamo.clear()
    dynamo.inject("down", operations=("Query",), count=10)
    done = await env.sweep.run(now_ms=LATER)
    assert (done.swept, done.complete) == (0, False)
    assert env.sweep.last_mark() == NOW
    dynamo.clear()
    again = await env.sweep.run(now_ms=LATER)
    assert again.swept == 1 and env.published == [(frank, "promo", 10)]


def test_the_auditor_function_publishes_the_same_event_as_the_load_path(
        dynamo: DynamoServer, patch: pytest.MonkeyPatch) -> None:
    """The auditor function hands each swept grant to EventBridge as ``Atto Credit
    Expired`` on the usage bus, with the load path's detail fields, ten to a call."""
    from usage_limits.entitlements.store import set_store
    from usage_limits.web import events

    store = EntitlementStore(StoreSettings(table=dynamo.table, endpoint_url=dynamo.url,
                                           region="us-east-1"))
    grace, now = user(), int(time.time() * 1000)  # the function runs on the real clock
    store.create_grant(grace, tokens=7, kind="paid", reference="inv_1",
                       expires_at_ms=now - 60_000, actor="test", reason="sweep",
                       now_ms=now - 7_200_000)
    others = [user() for _ in range(10)]
    for other in others:
        store.create_grant(other, tokens=3, kind="promo", reference="p",
                           expires_at_ms=now - 120_000, actor="test", reason="sweep",
                           now_ms=now - 7_200_000)
    ExpirySweep(store).set_mark(now - 3_600_000)
    sent: list[dict[str, Any]] = []
    calls: list[int] = []

    class Events:
        def put_events(self, Entries: list[dict[str, Any]]) -> dict[str, Any]:  # noqa: N803
            sent.extend(Entries)
            calls.append(len(Entries))
            return {"FailedEntryCount": 0, "Entries": [{} for _ in Entries]}

    publisher = events.EventPublisher(events.EventSettings(bus="usage-bus"), client=Events())
    auditor_fn = importlib.import_module("functions.auditor.app")
    patch.setattr(events, "publisher", lambda: publisher)
    patch.setattr(auditor_fn.runtime, "get_redis", lambda: None)
    patch.setattr(auditor_fn, "usage_store", lambda: UsageStore(UsageSettings(
        table=dynamo.usage_table, endpoint_url=dynamo.url, region="us-east-1")))
    patch.setenv("ATTO_AUDIT_RECHECK_S", "0")
    set_store(store)
    try:
        report = auditor_fn.handler({}, None)
    finally:
        set_store(None)
        wipe(store)
    assert report["grants_expired_swept"] == 11 and sorted(calls) == [1, 10]
    assert {(e["Source"], e["DetailType"], e["EventBusName"]) for e in sent} == {
        ("atto.cloud", "Atto Credit Expired", "usage-bus")}
    details = [json.loads(e["Detail"]) for e in sent]
    assert sorted(d["user"] for d in details if d["reference"] == "p") == sorted(others)
    assert [d for d in details if d["user"] == grace] == [{
        "user": grace, "reference": "inv_1", "grant_kind": "paid", "forfeited": 7,
        "tokens": 7, "expires_at": iso(now - 60_000)}]


@pytest.fixture
def patch() -> Iterator[pytest.MonkeyPatch]:
    """A MonkeyPatch of the test's own."""
    with pytest.MonkeyPatch.context() as mp:
        yield mp
