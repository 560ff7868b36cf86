"""The ledger's running totals against a plain Python model, and its cost with many events."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from usage_limits import TokenBudget, Window
from usage_limits._scripts import script
from usage_limits.keys import user_keys

T0 = 1_700_000_000_000


@dataclass
class Model:
    """What the ledger should answer, computed the slow obvious way from every live event."""

    plan: list[Window]
    clk: int = 0
    events: dict[str, tuple[int, int, str]] = field(default_factory=dict)  # id -> (at, cost, route)

    def tick(self, now_ms: int) -> int:
        """Clamp the clock and forget events older than the longest window (as the ledger does)."""
        self.clk = max(self.clk, now_ms)
        cut = self.clk - max(w.ms for w in self.plan)
        self.events = {k: v for k, v in self.events.items() if v[0] > cut}
        return self.clk

    def inside(self, w: Window) -> list[tuple[int, int]]:
        return sorted((at, cost) for at, cost, _ in self.events.values() if at > self.clk - w.ms)

    def used(self, w: Window) -> int:
        return sum(cost for _, cost in self.inside(w))

    def resets_at(self, w: Window) -> int:
        inside = self.inside(w)
        return inside[0][0] + w.ms if inside else self.clk

    def wait_ms(self, w: Window, cost: int) -> int:
        need, freed = self.used(w) + cost - w.limit, 0
        for at, c in self.inside(w):
            freed += c
            if freed >= need:
                return at + w.ms - self.clk
        raise AssertionError("a cost within the limit always fits eventually")

    def reserve(self, rid: str, cost: int, route: str, now_ms: int) -> tuple[bool, bool, int]:
        self.tick(now_ms)
        if rid in self.events:
            return True, True, 0
        waits = [self.wait_ms(w, cost) for w in self.plan if self.used(w) + cost > w.limit]
        if waits:
            return False, False, max(waits)
        self.events[rid] = (self.clk, cost, route)
        return True, False, 0

    def settle(self, rid: str, new_cost: int) -> bool:
        if rid not in self.events or (new_cost >= self.events[rid][1]):
            return False
        at, _, route = self.events.pop(rid)
        if new_cost:
            self.events[rid] = (at, new_cost, route)
        return True


async def check_usage(budget: TokenBudget, model: Model, user: str, now_ms: int) -> None:
    usage = await budget.usage(user, now_ms=now_ms, events=1000)
    model.tick(now_ms)
    assert usage.now_ms == model.clk
    assert [(w.used, w.resets_at_ms) for w in usage.windows] == [
        (model.used(w), model.resets_at(w)) for w in model.plan]
    expected = sorted(model.events.items(), key=lambda kv: (kv[1][0], kv[0]), reverse=True)
    assert [(e.request_id, e.at_ms, e.cost, e.route) for e in usage.events] == [
        (rid, at, cost, route) for rid, (at, cost, route) in expected]


@pytest.mark.parametrize("seed", [1, 2])
async def test_totals_match_a_model_under_random_operations(redis_client, uid, seed) -> None:  # type: ignore[no-untyped-def]
    """After any mix of reserve, refund, settle and clock moves, totals equal the live events."""
    rng = random.Random(seed)
    plan = [Window(limit=20, seconds=0.1), Window(limit=45, seconds=0.4)]
    budget = TokenBudget(redis_client, plan)
    model = Model(plan)
    now, ids = T0, []
    for step in range(300):
        op = rng.random()
        live = sorted(model.events)
        known = (rng.choice(live) if live and rng.random() < 0.7
                 else rng.choice(ids) if ids else "none")
        if op < 0.45:
            rid = known if rng.random() < 0.15 else f"r{step}"
            ids.append(rid)
            cost, route = rng.randint(1, 8), rng.choice(["", "/v1/structured", "GET /v1/salary"])
            d = await budget.reserve(uid, rid, cost, route=route, now_ms=now)
            allowed, duplicate, wait = model.reserve(rid, cost, route, now)
            assert (d.allowed, d.duplicate, round(d.retry_after_s * 1000)) == (
                allowed, duplicate, wait), step
            assert [w.used for w in d.windows] == [model.used(w) for w in plan], step
        elif op < 0.6:
            assert await budget.refund(uid, known) == model.settle(known, 0), step
        elif op < 0.75:
            new_cost = rng.randint(0, 8)
            assert await budget.settle(uid, known, new_cost) == model.settle(known, new_cost)
        elif op < 0.93:
            now += rng.randint(0, 80)
        elif op < 0.95:  # a pause longer than some or all windows
            now += rng.randint(100, 600)
        else:  # a caller whose clock lags behind: the ledger keeps its own newest time
            await check_usage(budget, model, uid, now - rng.randint(1, 300))
        await check_usage(budget, model, uid, now)


async def fill(client, budget: TokenBudget, user: str, n: int, start_ms: int, step_ms: int) -> None:  # type: ignore[no-untyped-def]
    """Charge n events of cost 1, step_ms apart, through the real script in one pipeline."""
    reserve = script("budget_reserve")
    calls = [budget._reserve_call(user, f"{i:016d}", 1, "/v1/structured", budget.windows,
                                  start_ms + i * step_ms, "00000000") for i in range(n)]
    await reserve(client, *calls[0])  # loads the script
    pipe = client.pipeline(transaction=False)
    for keys, args in calls[1:]:
        pipe.evalsha(reserve.sha, len(keys), *keys, *args)
    replies = await pipe.execute()
    assert all(r[0] == 1 for r in replies)


async def commands_of_one_call(client, call) -> int:  # type: ignore[no-untyped-def]
    """How many Redis commands one ledger call ran inside its script (from INFO commandstats)."""
    await client.config_resetstat()
    await call
    stats = await client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items()
               if k not in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_config|resetstat"))


async def test_calls_stay_small_with_twenty_thousand_events(standalone_client, uid) -> None:  # type: ignore[no-untyped-def]
    """With 20k events in the window, reserve and its retry walk read only a few elements."""
    n, step = 20_000, 1_000
    budget = TokenBudget(standalone_client, [Window(limit=n, seconds=86_400)])
    await fill(standalone_client, budget, uid, n, T0, step)
    now = T0 + n * step
    # full window: a cost of 8 must wait for the 8 oldest charges (1 token each) to leave
    work = await commands_of_one_call(standalone_client, budget.reserve(uid, "x", 8, now_ms=now))
    d = await budget.reserve(uid, "x", 8, now_ms=now)
    assert not d.allowed and d.windows[0].used == n
    assert d.retry_after_s * 1000 == T0 + 7 * step + 86_400_000 - now
    assert work <= 16  # HGETALL, ZCOUNTs, one walk batch, ZSCORE, HSET, PEXPIREs: no scan
    await budget.refund(uid, "0000000000000000")
    work = await commands_of_one_call(standalone_client, budget.reserve(uid, "y", 1, now_ms=now))
    assert work <= 16
    assert (await budget.usage(uid, now_ms=now, events=0)).windows[0].used == n


async def test_many_expired_events_are_subtracted_in_batches(standalone_client, uid) -> None:  # type: ignore[no-untyped-def]
    """After a long pause thousands of events leave the window at once; totals stay exact."""
    n, step = 5_000, 10
    budget = TokenBudget(standalone_client, [Window(limit=n, seconds=60), Window(n * 2, 600)])
    await fill(standalone_client, budget, uid, n, T0, step)
    later = T0 + 60_000 + 1_234 * step  # the 60 s window has lost the first 1235 charges
    usage = await budget.usage(uid, now_ms=later, events=0)
    assert [w.used for w in usage.windows] == [n - 1_235, n]
    log_key = user_keys(uid, "log")[0]
    assert await standalone_client.zcard(log_key) == n
    much_later = T0 + 600_000 + 4_000 * step  # the 600 s window lost 4001: they are deleted
    usage = await budget.usage(uid, now_ms=much_later, events=0)
    assert [w.used for w in usage.windows] == [0, n - 4_001]
    assert await standalone_client.zcard(log_key) == n - 4_001
    assert await standalone_client.hlen(user_keys(uid, "ev")[0]) == n - 4_001
