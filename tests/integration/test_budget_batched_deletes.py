"""Events that left every window: no longer a charge, deleted in batches, and meta in one field."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from usage_limits import TokenBudget, Window
from usage_limits._scripts import script
from usage_limits.budget import meta_fields
from usage_limits.keys import user_keys

T0 = 1_700_000_000_000
SECOND = 1000
PURGE = 8  # lua/_budget_meta.lua


def keys_of(user: str) -> list[str]:
    return user_keys(user, "log", "ev", "meta")


async def meta_of(client: Any, user: str) -> dict[str, int]:
    return meta_fields(await client.hget(keys_of(user)[2], "m"))


async def fill_and_expire(budget: TokenBudget, user: str, n: int) -> int:
    """n one-token charges one ms apart, an "anchor" charge 0.5 s later, then a call once
    the n have left the 1 s window (the anchor has not: a window that empties renews the
    keys' expiry, which deletes the dead events too); returns that call's time."""
    for i in range(n):
        assert (await budget.reserve(user, f"old{i}", 1, now_ms=T0 + i)).allowed
    assert (await budget.reserve(user, "anchor", 1, now_ms=T0 + n + 500)).allowed
    later = T0 + n + SECOND
    assert (await budget.reserve(user, "later", 1, now_ms=later)).allowed
    return later


async def test_left_events_wait_for_a_batch_and_are_then_deleted(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Fewer than a batch of events out of every window stay stored (uncounted); the call
    that brings the batch to PURGE deletes them all, with their records."""
    budget = TokenBudget(redis_client, [Window(10**6, 1)])
    log, ev, _ = keys_of(uid)
    later = await fill_and_expire(budget, uid, PURGE - 1)
    assert await redis_client.zcard(log) == PURGE + 1  # PURGE - 1 dead, the anchor and "later"
    meta = await meta_of(redis_client, uid)
    assert (meta["dead"], meta[f"t:{SECOND}"]) == (PURGE - 1, 2)
    # the anchor leaves too: the batch is full, and every dead event goes
    await budget.reserve(uid, "x", 1, now_ms=later + 600)
    assert await redis_client.zrange(log, 0, -1) == [b"later", b"x"]
    assert sorted(await redis_client.hkeys(ev)) == [b"later", b"x"]
    assert (await meta_of(redis_client, uid))["dead"] == 0


async def test_a_left_event_is_no_charge_any_more(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """An event out of every window but still stored is not refunded, not listed, and its
    id may be charged again."""
    budget = TokenBudget(redis_client, [Window(10, 2)])
    first = await budget.reserve(uid, "a", 4, now_ms=T0)
    await budget.reserve(uid, "keep", 1, now_ms=T0 + 1500)
    later = T0 + 2500
    await budget.reserve(uid, "b", 1, now_ms=later)  # "a" leaves the window
    assert await redis_client.zscore(keys_of(uid)[0], "a") is not None  # stored, uncounted
    assert await budget.refund(uid, "a", nonce=first.nonce) is False
    assert (await meta_of(redis_client, uid))[f"t:{2 * SECOND}"] == 2
    again = await budget.reserve(uid, "a", 8, now_ms=later + 1)
    assert again.allowed and not again.duplicate and again.windows[0].used == 10
    usage = await budget.usage(uid, now_ms=later + 2)
    assert [e.request_id for e in usage.events] == ["a", "b", "keep"]
    assert usage.windows[0].used == 10


async def test_a_usage_read_deletes_every_left_event(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A usage read lists live events only: it deletes the dead ones first, however few."""
    budget = TokenBudget(redis_client, [Window(10**6, 1)])
    later = await fill_and_expire(budget, uid, 5)
    assert await redis_client.zcard(keys_of(uid)[0]) == 7
    usage = await budget.usage(uid, now_ms=later)
    assert [e.request_id for e in usage.events] == ["later", "anchor"]
    assert await redis_client.zcard(keys_of(uid)[0]) == 2
    assert await redis_client.hlen(keys_of(uid)[1]) == 2


async def test_a_purging_reservation_runs_twice(standalone_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A reservation that deletes a batch, sent twice (a lost reply), answers the same both
    times, charges once and leaves the same keys."""
    client = standalone_client
    budget = TokenBudget(client, [Window(10**6, 1)])
    later = await fill_and_expire(budget, uid, PURGE - 1)
    keys, args = budget._reserve_call(uid, "last", 1, "/v1/x", budget.windows,
                                      later + 600, "abcd1234")
    reserve = script("budget_reserve")
    first = await reserve(client, keys, args)
    state = [await client.zrange(keys[0], 0, -1, withscores=True),
             await client.hgetall(keys[1]), await client.hgetall(keys[2])]
    second = await reserve(client, keys, args)
    assert first == second and int(first[0]) == 1
    assert state == [await client.zrange(keys[0], 0, -1, withscores=True),
                     await client.hgetall(keys[1]), await client.hgetall(keys[2])]
    assert await client.zrange(keys[0], 0, -1) == [b"later", b"last"]


async def test_meta_of_an_older_layout_is_counted_anew(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A meta hash without the one-field record (an older layout's t:/lo: fields) is dropped:
    the windows are counted from the log and the old fields are gone."""
    budget = TokenBudget(redis_client, [Window(100, 60), Window(1000, 3600)])
    for i in range(3):
        await budget.reserve(uid, f"r{i}", 5, now_ms=T0 + i)
    meta_key = keys_of(uid)[2]
    await redis_client.delete(meta_key)
    await redis_client.hset(meta_key, mapping={"clk": T0 + 2, "t:60000": 99, "lo:60000": 0,
                                               "t:3600000": 999, "lo:3600000": 0})
    d = await budget.reserve(uid, "r3", 5, now_ms=T0 + 3)
    assert [w.used for w in d.windows] == [20, 20]
    assert await redis_client.hkeys(meta_key) == [b"m"]
    assert await redis_client.pttl(meta_key) > 3_600_000


def test_meta_fields_reads_the_record() -> None:
    """The one-field record reads as the clock, the dead count and each window's numbers."""
    values = [1700000000123, 2, 1000, 7, 1699999999123, -1, 0, 0, 60000, 9, -1, -2, 3, 80]
    fields = meta_fields(struct.pack(f"<{len(values)}d", *values))
    assert fields == {"clk": 1700000000123, "dead": 2,
                      "t:1000": 7, "lo:1000": 1699999999123, "f:1000": -1, "d:1000": 0,
                      "n:1000": 0, "t:60000": 9, "lo:60000": -1, "f:60000": -2, "d:60000": 3,
                      "n:60000": 80}
    with pytest.raises(ValueError):
        meta_fields(b"1700000000123 2")
