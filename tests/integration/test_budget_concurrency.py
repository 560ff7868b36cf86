"""Many OS processes reserving for one user never get more than the plan allows."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from usage_limits import TokenBudget, Window

PLAN = [(200, 3600.0), (300, 86_400.0)]  # (limit, seconds): the 200-token window binds
PROCESSES = 8
MAX_COST = 10


def _client(target: tuple[str, list[tuple[str, int]]]) -> Any:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode

    kind, nodes = target
    if kind == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                            socket_timeout=5.0)
    return aioredis.Redis(host=nodes[0][0], port=nodes[0][1], socket_timeout=5.0)


async def _reserve_until_full(target: tuple[str, list[tuple[str, int]]], user: str, seed: int,
                              start: Any) -> list[tuple[str, int]]:
    """Reserve random costs until the budget has no token left; return what was admitted."""
    client = _client(target)
    budget = TokenBudget(client, [Window(limit, seconds) for limit, seconds in PLAN])
    rng = random.Random(seed)
    admitted = []
    try:
        await client.ping()
        start.wait()  # every process connected: start together
        for i in range(400):
            rid, cost = f"p{seed}-{i}", rng.randint(1, MAX_COST)
            d = await budget.reserve(user, rid, cost)
            if d.allowed:
                admitted.append((rid, cost))
            elif d.remaining == 0:
                break
    finally:
        await client.aclose()
    return admitted


def _worker(target: tuple[str, list[tuple[str, int]]], user: str, seed: int, start: Any,
            out: Any) -> None:
    try:
        out.put((seed, asyncio.run(_reserve_until_full(target, user, seed, start))))
    except BaseException as exc:  # report, so the test fails instead of waiting
        out.put((seed, repr(exc)))


@pytest.mark.slow
async def test_processes_never_overspend_a_shared_budget(redis_client, request, uid) -> None:  # type: ignore[no-untyped-def]
    """Eight processes with their own clients fill one user's budget exactly, never beyond it."""
    if isinstance(redis_client, RedisCluster):
        target = ("cluster", request.getfixturevalue("redis_cluster").startup_nodes)
    else:
        target = ("standalone", [("127.0.0.1", request.getfixturevalue("redis_server").port)])
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(target, uid, seed, start, out))
             for seed in range(PROCESSES)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    failures = {seed: r for seed, r in results.items() if isinstance(r, str)}
    assert not failures
    admitted = [item for r in results.values() for item in r]
    total = sum(cost for _, cost in admitted)
    limit = min(limit for limit, _ in PLAN)
    assert limit - MAX_COST < total <= limit
    assert sum(1 for r in results.values() if r) > 1  # the processes really interleaved

    budget = TokenBudget(redis_client, [Window(limit, seconds) for limit, seconds in PLAN])
    usage = await budget.usage(uid, events=1000)
    assert [w.used for w in usage.windows] == [total, total]
    assert sorted((e.request_id, e.cost) for e in usage.events) == sorted(admitted)
