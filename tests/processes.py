"""Many OS processes against one Redis at once: what many Lambda instances are.

A test names a module-level coroutine function ``work(target, *args, seed, start)``; each
process makes its own client from ``target`` (``client_for``), waits at the ``start``
barrier once connected, and sends back what ``work`` returned, or the text of what it
raised, so a failing process fails the test instead of leaving it waiting.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

#: ("standalone" | "cluster", [(host, port), ...]): what a process needs to connect.
Target = tuple[str, list[tuple[str, int]]]


def target_of(redis_client: Any, request: pytest.FixtureRequest) -> Target:
    """The server behind the test's ``redis_client`` fixture, as a process can reach it."""
    if isinstance(redis_client, RedisCluster):
        return ("cluster", request.getfixturevalue("redis_cluster").startup_nodes)
    return ("standalone", [("127.0.0.1", request.getfixturevalue("redis_server").port)])


def client_for(target: Target) -> Any:
    """A new async client of ``target``, made inside the process that uses it."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode

    kind, nodes = target
    if kind == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                            socket_timeout=5.0)
    return aioredis.Redis(host=nodes[0][0], port=nodes[0][1], socket_timeout=5.0)


def _worker(work: Callable[..., Awaitable[Any]], target: Target, args: tuple[Any, ...],
            seed: int, start: Any, out: Any) -> None:
    try:
        out.put((seed, asyncio.run(work(target, *args, seed=seed, start=start))))
    except BaseException as exc:  # report, so the test fails instead of waiting
        out.put((seed, repr(exc)))


def run_processes(work: Callable[..., Awaitable[Any]], target: Target, *args: Any,
                  processes: int = 8, timeout_s: float = 120.0) -> dict[int, Any]:
    """Run ``work`` in ``processes`` spawned processes at once (seeds 0..n-1).

    Returns:
        seed -> what that process's ``work`` returned.

    Raises:
        AssertionError: a process raised (its error is in the message).
    """
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(work, target, args, seed, start, out))
             for seed in range(processes)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    failures = {seed: r for seed, r in results.items() if isinstance(r, str)}
    assert not failures, failures
    return results
