"""Plan overrides, credit grants and suspensions in the ledger's scripts, on real servers.

Every test runs on both engines and both topologies (standalone and the 3-node cluster).
The plan is 10 tokens a minute (a burst window) and 20 an hour (the quota): a charge that
fits the minute but not the hour draws what does not fit from the user's live grants.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.resend import Resending
from usage_limits import CostExceedsLimit, TokenBudget, Window
from usage_limits._scripts import script
from usage_limits.budget import CreditCrossing, LiveGrant, meta_fields, new_nonce
from usage_limits.keys import user_keys

T0 = 1_700_000_000_000
MIN, HOUR = 60_000, 3_600_000
FREE = [Window(10, 60), Window(20, 3600)]
PRO = [Window(50, 60), Window(100, 3600)]
TINY = [Window(4, 60), Window(8, 3600)]
CATALOG = {"free": FREE, "pro": PRO, "tiny": TINY}


def grant(ref: str, tokens: int, *, remaining: int | None = None, expires: int | None = None,
          kind: str = "paid", created: int = 0) -> LiveGrant:
    """A live grant as the loader passes it."""
    return LiveGrant(ref, tokens if remaining is None else remaining, tokens, expires,
                     kind, created)  # type: ignore[arg-type]


def budget_on(client: Any, **kw: Any) -> TokenBudget:
    """A budget with entitlements on and the test catalog."""
    return TokenBudget(client, FREE, catalog=CATALOG, entitlements=True, **kw)


async def load(budget: TokenBudget, user: str, *grants: LiveGrant, epoch: int = 1,
               plan: str | None = None, susp: int | None = None) -> None:
    """Load the user's entitlements and check the load took."""
    assert await budget.load_entitlements(user, epoch=epoch, plan=plan,
                                          suspended_until_ms=susp, grants=list(grants))


async def fill_quota(budget: TokenBudget, user: str, now: int = T0) -> None:
    """Two charges of 10 a minute apart: the hour's quota of 20 is used up, nothing drawn."""
    for i, at in enumerate((now, now + MIN)):
        d = await budget.reserve(user, f"fill{i}", 10, now_ms=at, plan_name="free")
        assert d.status == "charged" and d.drawn == 0


async def remaining(budget: TokenBudget, user: str, now: int) -> dict[str, int]:
    """Each live grant's remaining credit, as usage reports it."""
    usage = await budget.usage(user, now_ms=now, plan_name="free", events=0)
    return {g.reference: g.remaining for g in usage.grants}


async def test_a_charge_over_the_quota_draws_only_what_does_not_fit(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Over the quota, a charge draws only the part above it, and the quota shows t - d."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("inv-1", 50))
    await budget.reserve(uid, "a", 8, now_ms=T0, plan_name="free")
    await budget.reserve(uid, "b", 8, now_ms=T0 + MIN, plan_name="free")
    d = await budget.reserve(uid, "c", 8, now_ms=T0 + 2 * MIN, plan_name="free")
    assert (d.status, d.drawn, d.draws, d.credit, d.epoch) == ("charged", 4, (("inv-1", 4),),
                                                                 46, 1)
    assert [w.used for w in d.windows] == [8, 20]  # the burst window counts the full cost
    usage = await budget.usage(uid, now_ms=T0 + 2 * MIN, plan_name="free")
    assert [w.used for w in usage.windows] == [8, 20]
    assert [(e.request_id, e.draws) for e in usage.events] == [
        ("c", (("inv-1", 4),)), ("b", ()), ("a", ())]
    assert usage.grants == (LiveGrant("inv-1", 46, 50, None, "paid"),)
    assert (usage.plan_name, usage.loaded, usage.epoch) == ("free", True, 1)


async def test_grants_are_drawn_earliest_expiry_first_promo_before_paid(redis_client,  # type: ignore[no-untyped-def]
                                                                       uid) -> None:
    """Draw order: earliest expiry, promo before paid, older first, no expiry last."""
    budget = budget_on(redis_client)
    late = T0 + 10 * HOUR
    await load(budget, uid, grant("never", 5), grant("paid-late", 1, expires=late),
               grant("promo-late-new", 1, expires=late, kind="promo", created=2),
               grant("promo-late-old", 1, expires=late, kind="promo", created=1),
               grant("soon", 1, expires=T0 + 5 * HOUR))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "x", 6, now_ms=T0 + 2 * MIN, plan_name="free")
    assert d.draws == (("soon", 1), ("promo-late-old", 1), ("promo-late-new", 1),
                       ("paid-late", 1), ("never", 2))
    assert d.drawn == 6 and d.credit == 3
    usage = await budget.usage(uid, now_ms=T0 + 2 * MIN, plan_name="free")
    assert [g.reference for g in usage.grants] == ["soon", "promo-late-old", "promo-late-new",
                                                   "paid-late", "never"]


async def test_a_grant_expiring_mid_window_stops_covering(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A grant covers charges until its expiry, then none: rejected with the credit left."""
    budget = budget_on(redis_client)
    expiry = T0 + 30 * MIN
    await load(budget, uid, grant("promo", 10, expires=expiry, kind="promo"))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "before", 3, now_ms=expiry - 1, plan_name="free")
    assert d.status == "charged" and d.draws == (("promo", 3),)
    d = await budget.reserve(uid, "at", 3, now_ms=expiry, plan_name="free")
    assert (d.status, d.allowed, d.credit, d.drawn) == ("rejected", False, 0, 0)
    assert d.retry_after_s * 1000 == T0 + HOUR - expiry  # when the first 10 leave the hour
    usage = await budget.usage(uid, now_ms=expiry, plan_name="free")
    assert usage.grants == ()


async def test_not_enough_credit_rejects_with_the_balance(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A charge the quota and the grants cannot cover charges and draws nothing."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("a", 2), grant("b", 1))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "x", 4, now_ms=T0 + 2 * MIN, plan_name="free")
    assert (d.status, d.credit, d.draws, d.retry_after_s) == ("rejected", 3, (), 58 * 60.0)
    assert await remaining(budget, uid, T0 + 2 * MIN) == {"a": 2, "b": 1}
    assert [w.used for w in (await budget.usage(uid, now_ms=T0 + 2 * MIN)).windows] == [0, 20]


async def test_shorter_windows_always_apply(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Grants never lift a shorter window: a burst over 10 a minute is refused."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("big", 1000))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "x", 10, now_ms=T0 + MIN + 1, plan_name="free")
    assert (d.status, d.limit, d.window_s, d.credit, d.draws) == ("rejected", 10, 60.0, 1000, ())


async def test_a_refund_gives_credit_back_to_its_grant(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A refund returns the drawn part to the grants in reverse draw order, once."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("first", 2, expires=T0 + HOUR), grant("second", 10))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "x", 5, now_ms=T0 + 2 * MIN, plan_name="free")
    assert d.draws == (("first", 2), ("second", 3))
    lowered = await budget.lower(uid, "x", 0, nonce=d.nonce, now_ms=T0 + 3 * MIN)
    assert lowered.changed and lowered.returned == (("second", 3), ("first", 2))
    assert lowered.epoch == 1
    assert await remaining(budget, uid, T0 + 3 * MIN) == {"first": 2, "second": 10}
    again = await budget.lower(uid, "x", 0, nonce=d.nonce, now_ms=T0 + 3 * MIN)
    assert (again.changed, again.returned) == (False, ())
    assert await remaining(budget, uid, T0 + 3 * MIN) == {"first": 2, "second": 10}
    usage = await budget.usage(uid, now_ms=T0 + 3 * MIN, plan_name="free")
    assert [w.used for w in usage.windows] == [0, 20]
    assert await redis_client.hget(user_keys(uid, "dr")[0], "x") is None


async def test_a_refund_gives_nothing_to_an_expired_grant(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Credit drawn from a grant that has expired since is gone; the live one gets its own."""
    budget = budget_on(redis_client)
    expiry = T0 + 10 * MIN
    await load(budget, uid, grant("short", 2, expires=expiry), grant("long", 10))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "x", 5, now_ms=T0 + 2 * MIN, plan_name="free")
    assert await budget.refund(uid, "x", nonce=d.nonce, now_ms=expiry)
    assert await remaining(budget, uid, expiry) == {"long": 10}
    raw = await redis_client.hget(user_keys(uid, "ent")[0], "g:short")
    assert raw.split(b" ")[0] == b"0"  # the expired grant got nothing back
    assert [w.used for w in (await budget.usage(uid, now_ms=expiry)).windows] == [0, 20]


async def test_a_refund_gives_nothing_to_a_voided_grant_or_across_a_reload(redis_client,  # type: ignore[no-untyped-def]
                                                                           uid) -> None:
    """Credit drawn before a reload, or from a grant voided since, goes back to no grant."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("keep", 10), grant("void", 1, created=0))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "x", 3, now_ms=T0 + 2 * MIN, plan_name="free")
    assert d.draws == (("void", 1), ("keep", 2)) or d.draws == (("keep", 3),)
    # the operator voids "void": a reload at epoch 2 without it, "keep" as the store has it
    await load(budget, uid, grant("keep", 10, remaining=8), epoch=2)
    lowered = await budget.lower(uid, "x", 0, nonce=d.nonce, now_ms=T0 + 3 * MIN)
    assert lowered.changed and lowered.returned == ()
    assert await remaining(budget, uid, T0 + 3 * MIN) == {"keep": 8}
    assert [w.used for w in (await budget.usage(uid, now_ms=T0 + 3 * MIN)).windows] == [0, 20]


async def test_settle_returns_the_drawn_part_first(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Settling lower gives back drawn credit first, then quota; the quota stays exact."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 20))
    await budget.reserve(uid, "a", 10, now_ms=T0, plan_name="free")
    d = await budget.reserve(uid, "b", 10, now_ms=T0 + MIN, plan_name="free")
    assert d.drawn == 0
    d = await budget.reserve(uid, "c", 8, now_ms=T0 + 2 * MIN, plan_name="free")
    assert d.draws == (("g", 8),)
    one = await budget.lower(uid, "c", 5, nonce=d.nonce, now_ms=T0 + 2 * MIN)
    assert one.returned == (("g", 3),)  # 3 of the 8 drawn back
    usage = await budget.usage(uid, now_ms=T0 + 2 * MIN, plan_name="free")
    assert [w.used for w in usage.windows] == [5, 20]
    assert usage.events[0].draws == (("g", 5),) and usage.events[0].cost == 5
    # settled to 0 from a refund of the rest: 5 drawn go back, and "b" is refunded from quota
    assert await budget.settle(uid, "c", 0, nonce=d.nonce, now_ms=T0 + 2 * MIN)
    assert await remaining(budget, uid, T0 + 2 * MIN) == {"g": 20}
    assert [w.used for w in (await budget.usage(uid, now_ms=T0 + 2 * MIN)).windows] == [0, 20]


async def test_settle_below_the_drawn_part_returns_all_of_it(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Lowering by more than was drawn returns all of it and lowers the quota by the rest."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 20))
    await budget.reserve(uid, "a", 10, now_ms=T0, plan_name="free")
    await budget.reserve(uid, "b", 6, now_ms=T0 + MIN, plan_name="free")
    d = await budget.reserve(uid, "c", 8, now_ms=T0 + 2 * MIN, plan_name="free")
    assert d.draws == (("g", 4),)
    lowered = await budget.lower(uid, "c", 2, nonce=d.nonce, now_ms=T0 + 2 * MIN)
    assert lowered.returned == (("g", 4),)
    usage = await budget.usage(uid, now_ms=T0 + 2 * MIN, plan_name="free")
    assert [w.used for w in usage.windows] == [2, 18]
    assert usage.events[0].draws == () and usage.grants[0].remaining == 20


async def test_a_suspended_user_is_refused_until_the_end(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A suspension refuses every charge (status suspended, nothing written) until it ends."""
    budget = budget_on(redis_client)
    end = T0 + 5 * MIN
    await load(budget, uid, grant("g", 5), susp=end)
    d = await budget.reserve(uid, "x", 1, now_ms=T0, plan_name="free")
    assert (d.status, d.allowed, d.suspended_until_ms, d.windows) == ("suspended", False, end, ())
    assert not await redis_client.exists(*user_keys(uid, "log", "ev", "meta"))
    usage = await budget.usage(uid, now_ms=T0, plan_name="free")
    assert usage.suspended_until_ms == end
    d = await budget.reserve(uid, "x", 1, now_ms=end, plan_name="free")
    assert d.status == "charged" and d.suspended_until_ms is None


async def test_a_suspension_until_lifted_holds_until_a_load_without_it(redis_client,  # type: ignore[no-untyped-def]
                                                                       uid) -> None:
    """A suspension with no end (0) holds at any time; the next load without it lifts it."""
    budget = budget_on(redis_client)
    await load(budget, uid, susp=0)
    d = await budget.reserve(uid, "x", 1, now_ms=T0 + 100 * HOUR, plan_name="free")
    assert (d.status, d.suspended_until_ms) == ("suspended", 0)
    await budget.invalidate_entitlements(uid, epoch=2)
    await load(budget, uid, epoch=2)
    d = await budget.reserve(uid, "x", 1, now_ms=T0, plan_name="free")
    assert d.status == "charged"


async def test_a_user_not_loaded_gets_not_loaded_and_nothing_is_written(redis_client,  # type: ignore[no-untyped-def]
                                                                        uid) -> None:
    """No epoch in ent (never loaded, or invalidated) answers not_loaded and writes nothing."""
    budget = budget_on(redis_client)
    d = await budget.reserve(uid, "x", 1, now_ms=T0, plan_name="free")
    assert (d.status, d.allowed, d.epoch, d.windows) == ("not_loaded", False, 0, ())
    assert not await redis_client.exists(*user_keys(uid, "log", "ev", "meta", "ent", "dr"))
    await load(budget, uid)
    assert (await budget.reserve(uid, "x", 1, now_ms=T0, plan_name="free")).status == "charged"
    await budget.invalidate_entitlements(uid, epoch=2)
    d = await budget.reserve(uid, "y", 1, now_ms=T0, plan_name="free")
    assert d.status == "not_loaded"
    usage = await budget.usage(uid, now_ms=T0, plan_name="free")
    assert (usage.loaded, [w.used for w in usage.windows]) == (False, [1, 1])


async def test_an_override_replaces_the_plan_and_an_unknown_one_falls_back(redis_client,  # type: ignore[no-untyped-def]
                                                                           uid) -> None:
    """An override naming a catalog plan is used; one naming no plan falls back."""
    budget = budget_on(redis_client)
    await load(budget, uid, plan="pro")
    d = await budget.reserve(uid, "a", 30, now_ms=T0, plan_name="free")
    assert (d.status, d.plan_name, [w.limit for w in d.windows]) == ("charged", "pro",
                                                                     [50, 100])
    usage = await budget.usage(uid, now_ms=T0, plan_name="free")
    assert usage.plan_name == "pro" and [w.used for w in usage.windows] == [30, 30]
    await load(budget, uid, plan="gold", epoch=2)
    d = await budget.reserve(uid, "b", 1, now_ms=T0 + 2 * MIN, plan_name="free")
    assert (d.status, d.plan_name, [w.limit for w in d.windows]) == ("rejected", "free",
                                                                     [10, 20])
    assert (await budget.usage(uid, now_ms=T0, plan_name="free")).plan_name == "free"


async def test_a_cost_above_the_override_plan_raises_and_writes_nothing(redis_client,  # type: ignore[no-untyped-def]
                                                                        uid) -> None:
    """A cost that fits the caller's plan but not the override's raises CostExceedsLimit."""
    budget = budget_on(redis_client)
    await load(budget, uid, plan="tiny")
    with pytest.raises(CostExceedsLimit) as info:
        await budget.reserve(uid, "a", 6, now_ms=T0, plan_name="free")
    assert (info.value.cost, info.value.limit) == (6, 4)
    assert not await redis_client.exists(*user_keys(uid, "log", "ev", "meta"))


async def test_a_plan_change_mid_window_keeps_totals_exact(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Switching free -> pro -> free by override mid-window keeps every window exact."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 100))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "drew", 5, now_ms=T0 + 2 * MIN, plan_name="free")
    assert d.drawn == 5
    await load(budget, uid, grant("g", 100, remaining=95), plan="pro", epoch=2)
    d = await budget.reserve(uid, "pro1", 40, now_ms=T0 + 3 * MIN, plan_name="free")
    # pro's quota counts t - d over its hour: 25 charged, 5 of them drawn, + 40
    assert (d.plan_name, [w.used for w in d.windows], d.drawn) == ("pro", [40, 60], 0)
    await load(budget, uid, grant("g", 100, remaining=95), epoch=3)
    d = await budget.reserve(uid, "free1", 2, now_ms=T0 + 5 * MIN, plan_name="free")
    assert (d.plan_name, d.drawn, d.draws) == ("free", 2, (("g", 2),))
    usage = await budget.usage(uid, now_ms=T0 + 5 * MIN, plan_name="free")
    assert [w.used for w in usage.windows] == [2, 60]  # 67 charged, 7 drawn: t - d
    plain = await TokenBudget(redis_client, PRO).usage(uid, now_ms=T0 + 5 * MIN)
    assert [w.used for w in plain.windows] == [2, 67]  # the full costs, drawn or not


async def test_drawn_tokens_leave_the_quota_with_their_event(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """When a drawing charge leaves the quota window, its drawn part leaves d with it."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 100))
    await fill_quota(budget, uid)
    await budget.reserve(uid, "drew", 6, now_ms=T0 + 2 * MIN, plan_name="free")
    meta = user_keys(uid, "meta")[0]
    assert meta_fields(await redis_client.hget(meta, "m"))[f"d:{HOUR}"] == 6
    later = T0 + 2 * MIN + HOUR  # every charge has left the hour
    usage = await budget.usage(uid, now_ms=later, plan_name="free")
    assert [w.used for w in usage.windows] == [0, 0]
    assert meta_fields(await redis_client.hget(meta, "m"))[f"d:{HOUR}"] == 0
    assert await redis_client.hlen(user_keys(uid, "dr")[0]) == 0
    d = await budget.reserve(uid, "fresh", 10, now_ms=later, plan_name="free")
    assert (d.drawn, [w.used for w in d.windows]) == (0, [10, 10])


async def test_retry_after_on_the_quota_counts_only_quota_parts(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Quota Retry-After skips an oldest event drawn wholly from grants: never early."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 6))
    await fill_quota(budget, uid)
    drew = await budget.reserve(uid, "drew", 5, now_ms=T0 + 2 * MIN, plan_name="free")
    assert drew.drawn == 5 and drew.credit == 1
    events = await budget.usage(uid, now_ms=T0 + 2 * MIN, plan_name="free")
    for e in events.events:
        if e.request_id.startswith("fill"):
            assert await budget.refund(uid, e.request_id, nonce=e.nonce, now_ms=T0 + 2 * MIN)
    await fill_quota(budget, uid, now=T0 + 3 * MIN)  # quota full again, nothing drawn
    now = T0 + 5 * MIN
    d = await budget.reserve(uid, "x", 4, now_ms=now, plan_name="free")
    assert (d.status, d.credit, d.window_s) == ("rejected", 1, 3600.0)
    assert d.retry_after_s * 1000 == T0 + 3 * MIN + HOUR - now  # not "drew"'s exit


async def test_credit_crossings_are_reported_once_and_rearmed(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Low and exhausted are reported once each, again only after a refund above low+margin."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 10))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "a", 7, now_ms=T0 + 2 * MIN, plan_name="free")
    assert d.credit_crossings == ()  # 3 left of 10: above 20%
    d = await budget.reserve(uid, "b", 1, now_ms=T0 + 3 * MIN, plan_name="free")
    assert d.credit_crossings == (CreditCrossing("g", "low", 2, 10, "paid"),)
    d = await budget.reserve(uid, "c", 1, now_ms=T0 + 4 * MIN, plan_name="free")
    assert d.credit_crossings == ()  # still low: not again
    d = await budget.reserve(uid, "d", 1, now_ms=T0 + 5 * MIN, plan_name="free")
    assert d.credit_crossings == (CreditCrossing("g", "exhausted", 0, 10, "paid"),)
    # a refund back to 1 (10%) re-arms nothing; one back to 8 (80%) re-arms both
    first = await budget.usage(uid, now_ms=T0 + 5 * MIN, plan_name="free", events=10)
    nonces = {e.request_id: e.nonce for e in first.events}
    assert await budget.refund(uid, "d", nonce=nonces["d"], now_ms=T0 + 5 * MIN)
    d = await budget.reserve(uid, "e", 1, now_ms=T0 + 6 * MIN, plan_name="free")
    assert d.credit_crossings == ()
    assert await budget.refund(uid, "e", nonce=d.nonce, now_ms=T0 + 6 * MIN)
    assert await budget.refund(uid, "a", nonce=nonces["a"], now_ms=T0 + 6 * MIN)
    d = await budget.reserve(uid, "f", 7, now_ms=T0 + 7 * MIN, plan_name="free")
    assert d.credit_crossings == (CreditCrossing("g", "low", 1, 10, "paid"),)
    d = await budget.reserve(uid, "g", 1, now_ms=T0 + 8 * MIN, plan_name="free")
    assert d.credit_crossings == (CreditCrossing("g", "exhausted", 0, 10, "paid"),)


async def test_a_resent_drawing_reserve_reports_the_same_draws(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A reservation run twice (lost reply) reports its draws both times and draws once."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 10))
    await fill_quota(budget, uid)
    resending = Resending(redis_client)
    twice = budget_on(resending)
    d = await twice.reserve(uid, "x", 3, now_ms=T0 + 2 * MIN, plan_name="free")
    assert (d.status, d.draws, d.drawn, d.epoch, d.credit) == ("charged", (("g", 3),), 3, 1, 7)
    assert await remaining(budget, uid, T0 + 2 * MIN) == {"g": 7}
    # a late duplicate after a reload still names the epoch the draw was made under
    await load(budget, uid, grant("g", 10, remaining=7), epoch=2)
    late = await resending.replay(resending.calls_of(script("budget_reserve"))[-1])
    assert late[0] == 1 and late[3] == b"1 3 7 -1 free|g=3|"  # epoch 1, drew 3, credit 7
    other = await budget.reserve(uid, "x", 3, now_ms=T0 + 2 * MIN, plan_name="free")
    assert (other.status, other.draws) == ("duplicate", ())
    assert await remaining(budget, uid, T0 + 2 * MIN) == {"g": 7}


async def test_a_resent_refund_returns_credit_once(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A refund run twice gives the credit back once, and a late copy gives nothing."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 10))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "x", 3, now_ms=T0 + 2 * MIN, plan_name="free")
    resending = Resending(redis_client)
    lowered = await budget_on(resending).lower(uid, "x", 0, nonce=d.nonce, now_ms=T0 + 2 * MIN)
    assert (lowered.changed, lowered.returned) == (False, ())  # the second run's answer
    assert await remaining(budget, uid, T0 + 2 * MIN) == {"g": 10}
    await resending.replay(resending.calls_of(script("budget_refund"))[-1])
    assert await remaining(budget, uid, T0 + 2 * MIN) == {"g": 10}


async def test_load_is_idempotent_and_refuses_stale_epochs(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Loading twice is harmless; an older epoch, or one below an invalidation's, is refused."""
    budget = budget_on(redis_client)
    resending = budget_on(Resending(redis_client))
    assert await resending.load_entitlements(uid, epoch=3, plan=None, suspended_until_ms=None,
                                             grants=[grant("g", 10)])
    await budget.reserve(uid, "a", 10, now_ms=T0, plan_name="free")
    await budget.reserve(uid, "b", 10, now_ms=T0 + MIN, plan_name="free")
    await budget.reserve(uid, "c", 2, now_ms=T0 + 2 * MIN, plan_name="free")  # draws 2
    # the same epoch again (a second loader, or a late copy) keeps what was drawn since
    assert await budget.load_entitlements(uid, epoch=3, plan=None, suspended_until_ms=None,
                                          grants=[grant("g", 10)])
    assert await remaining(budget, uid, T0 + 2 * MIN) == {"g": 8}
    assert not await budget.load_entitlements(uid, epoch=2, plan="pro",
                                              suspended_until_ms=None, grants=[])
    await budget.invalidate_entitlements(uid, epoch=5)
    assert not await budget.load_entitlements(uid, epoch=4, plan=None,
                                              suspended_until_ms=None, grants=[])
    assert await budget.load_entitlements(uid, epoch=5, plan=None, suspended_until_ms=None,
                                          grants=[grant("g", 10, remaining=8)])
    assert await remaining(budget, uid, T0 + 2 * MIN) == {"g": 8}


async def test_invalidate_twice_and_after_a_newer_load_changes_nothing(redis_client,  # type: ignore[no-untyped-def]
                                                                       uid) -> None:
    """Invalidating twice leaves one marker; an invalidation older than the load is ignored."""
    budget = budget_on(redis_client)
    twice = budget_on(Resending(redis_client))
    ent = user_keys(uid, "ent")[0]
    await twice.invalidate_entitlements(uid, epoch=4)
    assert await redis_client.hgetall(ent) == {b"want": b"4"}
    assert 0 < await redis_client.pttl(ent) <= budget.ent_ttl_ms
    await budget.invalidate_entitlements(uid, epoch=3)
    assert await redis_client.hgetall(ent) == {b"want": b"4"}
    await load(budget, uid, grant("g", 5), epoch=6)
    await twice.invalidate_entitlements(uid, epoch=6)  # the load already has this change
    assert (await budget.usage(uid, now_ms=T0, plan_name="free")).epoch == 6


async def test_load_keeps_credit_flags_of_an_unchanged_grant(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """A reload with a grant's remaining unchanged does not report its low crossing again."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 10), grant("h", 100))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "a", 8, now_ms=T0 + 2 * MIN, plan_name="free")
    assert d.credit_crossings == (CreditCrossing("g", "low", 2, 10, "paid"),)
    await load(budget, uid, grant("g", 10, remaining=2), grant("h", 100), epoch=2)
    d = await budget.reserve(uid, "b", 1, now_ms=T0 + 3 * MIN, plan_name="free")
    assert d.draws == (("g", 1),) and d.credit_crossings == ()


async def test_entitlements_off_ignore_ent_and_run_the_same_commands(redis_client,  # type: ignore[no-untyped-def]
                                                                     uid) -> None:
    """With entitlements off a suspension in ent changes nothing and no ent key is read."""
    on = budget_on(redis_client)
    await load(on, uid, susp=0)
    off = TokenBudget(redis_client, FREE)
    d = await off.reserve(uid, "a", 3, now_ms=T0)
    assert (d.status, d.plan_name, d.epoch, d.credit) == ("charged", "", 0, None)
    keys, _ = off._reserve_call(uid, "b", 1, "", off.windows, T0, "n")
    assert keys == user_keys(uid, "log", "ev", "meta", "pv")
    assert await off.refund(uid, "a", nonce=d.nonce)
    assert (await on.reserve(uid, "c", 1, now_ms=T0, plan_name="free")).status == "suspended"


async def test_a_cost_that_fits_the_callers_plan_is_not_refused_early(redis_client,  # type: ignore[no-untyped-def]
                                                                      uid) -> None:
    """A cost fitting the passed plan but not the default one is charged, not refused."""
    budget = TokenBudget(redis_client, TINY, entitlements=True)
    await load(budget, uid)
    d = await budget.reserve(uid, "a", 9, windows=FREE, now_ms=T0)
    assert (d.status, [w.used for w in d.windows]) == ("charged", [9, 9])
    with pytest.raises(CostExceedsLimit):
        await budget.reserve(uid, "b", 11, windows=FREE, now_ms=T0)


async def test_a_resent_reservation_of_another_call_reports_no_credit(redis_client,  # type: ignore[no-untyped-def]
                                                                      uid) -> None:
    """A second reservation of a charged id (other nonce) draws and reports nothing."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 10))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "fill1", 3, now_ms=T0 + 2 * MIN, plan_name="free")
    assert (d.status, d.draws, d.credit) == ("duplicate", (), None)
    assert await remaining(budget, uid, T0 + 2 * MIN) == {"g": 10}


async def test_usage_read_twice_answers_the_same_and_changes_nothing(redis_client,  # type: ignore[no-untyped-def]
                                                                     uid) -> None:
    """A usage read run twice answers the same and leaves grants and draws unchanged."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 10), plan="pro")
    for i, cost in enumerate((40, 40, 30)):
        d = await budget.reserve(uid, f"r{i}", cost, now_ms=T0 + i * MIN, plan_name="free")
        assert d.status == "charged"
    twice = budget_on(Resending(redis_client))
    first = await budget.usage(uid, now_ms=T0 + 3 * MIN, plan_name="free")
    again = await twice.usage(uid, now_ms=T0 + 3 * MIN, plan_name="free")
    assert first == again
    assert (first.plan_name, [w.used for w in first.windows]) == ("pro", [0, 100])
    assert first.events[0].draws == (("g", 10),) and first.grants[0].remaining == 0
    ent, dr = user_keys(uid, "ent", "dr")
    assert await redis_client.hget(dr, "r2") == b"#1 g=10"
    assert (await redis_client.hget(ent, "g:g")).startswith(b"0 0 paid 0 10")


@pytest.mark.parametrize("change", ["suspended", "invalidated", "smaller plan"])
async def test_a_resent_charge_is_reported_after_the_user_changed(redis_client, uid,  # type: ignore[no-untyped-def]
                                                                  change) -> None:
    """A re-send of a charging call reports its charge and draws after the user changed."""
    budget = budget_on(redis_client)
    await load(budget, uid, grant("g", 10))
    await fill_quota(budget, uid)
    nonce = new_nonce()
    d = await budget.reserve(uid, "x", 6, now_ms=T0 + 2 * MIN, plan_name="free", nonce=nonce)
    assert d.draws == (("g", 6),)
    if change == "suspended":
        await load(budget, uid, grant("g", 10, remaining=4), susp=0, epoch=2)
    elif change == "invalidated":
        await budget.invalidate_entitlements(uid, epoch=2)
    else:
        await load(budget, uid, grant("g", 10, remaining=4), plan="tiny", epoch=2)
    again = await budget.reserve(uid, "x", 6, now_ms=T0 + 2 * MIN, plan_name="free",
                                 nonce=nonce)
    assert (again.status, again.draws, again.epoch) == ("charged", (("g", 6),), 1)
    other = await budget.reserve(uid, "y", 1, now_ms=T0 + 2 * MIN, plan_name="free")
    assert other.status == {"suspended": "suspended", "invalidated": "not_loaded",
                            "smaller plan": "rejected"}[change]
    plain = await TokenBudget(redis_client, FREE).usage(uid, now_ms=T0 + 2 * MIN)
    assert [w.used for w in plain.windows] == [6, 26]


async def test_quota_thresholds_count_what_grants_did_not_cover(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """Quota usage thresholds count t - d: 100% once, none for charges grants then cover."""
    from usage_limits.thresholds import Thresholds

    budget = budget_on(redis_client, thresholds=Thresholds((80, 100), 5))
    await load(budget, uid, grant("g", 50))
    d = await budget.reserve(uid, "a", 8, now_ms=T0, plan_name="free")
    assert [(c.window_s, c.threshold) for c in d.crossings] == [(60.0, 80)]
    d = await budget.reserve(uid, "b", 9, now_ms=T0 + MIN, plan_name="free")
    assert [(c.window_s, c.threshold) for c in d.crossings] == [(60.0, 80), (3600.0, 80)]
    d = await budget.reserve(uid, "c", 7, now_ms=T0 + 2 * MIN, plan_name="free")
    assert d.drawn == 4 and [w.used for w in d.windows] == [7, 20]
    assert [(c.window_s, c.threshold, c.used) for c in d.crossings] == [(3600.0, 100, 20)]
    d = await budget.reserve(uid, "d", 5, now_ms=T0 + 3 * MIN, plan_name="free")
    assert d.drawn == 5 and d.crossings == ()


async def test_an_override_names_its_plan_exactly(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """An override picks the catalog plan of exactly its name, with all its windows."""
    catalog = {"xpro": TINY, "pro2": TINY, "pro": [Window(70, 3600)], "free": FREE}
    budget = TokenBudget(redis_client, FREE, catalog=catalog, entitlements=True)
    await load(budget, uid, plan="pro")
    d = await budget.reserve(uid, "a", 60, now_ms=T0, plan_name="free")
    assert (d.status, d.plan_name, [(w.limit, w.used) for w in d.windows]) == (
        "charged", "pro", [(70, 60)])
    usage = await budget.usage(uid, now_ms=T0, plan_name="free")
    assert (usage.plan_name, [w.limit for w in usage.windows]) == ("pro", [70])


async def test_references_with_separators_round_trip(redis_client, uid) -> None:  # type: ignore[no-untyped-def]
    """References holding = : / + @ . - are drawn, reported, recorded and refunded intact."""
    budget = budget_on(redis_client)
    ref = "inv=12:a/b+c@d.e-f_g"
    await load(budget, uid, grant(ref, 10), grant("x=3", 10, created=1))
    await fill_quota(budget, uid)
    d = await budget.reserve(uid, "r", 10, now_ms=T0 + 2 * MIN, plan_name="free")
    assert d.draws == ((ref, 10),)
    assert d.credit_crossings == (CreditCrossing(ref, "low", 0, 10, "paid"),
                                  CreditCrossing(ref, "exhausted", 0, 10, "paid"))
    d = await budget.reserve(uid, "s", 5, now_ms=T0 + 3 * MIN, plan_name="free")
    assert d.draws == (("x=3", 5),)
    assert d.credit_crossings == ()
    usage = await budget.usage(uid, now_ms=T0 + 3 * MIN, plan_name="free")
    assert [e.draws for e in usage.events[:2]] == [(("x=3", 5),), ((ref, 10),)]
    lowered = await budget.lower(uid, "s", 0, nonce=d.nonce, now_ms=T0 + 3 * MIN)
    assert lowered.returned == (("x=3", 5),)
    assert await remaining(budget, uid, T0 + 3 * MIN) == {ref: 0, "x=3": 10}
