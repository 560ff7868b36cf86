"""The transfer state machine and the legs, pure: the table, ``apply``, draw order, returns."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from usage_limits.credit import TRANSITIONS, Event, Result, State, apply
from usage_limits.credit.legs import Back, Leg, drawn, give_back, merge_back, plan_legs, standing
from usage_limits.entitlements.models import Change, Grant


def test_the_table_has_one_row_per_state_and_event() -> None:
    """Every (state, event) pair, abandoned pending included, has exactly one row."""
    keys = [(t.source, t.abandoned, t.event) for t in TRANSITIONS]
    assert len(keys) == len(set(keys))
    sources: list[tuple[State | None, bool]] = [(None, False), *((s, False) for s in State),
                                                 (State.PENDING, True)]
    assert set(keys) == {(s, a, e) for (s, a), e in itertools.product(sources, Event)}


def test_reapplying_what_happened_is_exists() -> None:
    """An event applied to the state it leads to answers exists and writes nothing."""
    for event, state in ((Event.RESERVE, State.PENDING), (Event.POST, State.POSTED),
                         (Event.VOID, State.VOIDED), (Event.REVERSE, State.REVERSED)):
        row = apply(state, event)
        assert row.result is Result.EXISTS and not row.writes


def test_refusals_are_named_for_the_state_that_refuses() -> None:
    """A void of a posted transfer is already_posted; a post of a voided one already_voided."""
    assert apply(State.POSTED, Event.VOID).result is Result.ALREADY_POSTED
    assert apply(State.VOIDED, Event.POST).result is Result.ALREADY_VOIDED
    assert apply(State.REVERSED, Event.VOID).result is Result.ALREADY_REVERSED
    assert apply(State.PENDING, Event.REVERSE).result is Result.NOT_POSTED
    assert apply(None, Event.POST).result is Result.NOT_FOUND


def test_an_abandoned_transfer_is_voided_by_whoever_finds_it() -> None:
    """Past its hold, a post answers expired and writes the void; a void applies."""
    post = apply(State.PENDING, Event.POST, abandoned=True)
    assert post.result is Result.EXPIRED and post.target is State.VOIDED and post.hold == "past"
    assert apply(State.PENDING, Event.VOID, abandoned=True).result is Result.APPLIED
    assert apply(State.PENDING, Event.POST).hold == "live"
    # abandoned means nothing for a transfer that is not pending
    assert apply(State.POSTED, Event.POST, abandoned=True).result is Result.EXISTS


def test_only_pending_leaves_for_posted_or_voided_and_only_posted_is_reversed() -> None:
    """The writes of the table move pending to posted or voided, posted to reversed, and
    nothing to voided."""
    moves = {(t.source, t.target) for t in TRANSITIONS if t.writes}
    assert moves == {(None, State.PENDING), (None, State.VOIDED),
                     (State.PENDING, State.POSTED), (State.PENDING, State.VOIDED),
                     (State.POSTED, State.REVERSED)}


def _grant(ref: str, tokens: int, *, kind: str = "paid", expires: int | None = None,
           created: int = 0, consumed: int = 0) -> Grant:
    return Grant(ref, tokens, consumed, kind, expires, Change("op", "r", created))  # type: ignore[arg-type]


def test_legs_draw_earliest_expiry_first_and_promo_before_paid() -> None:
    """Draw order: earliest expiry, promo before paid at equal expiry, no expiry last."""
    grants = [_grant("never", 10), _grant("paid", 3, expires=5000),
              _grant("promo", 3, kind="promo", expires=5000), _grant("soon", 2, expires=4000),
              _grant("gone", 9, expires=100), _grant("spent", 4, expires=4500, consumed=4)]
    assert plan_legs(grants, 12, now_ms=1000) == (
        Leg("soon", 2), Leg("promo", 3), Leg("paid", 3), Leg("never", 4))
    assert drawn(plan_legs(grants, 99, now_ms=1000)) == 18


@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.data())
def test_give_back_takes_last_leg_first_and_never_more_than_stands(
        sizes: list[int], data: st.DataObject) -> None:
    """What leaves a transfer comes off its legs in reverse order, at most what stands."""
    legs = tuple(Leg(f"g{i}", n) for i, n in enumerate(sizes))
    back: tuple[Back, ...] = ()
    for _ in range(3):
        amount = data.draw(st.integers(0, 20))
        out = give_back(legs, back, amount)
        assert drawn(out) == min(amount, drawn(standing(legs, back)))
        back = merge_back(back, (Back(leg.grant, leg.tokens) for leg in out))
        for leg in legs:
            assert sum(b.returned for b in back if b.grant == leg.grant) <= leg.tokens
    if back:
        assert back[0].grant == legs[-1].grant


def test_what_a_transfer_stands_for_as_every_reader_counts_it() -> None:
    """Posted counts its kept tokens, pending its reservation until the hold ends, and
    voided, reversed or abandoned nothing."""
    from usage_limits.credit import Transfer

    pending = Transfer("u", "r", "n", State.PENDING, 8, hold_ms=100)
    assert (pending.charged(99), pending.charged(100)) == (8, 0)
    assert Transfer("u", "r", "n", State.POSTED, 8, kept=5).charged(10**13) == 5
    for state in (State.VOIDED, State.REVERSED):
        assert Transfer("u", "r", "n", state, 8).charged(0) == 0


def test_consumption_counts_legs_less_returns_and_keeps_forfeits() -> None:
    """A grant's consumption is its legs less what came back to it; forfeits stay."""
    from usage_limits.credit.legs import consumed_by

    transfers = [((Leg("a", 5), Leg("b", 2)), (Back("b", 2, 0), Back("a", 1, 3))),
                 ((Leg("a", 4),), ())]
    assert consumed_by(transfers) == {"a": 8, "b": 0}


def test_a_charge_draws_from_at_most_max_legs_grants() -> None:
    """However many small grants a user has, one transfer has at most MAX_LEGS legs, so it
    always fits one DynamoDB transaction."""
    from usage_limits.credit.legs import MAX_LEGS

    grants = [_grant(f"g{i:03d}", 1, created=i) for i in range(MAX_LEGS + 5)]
    legs = plan_legs(grants, MAX_LEGS + 5, now_ms=0)
    assert len(legs) == MAX_LEGS and drawn(legs) == MAX_LEGS
