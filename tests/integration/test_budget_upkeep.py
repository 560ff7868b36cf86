"""The ledger's upkeep: a key's expiry is renewed only when it would fall short."""

from __future__ import annotations

import asyncio
from typing import Any

from usage_limits import TokenBudget, Window
from usage_limits._scripts import script
from usage_limits.keys import user_keys

T0 = 1_700_000_000_000
HOUR_MS = 3_600_000


def keys_of(user: str) -> list[str]:
    return user_keys(user, "log", "ev", "meta")


async def commands(client: Any, call: Any) -> dict[str, int]:
    """The Redis commands one ledger call ran inside its script, by name."""
    await client.config_resetstat()
    await call
    stats = await client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()
            if name not in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_config|resetstat")}


async def test_expiry_is_renewed_only_when_it_would_fall_short(standalone_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A call soon after another sends no PEXPIRE; one once the slack has passed renews."""
    client = standalone_client
    window_ms, margin_ms = 2000, 50  # slack = min(window, 1 h) = 2 s: keys live 4.05 s
    budget = TokenBudget(client, [Window(10**6, window_ms / 1000)], key_margin_s=0.05)
    first = await commands(client, budget.reserve(uid, "a", 1, now_ms=T0))
    assert first.get("pexpire") == 3
    soon = await commands(client, budget.reserve(uid, "b", 1, now_ms=T0 + 1))
    assert "pexpire" not in soon
    for key in keys_of(uid):  # still at least the window plus the margin past the last call
        assert window_ms + margin_ms < await client.pttl(key) <= 2 * window_ms + margin_ms
    await asyncio.sleep(2.1)  # Redis's clock: now less than window + margin is left
    later = await commands(client, budget.reserve(uid, "c", 1, now_ms=T0 + 2))
    assert later.get("pexpire") == 3
    for key in keys_of(uid):
        assert window_ms + margin_ms < await client.pttl(key)


async def test_a_log_made_anew_gets_an_expiry(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """After a refund empties the log, the next charge's new log and ev keys expire again."""
    budget = TokenBudget(redis_client, [Window(100, 3600)])
    d = await budget.reserve(uid, "a", 1, now_ms=T0)
    assert await budget.refund(uid, "a", nonce=d.nonce) is True
    assert await redis_client.exists(*keys_of(uid)[:2]) == 0  # log and ev are gone
    await budget.reserve(uid, "b", 1, now_ms=T0 + 1000)
    for key in keys_of(uid):
        assert await redis_client.pttl(key) > 3_600_000


async def test_reserve_runs_twice_when_it_renews_the_expiry(standalone_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A reservation sent twice (a lost reply) that renews the expiry and retires events
    answers the same both times, charges once and leaves the same keys."""
    client = standalone_client
    budget = TokenBudget(client, [Window(10**6, 1)])
    for i in range(5):
        await budget.reserve(uid, f"r{i}", 1, now_ms=T0 + i * 400)
    now = T0 + HOUR_MS  # every event has left, and the expiry is due
    keys, args = budget._reserve_call(uid, "last", 1, "/v1/x", budget.windows, now, "abcd1234")
    reserve = script("budget_reserve")
    first = await reserve(client, keys, args)
    state = [await client.zrange(keys[0], 0, -1, withscores=True), await client.hgetall(keys[1]),
             await client.hgetall(keys[2])]
    again = await commands(client, reserve(client, keys, args))
    assert "pexpire" not in again  # the first run renewed it
    second = await reserve(client, keys, args)
    assert first == second and int(first[0]) == 1 and int(first[3]) == 1
    assert state == [await client.zrange(keys[0], 0, -1, withscores=True),
                     await client.hgetall(keys[1]), await client.hgetall(keys[2])]
    assert await client.zcard(keys[0]) == 1


async def test_idle_users_keys_vanish(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """With renewals skipped while due later, an idle user's keys still expire on their own."""
    budget = TokenBudget(redis_client, [Window(5, 0.05)], key_margin_s=0.05)
    await budget.reserve(uid, "a", 1)
    await budget.reserve(uid, "b", 1)  # within the slack: no renewal
    for _ in range(100):
        if await redis_client.exists(*keys_of(uid)) == 0:
            break
        await asyncio.sleep(0.05)
    assert await redis_client.exists(*keys_of(uid)) == 0
