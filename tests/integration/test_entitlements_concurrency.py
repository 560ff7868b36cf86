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

from local.dynamodb import DynamoServer
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore

PROCESSES = 8
ATTEMPTS = 12
GRANT = 30
#: (limit, seconds): a quota of 1 token, so nearly every charge draws from the grant
PLAN = [(1000, 3600.0), (1, 30 * 86400.0)]


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


def _store(url: str, table: str) -> EntitlementStore:
    return EntitlementStore(StoreSettings(table=table, endpoint_url=url, region="us-east-1",
                                          read_timeout_s=10.0))


async def _draw(target: tuple[str, list[tuple[str, int]]], url: str, table: str, user: str,
                worker: int, start: Any) -> dict[str, int]:
    """Reserve 1 token ATTEMPTS times through the durable path; refund every third charge.

    Returns:
        What this worker saw: tokens drawn and recorded, charges made, charges refused,
        draws that could not be recorded.
    """
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    from usage_limits.budget import TokenBudget, Window
    from usage_limits.entitlements.cache import EntitlementCache

    kind, nodes = target
    client: Any = (RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                                socket_timeout=5.0) if kind == "cluster"
                   else aioredis.Redis(host=nodes[0][0], port=nodes[0][1], socket_timeout=5.0))
    windows = [Window(limit, seconds) for limit, seconds in PLAN]
    budget = TokenBudget(client, windows, catalog={"tiny": windows}, entitlements=True)
    store = _store(url, table)
    cache = EntitlementCache(store)
    seen = {"drawn": 0, "rejected": 0, "unrecorded": 0, "charged": 0}
    try:
        await client.ping()
        start.wait()
        for i in range(ATTEMPTS):
            rid, nonce = f"w{worker}-{i}", uuid.uuid4().hex
            r = await cache.reserve(budget, user, rid, 1, nonce=nonce, plan_name="tiny")
            if r.status != "charged":
                seen["rejected"] += 1
                continue
            seen["charged"] += 1
            recorded = r.drawn == 0 or await cache.commit_draw(user, rid, nonce, r)
            if not recorded:  # what the guard does: refund, answer 503
                seen["unrecorded"] += 1
                lowered = await budget.lower(user, rid, 0, nonce=nonce)
                await cache.give_back(budget, user, rid, nonce, 0, lowered, recorded=False)
                continue
            seen["drawn"] += r.drawn
            if i % 3 == 2:
                lowered = await budget.lower(user, rid, 0, nonce=nonce)
                await cache.give_back(budget, user, rid, nonce, 0, lowered,
                                      recorded=r.drawn > 0)
    finally:
        await client.aclose()
    return seen


def _worker(args: tuple[Any, ...]) -> dict[str, int]:
    return asyncio.run(_draw(*args))


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def target(request: pytest.FixtureRequest) -> tuple[str, list[tuple[str, int]]]:
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return "cluster", list(cluster.startup_nodes)
    server = request.getfixturevalue("redis_server")
    return "standalone", [("127.0.0.1", server.port)]


def test_eight_processes_never_overdraw_one_grant(
        target: tuple[str, list[tuple[str, int]]], dynamo: DynamoServer) -> None:
    """8 processes charging one user with a 30-token grant (refunding every third charge):
    DynamoDB records exactly the draws the workers saw recorded, its consumption equals
    those draws minus the credit given back, never exceeds the grant, and the cache's
    remaining credit agrees with it."""
    user = "conc-" + uuid.uuid4().hex[:8]
    store = _store(dynamo.url, dynamo.table)
    store.create_grant(user, tokens=GRANT, kind="paid", reference="small",
                       expires_at_ms=None, actor="test", reason="concurrency")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        start = manager.Barrier(PROCESSES)
        with ctx.Pool(PROCESSES) as pool:
            results = pool.map(_worker, [(target, dynamo.url, dynamo.table, user, w, start)
                                         for w in range(PROCESSES)])
    records = store.credit_records(user)

    def total(op: str) -> int:
        return sum(int(pair.rpartition("=")[2]) for r in records if r["op"] == op
                   for pair in r["draws"].split())

    assert total("draw") == sum(r["drawn"] for r in results)
    [grant] = store.load(user).grants
    assert grant.consumed == total("draw") - total("return")
    assert total("return") > 0
    assert 0 <= grant.consumed <= GRANT
    charged = sum(r["charged"] - r["unrecorded"] for r in results)
    assert charged >= GRANT  # the grant was drawn to the end: the run is not vacuous
    assert sum(r["rejected"] for r in results) > 0

    async def cached() -> int:
        import redis.asyncio as aioredis
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        from usage_limits.budget import TokenBudget, Window
        from usage_limits.entitlements.cache import EntitlementCache

        kind, nodes = target
        client: Any = (RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes])
                       if kind == "cluster" else aioredis.Redis(host=nodes[0][0],
                                                                port=nodes[0][1]))
        windows = [Window(limit, seconds) for limit, seconds in PLAN]
        budget = TokenBudget(client, windows, catalog={"tiny": windows}, entitlements=True)
        try:
            report = await EntitlementCache(store).usage(budget, user, plan_name="tiny")
            return sum(g.remaining for g in report.grants)
        finally:
            await client.aclose()

    assert asyncio.run(cached()) == GRANT - grant.consumed
