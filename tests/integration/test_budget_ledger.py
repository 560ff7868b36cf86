"""Token budget ledger against real Redis, standalone and cluster.

Times are explicit ``now_ms`` values, so windows of a few hundred ms behave exactly and no
test sleeps, except the one that waits for Redis to expire keys.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from usage_limits import CostExceedsLimit, InvalidArgument, TokenBudget, Window
from usage_limits._scripts import script
from usage_limits.budget import Reservation, _decode_reservation
from usage_limits.keys import user_keys

T0 = 1_700_000_000_000  # an ordinary epoch time in ms


def keys_of(user: str) -> list[str]:
    return user_keys(user, "log", "ev", "meta")


async def used(budget: TokenBudget, user: str, now_ms: int, **kw: Any) -> list[int]:
    return [w.used for w in (await budget.usage(user, now_ms=now_ms, **kw)).windows]


async def test_admits_up_to_the_limit_then_rejects(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Requests are admitted while they fit; the one that would pass the limit is refused."""
    budget = TokenBudget(redis_client, [Window(limit=10, seconds=60)])
    first = await budget.reserve(uid, "a", 4, now_ms=T0)
    second = await budget.reserve(uid, "b", 6, now_ms=T0 + 1)
    third = await budget.reserve(uid, "c", 1, now_ms=T0 + 2)
    assert (first.allowed, first.remaining, first.retry_after_s) == (True, 6, 0.0)
    assert (second.allowed, second.remaining) == (True, 0)
    assert not third.allowed and third.remaining == 0 and third.retry_after_s > 0
    assert (third.limit, third.window_s, third.cost) == (10, 60.0, 1)
    assert await used(budget, uid, T0 + 3) == [10]


async def test_a_request_failing_one_window_charges_none(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A reservation must fit every window; one that fails any window charges no window."""
    budget = TokenBudget(redis_client, [Window(10, 1), Window(15, 60)])
    assert (await budget.reserve(uid, "a", 8, now_ms=T0)).allowed
    later = T0 + 2_000  # the 1 s window is empty again, the 60 s window holds 8
    d = await budget.reserve(uid, "b", 8, now_ms=later)
    assert not d.allowed and (d.limit, d.window_s) == (15, 60.0)
    assert [w.used for w in d.windows] == [0, 8]
    assert await used(budget, uid, later) == [0, 8]
    assert (await budget.reserve(uid, "c", 7, now_ms=later)).allowed


async def test_same_request_id_is_charged_once(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A second reservation of an id is admitted as a duplicate and charges nothing."""
    budget = TokenBudget(redis_client, [Window(10, 60)])
    first = await budget.reserve(uid, "req", 4, now_ms=T0)
    again = await budget.reserve(uid, "req", 4, now_ms=T0 + 1)
    assert first.allowed and not first.duplicate
    assert again.allowed and again.duplicate and again.remaining == 6
    assert await used(budget, uid, T0 + 2) == [4]


async def test_a_resent_call_reports_its_own_success(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """The same script call sent twice (a client retry after a lost reply) is not a duplicate."""
    budget = TokenBudget(redis_client, [Window(10, 60)])
    keys, args = budget._reserve_call(uid, "req", 4, "/v1/x", budget.windows, T0, "0badcafe")
    replies = [await script("budget_reserve")(redis_client, keys, args) for _ in range(2)]
    sent, resent = (_decode_reservation(r, 4, budget.windows, "0badcafe") for r in replies)
    assert sent.allowed and not sent.duplicate
    assert resent.allowed and not resent.duplicate and resent.remaining == 6
    other = await budget.reserve(uid, "req", 4, now_ms=T0)  # a new call: a fresh nonce
    assert other.allowed and other.duplicate
    assert await used(budget, uid, T0) == [4]


async def test_same_request_id_of_two_users_is_two_charges(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Keys are per user: the same request id charges each user separately."""
    budget = TokenBudget(redis_client, [Window(10, 60)])
    a = await budget.reserve(f"{uid}-a", "req", 3, now_ms=T0)
    b = await budget.reserve(f"{uid}-b", "req", 5, now_ms=T0)
    assert not a.duplicate and not b.duplicate
    assert await used(budget, f"{uid}-a", T0) == [3]
    assert await used(budget, f"{uid}-b", T0) == [5]


async def test_refund_gives_back_once(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A refund removes the charge once; refunding again or an unknown id returns False."""
    budget = TokenBudget(redis_client, [Window(10, 60), Window(20, 3600)])
    a = await budget.reserve(uid, "a", 4, now_ms=T0)
    await budget.reserve(uid, "b", 3, now_ms=T0)
    assert await budget.refund(uid, "a", nonce=a.nonce) is True
    assert await budget.refund(uid, "a", nonce=a.nonce) is False
    assert await budget.refund(uid, "never-charged", nonce=a.nonce) is False
    assert await used(budget, uid, T0) == [3, 3]
    assert [e.request_id for e in (await budget.usage(uid, now_ms=T0)).events] == ["b"]


async def test_refund_of_another_users_id_does_nothing(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A refund only looks in the caller's own keys."""
    budget = TokenBudget(redis_client, [Window(10, 60)])
    d = await budget.reserve(f"{uid}-a", "secret", 7, now_ms=T0)
    assert await budget.refund(f"{uid}-b", "secret", nonce=d.nonce) is False
    assert await budget.settle(f"{uid}-b", "secret", 0, nonce=d.nonce) is False
    assert await used(budget, f"{uid}-a", T0) == [7]


@pytest.mark.parametrize("advanced_before_refund", [True, False])
async def test_refund_after_leaving_a_window_gives_nothing_back_there(  # type: ignore[no-untyped-def]
        redis_client, uid, advanced_before_refund) -> None:
    """A refund of a charge that left the short window only lowers the windows still counting it."""
    budget = TokenBudget(redis_client, [Window(20, 0.1), Window(50, 1)])
    old = await budget.reserve(uid, "old", 3, now_ms=T0)
    await budget.reserve(uid, "new", 4, now_ms=T0 + 50)
    if advanced_before_refund:  # the ledger has already moved the short window past "old"
        assert await used(budget, uid, T0 + 120) == [4, 7]
    assert await budget.refund(uid, "old", nonce=old.nonce) is True
    assert await used(budget, uid, T0 + 120) == [4, 4]
    assert await used(budget, uid, T0 + 200) == [0, 4]


async def test_settle_lowers_never_raises_and_zero_removes(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """settle lowers a charge, refuses to raise it, and a cost of 0 removes the event."""
    budget = TokenBudget(redis_client, [Window(10, 60), Window(30, 3600)])
    n = (await budget.reserve(uid, "a", 8, now_ms=T0, route="/v1/structured")).nonce
    assert await budget.settle(uid, "a", 3, nonce=n) is True
    assert await used(budget, uid, T0) == [3, 3]
    assert await budget.settle(uid, "a", 3, nonce=n) is False
    assert await budget.settle(uid, "a", 9, nonce=n) is False
    events = (await budget.usage(uid, now_ms=T0)).events
    assert [(e.request_id, e.cost, e.route) for e in events] == [("a", 3, "/v1/structured")]
    assert await budget.settle(uid, "a", 0, nonce=n) is True
    assert await used(budget, uid, T0) == [0, 0]
    assert (await budget.usage(uid, now_ms=T0)).events == ()
    assert await budget.settle(uid, "a", 0, nonce=n) is False
    assert await budget.settle(uid, "unknown", 1, nonce=n) is False


async def test_retry_after_is_exact(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Retry-After is the moment enough of the oldest charges leave the window, to the ms."""
    budget = TokenBudget(redis_client, [Window(limit=10, seconds=0.1)])
    for i, (at, cost) in enumerate([(0, 4), (10, 3), (20, 3)]):
        assert (await budget.reserve(uid, f"e{i}", cost, now_ms=T0 + at)).allowed
    # at t=30 a cost of 5 needs 5 tokens freed: 4 (t=0) is not enough, 4+3 (t=10) is, and
    # the event of t=10 leaves the 100 ms window at t=110: wait 80 ms
    d = await budget.reserve(uid, "x", 5, now_ms=T0 + 30)
    assert not d.allowed and d.retry_after_s == 0.080
    assert d.windows[0].resets_at_ms == T0 + 100
    assert not (await budget.reserve(uid, "x", 5, now_ms=T0 + 109)).allowed
    assert (await budget.reserve(uid, "x", 5, now_ms=T0 + 110)).allowed


async def test_retry_after_is_the_longest_wait_of_the_failing_windows(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """With several full windows, the request must wait for the slowest one to have room."""
    budget = TokenBudget(redis_client, [Window(6, 0.1), Window(8, 1)])
    await budget.reserve(uid, "a", 4, now_ms=T0)
    await budget.reserve(uid, "b", 2, now_ms=T0 + 50)
    d = await budget.reserve(uid, "c", 3, now_ms=T0 + 60)
    # short window: 6+3-6 = 3 to free, "a" leaves at 100 (40 ms); long: 6+3-8 = 1, at 1000
    assert not d.allowed and d.retry_after_s == 0.940 and (d.limit, d.window_s) == (8, 1.0)
    assert not (await budget.reserve(uid, "c", 3, now_ms=T0 + 999)).allowed
    assert (await budget.reserve(uid, "c", 3, now_ms=T0 + 1000)).allowed


async def test_a_lowered_limit_waits_for_enough_charges_to_leave(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """When a plan's limit drops below what was spent, the wait covers the whole excess."""
    budget = TokenBudget(redis_client, [Window(100, 1)])
    for i in range(50):
        await budget.reserve(uid, f"r{i}", 2, now_ms=T0 + i)
    smaller = [Window(10, 1)]
    d = await budget.reserve(uid, "x", 5, windows=smaller, now_ms=T0 + 50)
    # 100 spent + 5 must drop to 10: 95 tokens, i.e. the 48 oldest charges (t = 0..47)
    assert not d.allowed and d.retry_after_s == (47 + 1000 - 50) / 1000
    assert (await budget.reserve(uid, "x", 5, windows=smaller, now_ms=T0 + 1047)).allowed


async def test_cost_above_limit_raises_and_touches_nothing(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A cost above a window's limit raises CostExceedsLimit and writes no key."""
    budget = TokenBudget(redis_client, [Window(10, 60), Window(5, 1)])
    with pytest.raises(CostExceedsLimit) as info:
        await budget.reserve(uid, "a", 6, now_ms=T0)
    assert info.value.limit == 5
    assert await redis_client.exists(*keys_of(uid)) == 0


@pytest.mark.parametrize("kwargs", [
    dict(request_id="", cost=1), dict(request_id="r" * 257, cost=1),
    dict(request_id="a\x1bb", cost=1), dict(request_id="r", cost=0),
    dict(request_id="r", cost=2.5), dict(request_id="r", cost=1, windows=[]),
    dict(request_id="r", cost=1, windows=[Window(5, 1), Window(9, 1)]),
])
async def test_bad_arguments_raise_and_touch_nothing(redis_client, uid, kwargs) -> None:  # type: ignore[no-untyped-def]
    """Malformed reservations raise InvalidArgument and leave no key behind."""
    budget = TokenBudget(redis_client, [Window(10, 60)])
    with pytest.raises(InvalidArgument):
        await budget.reserve(uid, now_ms=T0, **kwargs)
    assert await redis_client.exists(*keys_of(uid)) == 0


async def test_clock_never_runs_backwards(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A call with an older now_ms is handled at the newest time the user's keys have seen."""
    budget = TokenBudget(redis_client, [Window(10, 0.1)])
    await budget.reserve(uid, "a", 6, now_ms=T0)
    late = await budget.reserve(uid, "b", 1, now_ms=T0 + 150)  # "a" has left the window
    assert late.windows[0].used == 1
    early = await budget.reserve(uid, "c", 8, now_ms=T0 + 10)  # stale clock: still T0 + 150
    assert early.allowed and early.windows[0].used == 9
    assert early.windows[0].resets_at_ms == T0 + 250  # "b" at the clamped clock + 100 ms
    usage = await budget.usage(uid, now_ms=0)
    assert usage.now_ms == T0 + 150
    assert [(e.request_id, e.at_ms) for e in usage.events] == [("c", T0 + 150), ("b", T0 + 150)]


@pytest.mark.parametrize("plan", [
    [Window(50, s / 10) for s in range(1, 7)],
    [Window(50, 3600), Window(60, 86_400), Window(70, 30 * 86_400)],
])
async def test_a_long_pause_retires_events_from_every_window(redis_client, uid, plan) -> None:  # type: ignore[no-untyped-def]
    """After a pause longer than every window, each window's total is back to zero."""
    budget = TokenBudget(redis_client, plan)
    step, pause = plan[0].ms // 3, 2 * plan[-1].ms
    for i in range(12):
        assert (await budget.reserve(uid, f"r{i}", 1 + i % 3, now_ms=T0 + step * i)).allowed
    assert await used(budget, uid, T0 + pause) == [0] * len(plan)
    d = await budget.reserve(uid, "after", 5, now_ms=T0 + pause)
    assert [w.used for w in d.windows] == [5] * len(plan)
    assert await redis_client.zcard(keys_of(uid)[0]) == 1


async def test_keys_expire_past_the_longest_window(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Every key expires past the longest window plus the margin, and at most an hour later."""
    budget = TokenBudget(redis_client, [Window(100, 3600), Window(1000, 30 * 86400)])
    await budget.reserve(uid, "a", 1)
    longest_ms = 30 * 86400 * 1000
    for key in keys_of(uid):
        assert longest_ms + 60_000 < await redis_client.pttl(key) <= longest_ms + 3_660_000


async def test_idle_users_cost_no_memory(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """With a tiny window and margin, a user's keys vanish on their own."""
    budget = TokenBudget(redis_client, [Window(5, 0.05)], key_margin_s=0.05)
    await budget.reserve(uid, "a", 1)
    for _ in range(100):
        if await redis_client.exists(*keys_of(uid)) == 0:
            break
        await asyncio.sleep(0.05)
    assert await redis_client.exists(*keys_of(uid)) == 0


async def test_usage_reports_windows_and_recent_events(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """usage() gives used, remaining and reset per window, and the latest events first."""
    budget = TokenBudget(redis_client, [Window(20, 1), Window(100, 60)])
    for i in range(5):
        await budget.reserve(uid, f"r{i}", i + 1, route=f"/v1/r{i}", now_ms=T0 + 300 * i)
    u = await budget.usage(uid, now_ms=T0 + 1250, events=3)
    short, long = u.windows
    # at 1250 the 1 s window holds r1 (t=300, cost 2), r2 (600, 3), r3 (900, 4), r4 (1200, 5)
    assert (short.limit, short.used, short.remaining, short.window_s) == (20, 14, 6, 1.0)
    assert short.resets_at_ms == T0 + 1300 and short.resets_at == (T0 + 1300) / 1000
    assert (long.used, long.remaining, long.resets_at_ms) == (15, 85, T0 + 60_000)
    assert [(e.request_id, e.cost, e.route, e.at_ms) for e in u.events] == [
        ("r4", 5, "/v1/r4", T0 + 1200), ("r3", 4, "/v1/r3", T0 + 900),
        ("r2", 3, "/v1/r2", T0 + 600)]


async def test_usage_of_an_unknown_user_is_empty_and_writes_nothing(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Asking about a user with no spend returns zeros and creates no key."""
    budget = TokenBudget(redis_client, [Window(10, 1)])
    u = await budget.usage(uid, now_ms=T0)
    assert u.events == () and u.windows[0].used == 0 and u.windows[0].resets_at_ms is None
    assert await redis_client.exists(*keys_of(uid)) == 0


async def test_a_new_window_starts_from_the_log(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A window a user never had (a plan change) counts the spend already in the log."""
    budget = TokenBudget(redis_client, [Window(10, 1)])
    await budget.reserve(uid, "a", 4, now_ms=T0)
    await budget.reserve(uid, "b", 5, now_ms=T0 + 500)
    bigger = [Window(10, 1), Window(12, 2)]
    d = await budget.reserve(uid, "c", 4, windows=bigger, now_ms=T0 + 1200)
    # 1 s window: b (5) + c = 9 fits; 2 s window: a + b = 9, + 4 = 13 > 12
    assert not d.allowed and [w.used for w in d.windows] == [5, 9]
    # the old plan keeps the 2 s window up to date; it is still right when asked again
    await budget.reserve(uid, "d", 1, now_ms=T0 + 1600)
    assert await used(budget, uid, T0 + 2100, windows=bigger) == [1, 6]


async def test_script_cache_flush_is_recovered(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """After SCRIPT FLUSH the scripts are sent again in full and keep working."""
    budget = TokenBudget(redis_client, [Window(10, 60)])
    a = await budget.reserve(uid, "a", 2, now_ms=T0)
    assert a.allowed
    await redis_client.script_flush()
    assert (await budget.reserve(uid, "b", 2, now_ms=T0)).allowed
    await redis_client.script_flush()
    assert await budget.refund(uid, "a", nonce=a.nonce) is True
    await redis_client.script_flush()
    assert await used(budget, uid, T0) == [2]


def test_reservation_is_frozen() -> None:
    """Results are immutable values."""
    r = Reservation(allowed=True, remaining=1, retry_after_s=0.0, duplicate=False, cost=1,
                    limit=2, window_s=1.0, windows=())
    with pytest.raises(AttributeError):
        r.allowed = False  # type: ignore[misc]


async def test_a_new_longest_window_forgets_what_left_every_window(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A plan change to a window longer than any before deletes the events already older than
    it: they are out of every window, so their ids may be charged again and no record stays."""
    budget = TokenBudget(redis_client, [Window(10, 0.1)])
    await budget.reserve(uid, "old", 4, now_ms=T0)
    longer = [Window(30, 0.25), Window(60, 1)]
    usage = await budget.usage(uid, windows=longer, now_ms=T0 + 1500)
    assert [w.used for w in usage.windows] == [0, 0] and usage.events == ()
    again = await budget.reserve(uid, "old", 4, windows=longer, now_ms=T0 + 1500)
    assert again.allowed and not again.duplicate
    assert [w.used for w in again.windows] == [4, 4]
    log_key, ev_key, _ = keys_of(uid)
    assert await redis_client.zcard(log_key) == 1 and await redis_client.hlen(ev_key) == 1
