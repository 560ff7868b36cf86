"""The grant-expiry mark (``store.mark_expired``, from ``EntitlementCache.forfeit_expired``)
through DynamoDB's faults: a write whose answer was lost, and writes refused.

A load or a read (``history``, GET /v1/usage) that sees a grant expired with tokens unused
records ``expired_at`` and ``forfeited`` on the grant, once, and the call that recorded it
reports it (``on_forfeit``: the web layer's ``Atto Credit Expired``). The stated guarantee
(``web.events``): one event per grant, from the call that first recorded it; at most one
when every attempt's answer is lost. Real DynamoDB semantics come from the local server
(moto behind HTTP, so botocore's own retries run), faults from ``DynamoServer.inject`` and
``tests.dynamofaults.FaultyClient``; the copy lives in the test's Redis.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis

from local.dynamodb import DynamoServer
from local.redis_servers import RedisServer
from tests.dynamo import local_dynamo
from tests.dynamofaults import FaultyClient
from usage_limits import TokenBudget, Window
from usage_limits.entitlements.cache import EntitlementCache
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore

NOW = 1_800_000_000_000
EXPIRES = NOW + 3_600_000  # the promo grant's expiry
LATER = EXPIRES + 1_000  # every call below runs past it
PLAN = [Window(limit=10, seconds=60)]


@pytest.fixture(scope="module")
def dynamo() -> Iterator[DynamoServer]:
    """The local DynamoDB server (moto over HTTP) with the entitlements table."""
    with local_dynamo("expiry") as server:
        yield server


@dataclass
class Env:
    """One user with an unused promo grant (10 tokens, expiring at ``EXPIRES``) and a paid
    one (5 tokens, no expiry), an environment's cache over ``store`` and the events it
    reported."""

    store: EntitlementStore
    cache: EntitlementCache
    budget: TokenBudget
    user: str
    published: list[tuple[str, str, int]] = field(default_factory=list)

    def environment(self, client: Any = None) -> EntitlementCache:
        """Another execution environment's cache (its own store client when given)."""
        store = self.store if client is None else EntitlementStore(self.store.settings,
                                                                   client=client)
        cache = EntitlementCache(store)
        cache.on_forfeit = self.report
        return cache

    def report(self, user: str, grants: list[Any]) -> None:
        self.published += [(user, g.reference, g.remaining) for g in grants]

    def recorded(self) -> tuple[int | None, int | None]:
        """What the record of truth holds of the promo's expiry: (expired_at, forfeited)."""
        g = self.store.grant(self.user, "promo")
        assert g is not None
        return g.expired_at_ms, g.forfeited

    async def copy(self) -> tuple[tuple[str, int], ...]:
        """The credit the user's cached copy lets them spend: (reference, remaining)."""
        usage = await self.budget.usage(self.user, now_ms=LATER)
        assert usage.loaded
        return tuple((g.reference, g.remaining) for g in usage.grants)


def _store(server: DynamoServer, attempts: int = 3, client: Any = None) -> EntitlementStore:
    return EntitlementStore(StoreSettings(table=server.table, endpoint_url=server.url,
                                          region="us-east-1", max_attempts=attempts),
                            client=client)


@pytest.fixture
async def env(dynamo: DynamoServer, redis_server: RedisServer) -> AsyncIterator[Env]:
    """A fresh user and environment (botocore's standard retries, 3 attempts)."""
    store, user = _store(dynamo), uuid.uuid4().hex
    store.create_grant(user, tokens=10, kind="promo", reference="promo",
                       expires_at_ms=EXPIRES, actor="test", reason="expiry", now_ms=NOW)
    store.create_grant(user, tokens=5, kind="paid", reference="paid", expires_at_ms=None,
                       actor="test", reason="expiry", now_ms=NOW)
    client = aioredis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=5)
    made = Env(store, EntitlementCache(store), TokenBudget(client, PLAN, entitlements=True),
               user)
    made.cache.on_forfeit = made.report
    try:
        yield made
    finally:
        dynamo.clear()
        await client.aclose()


async def test_a_lost_answer_retried_by_botocore_is_recorded_and_reported_once(
        env: Env, dynamo: DynamoServer) -> None:
    """The mark's first attempt lands and its answer is lost; botocore's retry then meets
    the condition (expired_at set). The expiry is recorded once, with its first attempt's
    values, reported once, and later reads and loads report nothing more."""
    lost = dynamo.injected.get("lost", 0)
    dynamo.inject("lost", operations=("UpdateItem",), count=1)
    ended, _ = await env.cache.history(env.user, now_ms=LATER)
    assert dynamo.injected.get("lost", 0) == lost + 1  # the mark met it
    assert [(g.reference, g.forfeited) for g in ended] == [("promo", 10)]
    assert env.recorded() == (LATER, 10)
    assert env.published == [(env.user, "promo", 10)]
    assert await env.cache.load(env.budget, env.user, now_ms=LATER + 1)
    again, _ = await env.cache.history(env.user, now_ms=LATER + 2)
    assert [(g.reference, g.expired_at_ms, g.forfeited) for g in again] == [
        ("promo", LATER, 10)]
    assert env.recorded() == (LATER, 10) and len(env.published) == 1
    assert await env.copy() == (("paid", 5),)  # the expired credit is not spendable


async def test_an_answer_lost_on_every_attempt_is_recorded_once_and_never_doubled(
        env: Env, dynamo: DynamoServer) -> None:
    """A mark that lands but whose every answer is lost (the client sees an error) does not
    fail the load: the copy holds only the live grant; the record holds the expiry once;
    the event is lost with the answer (at most one), and no later load or read, in this
    environment or another, records or reports it again."""
    faulty = FaultyClient(_store(dynamo, attempts=1).client)
    faulty.plan.arm("lost", "update_item", skip=1)  # the load's epoch bump passes
    cache = env.environment(faulty)
    assert await cache.load(env.budget, env.user, now_ms=LATER)
    assert faulty.plan.met == [("update_item", "lost")]
    assert env.recorded() == (LATER, 10)
    assert await env.copy() == (("paid", 5),)
    assert await env.cache.load(env.budget, env.user, now_ms=LATER + 1)
    ended, _ = await env.environment().history(env.user, now_ms=LATER + 2)
    assert [(g.reference, g.expired_at_ms, g.forfeited) for g in ended] == [
        ("promo", LATER, 10)]
    assert env.recorded() == (LATER, 10)
    assert env.published == []  # lost with the answers: at most once


@pytest.mark.parametrize("kind", ["throttle", "capacity", "down", "conflict"])
async def test_a_refused_mark_leaves_the_user_served_and_the_next_load_records_it(
        env: Env, dynamo: DynamoServer, kind: str) -> None:
    """A mark refused (throttled past every retry, out of capacity, the service down, or a
    cancellation) writes nothing and does not fail the load: the copy holds only the live
    grant, and GET /v1/usage's read shows the grant ended with 10 forfeited; the next load
    records the expiry and reports it, once."""
    faulty = FaultyClient(_store(dynamo, attempts=1).client)
    faulty.plan.arm(kind, "update_item", skip=1, times=2)  # the load's mark, the read's
    cache = env.environment(faulty)
    assert await cache.load(env.budget, env.user, now_ms=LATER)
    assert env.recorded() == (None, None) and env.published == []
    assert await env.copy() == (("paid", 5),)
    ended, _ = await cache.history(env.user, now_ms=LATER)
    assert faulty.plan.met == [("update_item", kind)] * 2
    assert [(g.reference, g.tokens - g.consumed) for g in ended] == [("promo", 10)]
    assert env.recorded() == (None, None) and env.published == []
    assert await env.cache.load(env.budget, env.user, now_ms=LATER + 5)
    assert env.recorded() == (LATER + 5, 10)
    assert env.published == [(env.user, "promo", 10)]
    assert await env.copy() == (("paid", 5),)


async def test_two_environments_seeing_the_expiry_record_and_report_it_once(
        env: Env) -> None:
    """Two environments that read the grant before either marked it both try: the
    condition lets one record it; the other's write is refused (ConditionalCheckFailed),
    reports nothing, and the record keeps the first one's values."""
    record = env.store.load(env.user)
    first, second = env.environment(), env.environment()
    one = await first.forfeit_expired(env.user, record, LATER)
    other = await second.forfeit_expired(env.user, record, LATER + 7)
    assert ([g.reference for g in one], other) == (["promo"], [])
    assert env.recorded() == (LATER, 10)
    assert env.published == [(env.user, "promo", 10)]
