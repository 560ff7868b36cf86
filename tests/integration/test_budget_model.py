"""The ledger's running totals against a plain Python model, and its cost with many events."""

from __future__ import annotations

import random

import pytest

from tests.ledger_model import Model
from usage_limits import TokenBudget, Window
from usage_limits._scripts import script
from usage_limits.keys import user_keys

T0 = 1_700_000_000_000


async def check_usage(budget: TokenBudget, model: Model, plan: list[Window], user: str,
                      now_ms: int) -> None:
    """The ledger's usage equals the model's: clock, every window and every event."""
    usage = await budget.usage(user, windows=plan, now_ms=now_ms, events=1000)
    clock, windows, events = model.usage(now_ms, plan)
    assert usage.now_ms == clock
    assert [(w.used, w.remaining, w.resets_at_ms) for w in usage.windows] == [
        (w.used, w.remaining, w.resets_at_ms) for w in windows]
    assert [(e.request_id, e.at_ms, e.cost, e.route) for e in usage.events] == events


@pytest.mark.parametrize("seed", [1, 2])
async def test_totals_match_a_model_under_random_operations(redis_client, uid, seed) -> None:  # type: ignore[no-untyped-def]
    """After any mix of reserve, refund, settle and clock moves, totals equal the live events."""
    rng = random.Random(seed)
    plan = [Window(limit=20, seconds=0.1), Window(limit=45, seconds=0.4)]
    budget = TokenBudget(redis_client, plan)
    model = Model()
    now, ids = T0, []
    nonces: dict[str, str] = {}
    for step in range(300):
        op = rng.random()
        live = sorted(model.events)
        known = (rng.choice(live) if live and rng.random() < 0.7
                 else rng.choice(ids) if ids else "none")
        nonce = nonces.get(known, "n")
        if op < 0.45:
            rid = known if rng.random() < 0.15 else f"r{step}"
            ids.append(rid)
            cost, route = rng.randint(1, 8), rng.choice(["", "/v1/structured", "GET /v1/salary"])
            d = await budget.reserve(uid, rid, cost, route=route, now_ms=now)
            want = model.reserve(rid, cost, route, d.nonce, now, plan)
            if d.allowed and not d.duplicate:
                nonces[rid] = d.nonce
            assert (d.allowed, d.duplicate, round(d.retry_after_s * 1000)) == (
                want.allowed, want.duplicate, want.retry_after_ms), step
            assert [w.used for w in d.windows] == [w.used for w in want.windows], step
        elif op < 0.6:
            assert await budget.refund(uid, known, nonce=nonce) == model.lower(known, 0, nonce)
        elif op < 0.75:
            new_cost = rng.randint(0, 8)
            assert await budget.settle(uid, known, new_cost, nonce=nonce) == model.lower(
                known, new_cost, nonce), step
        elif op < 0.93:
            now += rng.randint(0, 80)
        elif op < 0.95:  # a pause longer than some or all windows
            now += rng.randint(100, 600)
        else:  # a caller whose clock lags behind: the ledger keeps its own newest time
            await check_usage(budget, model, plan, uid, now - rng.randint(1, 300))
        await check_usage(budget, model, plan, uid, now)


async def fill(client, budget: TokenBudget, user: str, n: int, start_ms: int, step_ms: int,  # type: ignore[no-untyped-def]
               cost_from: int = 0, cost: int = 1) -> None:
    """Charge n events step_ms apart through the real script in one pipeline: each costs 1,
    except that those from index ``cost_from`` on cost ``cost`` when given."""
    reserve = script("budget_reserve")
    calls = [budget._reserve_call(user, f"{i:016d}", cost if cost_from and i >= cost_from else 1,
                                  "/v1/structured", budget.windows, start_ms + i * step_ms,
                                  "00000000") for i in range(n)]
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
    await budget.refund(uid, "0000000000000000", nonce="00000000")
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


async def test_retry_after_is_exact_past_a_thousand_events(standalone_client, uid) -> None:  # type: ignore[no-untyped-def]
    """With 5,000 charges of 1 in a 5000/1h window, a cost of 2,000 waits exactly for the
    2,000th oldest charge to leave, not for the window to empty."""
    n, step = 5_000, 700
    budget = TokenBudget(standalone_client, [Window(limit=n, seconds=3_600)])
    await fill(standalone_client, budget, uid, n, T0, step)
    now = T0 + n * step
    d = await budget.reserve(uid, "big", 2_000, now_ms=now)
    assert not d.allowed
    assert d.retry_after_s * 1000 == T0 + 1_999 * step + 3_600_000 - now  # 1499.3 s


@pytest.mark.parametrize("tail_cost", [1, 3])
async def test_retry_after_past_the_walk_bound_is_never_early(standalone_client, uid,  # type: ignore[no-untyped-def]
                                                              tail_cost) -> None:
    """Past 10,000 events walked (a limit lowered far below the spend), Retry-After counts
    every unread event as 1 token: exact when they cost 1, later (never earlier) otherwise."""
    n, step, walk = 12_000, 100, 10_000
    budget = TokenBudget(standalone_client, [Window(limit=100_000, seconds=3_600)])
    await fill(standalone_client, budget, uid, n, T0, step, cost_from=walk, cost=tail_cost)
    now = T0 + n * step
    lowered = [Window(limit=1_000, seconds=3_600)]
    d = await budget.reserve(uid, "x", 1, windows=lowered, now_ms=now)
    total = walk + (n - walk) * tail_cost
    need = total + 1 - 1_000
    answer = d.retry_after_s * 1000
    bound_rank = min(walk + (need - walk) - 1, n - 1)  # as if unread events cost 1 (or the newest)
    assert answer == T0 + bound_rank * step + 3_600_000 - now
    exact_rank = walk + -(-(need - walk) // tail_cost) - 1  # first rank freeing `need`
    assert answer >= T0 + exact_rank * step + 3_600_000 - now
    assert (answer == T0 + exact_rank * step + 3_600_000 - now) == (tail_cost == 1)
