"""Eight OS processes drawing from one user's small grant never overdraw it."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.processes import Target, client_for, run_processes, target_of
from usage_limits import TokenBudget, Window
from usage_limits.budget import LiveGrant

#: (limit, seconds): a wide burst window and a 20-token quota that a first charge fills.
PLAN = [(1000, 600.0), (20, 3600.0)]
PROCESSES = 8
MAX_COST = 5
GRANT = 60


def _budget(client: Any) -> TokenBudget:
    return TokenBudget(client, [Window(limit, seconds) for limit, seconds in PLAN],
                       entitlements=True)


async def _draw_until_empty(target: Target, user: str, *, seed: int,
                            start: Any) -> list[tuple[str, int, int]]:
    """Reserve random costs until the grant has no credit left; (id, cost, drawn) admitted."""
    client = client_for(target)
    budget = _budget(client)
    rng = random.Random(seed)
    admitted = []
    try:
        await client.ping()
        start.wait()  # every process connected: start together
        for i in range(200):
            rid, cost = f"p{seed}-{i}", rng.randint(1, MAX_COST)
            d = await budget.reserve(user, rid, cost)
            if d.allowed:
                admitted.append((rid, cost, d.drawn))
            elif d.credit == 0:
                break
    finally:
        await client.aclose()
    return admitted


@pytest.mark.slow
async def test_processes_never_overdraw_a_shared_grant(redis_client, request, uid) -> None:  # type: ignore[no-untyped-def]
    """Eight processes draw exactly a 60-token grant's credit, never more."""
    target = target_of(redis_client, request)
    budget = _budget(redis_client)
    assert await budget.load_entitlements(uid, epoch=1, plan=None, suspended_until_ms=None,
                                          grants=[LiveGrant("small", GRANT, GRANT, None, "paid")])
    assert (await budget.reserve(uid, "fill", 20)).drawn == 0  # the quota is now full
    results = run_processes(_draw_until_empty, target, uid, processes=PROCESSES)
    admitted = [item for r in results.values() for item in r]
    assert all(cost == drawn for _, cost, drawn in admitted)
    drawn = sum(n for _, _, n in admitted)
    usage = await budget.usage(uid, events=1000)
    left = sum(g.remaining for g in usage.grants)
    assert drawn + left == GRANT and GRANT - MAX_COST < drawn <= GRANT
    assert sum(1 for r in results.values() if r) > 1  # the processes really interleaved
    recorded = {e.request_id: e.draws for e in usage.events}
    assert all(recorded[rid] == (("small", n),) for rid, _, n in admitted)
    assert [w.used for w in usage.windows] == [20 + drawn, 20]
