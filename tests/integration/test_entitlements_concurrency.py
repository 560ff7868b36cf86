"""Many OS processes drawing from one small grant through the durable path never overdraw
it, in Redis or in DynamoDB (a shared local DynamoDB server, real Redis on both
topologies)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from local.credit_load import PLANS, Target, ledger, one_request, redis_client, store_for
from local.dynamodb import DynamoServer
from usage_limits.entitlements.store import EntitlementStore

PROCESSES = 8
ATTEMPTS = 12
GRANT = 30
COST = 2

@pytest.fixture(scope="module")
def dynamo(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[DynamoServer]:
    """A local DynamoDB server every process reaches over HTTP, with the table."""
    monkeypatch_module.setenv("AWS_ACCESS_KEY_ID", "local")
    monkeypatch_module.setenv("AWS_SECRET_ACCESS_KEY", "local")
    monkeypatch_module.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with DynamoServer(table="entitlements-concurrency") as server:
        yield server


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp_:
        yield mp_


async def _draw(target: Target, url: str, table: str, user: str, worker: int,
                start: Any) -> dict[str, int]:
    """Reserve COST tokens ATTEMPTS times through the durable path, as the guard does
    (``local.credit_load.one_request``): every fourth request fails (refund), every fourth
    is settled to 1 token, the rest keep their cost.

    Returns:
        What this worker saw: credit spent by served requests (drawn less what came back),
        charges served, refused, and answered 503 (the draw could not be recorded, or the
        copy could not be loaded).
    """
    from usage_limits.entitlements.cache import EntitlementCache

    client = redis_client(target)
    budget, cache = ledger(client), EntitlementCache(store_for(url, table))
    seen = {"spent": 0, "rejected": 0, "unavailable": 0, "served": 0}
    try:
        await client.ping()
        start.wait()
        for i in range(ATTEMPTS):
            o = await one_request(cache, budget, user, f"w{worker}-{i}", COST,
                                  {1: 0, 2: 1}.get(i % 4))
            seen[o.status] += 1
            seen["spent"] += o.spent
    finally:
        await client.aclose()
    return seen


async def _operator_changes(target: Target, store: EntitlementStore, user: str,
                            done: Any) -> int:
    """Move the user between two plans of the same windows and flush the cache once, until
    the workers are done: every change reloads the user's copy mid-run."""
    from usage_limits.entitlements.cache import EntitlementCache

    client = redis_client(target)
    budget, cache = ledger(client), EntitlementCache(store)
    changes = 0
    try:
        while not done.ready():
            await asyncio.sleep(0.2)
            plan = PLANS[changes % 2]
            await asyncio.to_thread(store.set_override, user, plan, actor="test",
                                    reason="mid-run")
            await cache.refresh(budget, user)
            changes += 1
            if changes == 3:
                await client.flushall()
    finally:
        await client.aclose()
    return changes


def _worker(args: tuple[Any, ...]) -> dict[str, int]:
    return asyncio.run(_draw(*args))


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def target(request: pytest.FixtureRequest) -> Target:
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return "cluster", list(cluster.startup_nodes)
    server = request.getfixturevalue("redis_server")
    return "standalone", [("127.0.0.1", server.port)]


def test_eight_processes_keep_credit_exact_through_changes_and_a_flush(
        target: Target, dynamo: DynamoServer) -> None:
    """8 processes charging one user with a 30-token grant (refunds and settles mixed in)
    while operator changes reload the copy and one FLUSHALL drops it: DynamoDB's consumed
    equals the credit the served requests spent, exactly, equals its charge records, never
    exceeds the grant, and the user's copy shows the same."""
    user = "conc-" + uuid.uuid4().hex[:8]
    store = store_for(dynamo.url, dynamo.table)
    store.create_grant(user, tokens=GRANT, kind="paid", reference="small",
                       expires_at_ms=None, actor="test", reason="concurrency")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        start = manager.Barrier(PROCESSES)
        with ctx.Pool(PROCESSES) as pool:
            pending = pool.map_async(_worker, [(target, dynamo.url, dynamo.table, user, w,
                                                start) for w in range(PROCESSES)])
            changes = asyncio.run(_operator_changes(target, store, user, pending))
            results = pending.get()
    print(f"operator changes {changes}; per worker {results}")
    [grant] = store.load(user).grants
    spent = sum(r["spent"] for r in results)
    held = sum(n for record in store.charge_records(user)
               for n in record.consumed.values())
    assert grant.consumed == spent == held
    assert 0 <= grant.consumed <= GRANT
    assert changes >= 3  # the flush and the changes landed while requests ran
    charged = sum(r["served"] for r in results)
    assert charged * COST >= GRANT  # the grant was drawn to the end: the run is not vacuous
    assert sum(r["rejected"] for r in results) > 0

    async def cached() -> int:
        from usage_limits.entitlements.cache import EntitlementCache

        client = redis_client(target)
        try:
            report = await EntitlementCache(store).usage(ledger(client), user,
                                                         plan_name=PLANS[0])
            return sum(g.remaining for g in report.grants)
        finally:
            await client.aclose()

    assert asyncio.run(cached()) == GRANT - grant.consumed
