"""The transfer book against moto: legs, post, void, reverse, abandonment, the sweep, and
every write idempotent on re-send and on "applied but answer lost"."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import boto3
import pytest
from moto import mock_aws

from tests.dynamofaults import FaultPlan, FaultyClient
from usage_limits.credit import Answer, Back, Leg, Result, State, TransferBook
from usage_limits.entitlements import StoreUnavailable
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore

HOLD_MS = 30_000


class Books:
    """A store and a book sharing one faulty moto client."""

    def __init__(self) -> None:
        settings = StoreSettings(table="entitlements", region="us-east-1")
        self.plan = FaultPlan()
        raw = boto3.client("dynamodb", region_name="us-east-1")
        EntitlementStore(settings, client=raw).create_table()
        client = FaultyClient(raw, self.plan)
        self.store = EntitlementStore(settings, client=client)
        self.book = TransferBook(settings, client=client)
        self.now = int(time.time() * 1000)

    def grant(self, user: str, ref: str, tokens: int, *, kind: str = "paid",
              expires_in_ms: int | None = None) -> None:
        self.store.create_grant(user, tokens=tokens, kind=kind, reference=ref,
                                expires_at_ms=None if expires_in_ms is None
                                else self.now + expires_in_ms,
                                actor="op", reason="test", now_ms=self.now)

    def consumed(self, user: str) -> dict[str, int]:
        return {g.reference: g.consumed for g in self.store.load(user).grants}


@pytest.fixture
def books(monkeypatch: pytest.MonkeyPatch) -> Iterator[Books]:
    """A fresh table on moto."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        yield Books()


def test_reserve_draws_legs_in_draw_order_and_post_keeps_the_cost(books: Books) -> None:
    """A reservation takes its credit from the earliest-expiring grant first; a post at the
    full cost keeps every leg."""
    books.grant("u", "late", 10)
    books.grant("u", "soon", 3, kind="promo", expires_in_ms=60_000)
    made = books.book.reserve("u", "r1", "n1", reserved=8, credit=5,
                              hold_ms=books.now + HOLD_MS, route="/v1/x", plan="free",
                              now_ms=books.now)
    assert made.result is Result.APPLIED and made.transfer is not None
    assert made.transfer.legs == (Leg("soon", 3), Leg("late", 2))
    assert books.consumed("u") == {"late": 2, "soon": 3}
    posted = books.book.post(made.transfer, 8, now_ms=books.now + 1)
    assert posted.result is Result.APPLIED and posted.transfer is not None
    assert (posted.transfer.state, posted.transfer.kept, posted.moved) == (State.POSTED, 8, ())
    stored = books.book.get("u", "r1", "n1")
    assert stored == posted.transfer and stored.route == "/v1/x" and stored.plan == "free"


def test_post_below_the_reservation_returns_credit_last_leg_first(books: Books) -> None:
    """Keeping less than reserved gives the credit part back, from the last leg drawn."""
    books.grant("u", "a", 3, expires_in_ms=60_000)
    books.grant("u", "b", 10)
    made = books.book.reserve("u", "r", "n", reserved=9, credit=6,
                              hold_ms=books.now + HOLD_MS, now_ms=books.now)
    assert made.transfer is not None
    posted = books.book.post(made.transfer, 5, now_ms=books.now)
    assert posted.moved == (Back("b", 3, 0), Back("a", 1, 0))
    assert books.consumed("u") == {"a": 2, "b": 0}
    assert posted.transfer is not None and posted.transfer.credit_standing == 2


def test_a_reservation_beyond_the_credit_writes_nothing(books: Books) -> None:
    """Asking more credit than the live grants hold answers exceeds_credit with the balance."""
    books.grant("u", "a", 4)
    answer = books.book.reserve("u", "r", "n", reserved=10, credit=5,
                                hold_ms=books.now + HOLD_MS, now_ms=books.now)
    assert (answer.result, answer.credit, answer.transfer) == (Result.EXCEEDS_CREDIT, 4, None)
    assert books.book.get("u", "r", "n") is None and books.consumed("u") == {"a": 0}


def test_a_stale_hint_costs_a_reread_never_an_overdraw(books: Books) -> None:
    """Legs planned from grants that say more than DynamoDB holds are refused by the cap; the
    book re-reads the grants and draws what is there."""
    books.grant("u", "a", 5, expires_in_ms=60_000)
    books.grant("u", "b", 5)
    hint = books.book.grants("u")
    books.book.reserve("u", "other", "n", reserved=4, credit=4, hold_ms=books.now + HOLD_MS,
                       now_ms=books.now)
    made = books.book.reserve("u", "r", "n", reserved=3, credit=3, grants=hint,
                              hold_ms=books.now + HOLD_MS, now_ms=books.now)
    assert made.transfer is not None and made.transfer.legs == (Leg("a", 1), Leg("b", 2))
    assert books.consumed("u") == {"a": 5, "b": 2} and made.grants
    late = books.book.reserve("u", "r2", "n", reserved=4, credit=4, grants=hint,
                              hold_ms=books.now + HOLD_MS, now_ms=books.now)
    assert late.result is Result.EXCEEDS_CREDIT and late.credit == 3


def test_void_returns_every_leg_and_forfeits_a_voided_grant(books: Books) -> None:
    """A void gives each leg back; a leg whose grant was voided meanwhile is forfeited and
    stays consumed."""
    books.grant("u", "a", 2, expires_in_ms=60_000)
    books.grant("u", "b", 5)
    made = books.book.reserve("u", "r", "n", reserved=4, credit=4,
                              hold_ms=books.now + HOLD_MS, now_ms=books.now)
    books.store.void_grant("u", "a", actor="op", reason="chargeback", now_ms=books.now)
    voided = books.book.void("u", "r", "n", known=made.transfer, now_ms=books.now)
    assert voided.result is Result.APPLIED
    assert set(voided.moved) == {Back("b", 2, 0), Back("a", 0, 2)}
    assert books.consumed("u") == {"a": 2, "b": 0}
    assert books.book.void("u", "r", "n", now_ms=books.now).result is Result.EXISTS


def test_a_void_of_nothing_keeps_a_late_reservation_out(books: Books) -> None:
    """Voiding a transfer never made writes a stub: its reservation can no longer land."""
    books.grant("u", "a", 5)
    assert books.book.void("u", "r", "n", now_ms=books.now).result is Result.APPLIED
    late = books.book.reserve("u", "r", "n", reserved=2, credit=2,
                              hold_ms=books.now + HOLD_MS, now_ms=books.now)
    assert late.result is Result.ALREADY_VOIDED and books.consumed("u") == {"a": 0}


def test_an_abandoned_transfer_cannot_post_and_is_voided_by_the_sweep(books: Books) -> None:
    """Past its hold a post answers expired and voids it; the sweep voids the others."""
    books.grant("u", "a", 9)
    first = books.book.reserve("u", "r1", "n", reserved=3, credit=3,
                               hold_ms=books.now + 10, now_ms=books.now)
    books.book.reserve("u2", "r2", "n", reserved=1, credit=0, hold_ms=books.now + 10,
                       now_ms=books.now)
    assert first.transfer is not None
    late = books.book.post(first.transfer, 3, now_ms=books.now + 11)
    assert late.result is Result.EXPIRED and late.transfer is not None
    assert late.transfer.state is State.VOIDED and books.consumed("u") == {"a": 0}
    assert books.book.abandoned(0, books.now) == []
    assert books.book.sweep(books.now + 11) == 1
    assert books.book.get("u2", "r2", "n").state is State.VOIDED  # type: ignore[union-attr]
    assert books.book.sweep(books.now + 11) == 0


def test_the_sweep_leaves_a_transfer_within_its_hold(books: Books) -> None:
    """A pending transfer whose request may still post is neither swept nor resolved."""
    books.book.reserve("u", "r", "n", reserved=1, credit=0, hold_ms=books.now + HOLD_MS,
                       now_ms=books.now)
    assert books.book.sweep(books.now) == 0
    assert books.book.resolve_abandoned("u", "r", "n", now_ms=books.now).result \
        is Result.NOT_POSTED


def test_reverse_returns_what_a_posted_transfer_still_draws(books: Books) -> None:
    """Support's reversal gives back the credit the post kept; only once."""
    books.grant("u", "a", 9)
    made = books.book.reserve("u", "r", "n", reserved=6, credit=6,
                              hold_ms=books.now + HOLD_MS, now_ms=books.now)
    assert made.transfer is not None
    books.book.post(made.transfer, 4, now_ms=books.now)
    assert books.book.void("u", "r", "n", now_ms=books.now).result is Result.ALREADY_POSTED
    reversed_ = books.book.reverse("u", "r", "n", now_ms=books.now)
    assert reversed_.result is Result.APPLIED and reversed_.moved == (Back("a", 4, 0),)
    assert books.consumed("u") == {"a": 0}
    assert books.book.reverse("u", "r", "n", now_ms=books.now).result is Result.EXISTS


@pytest.mark.parametrize("operation", ["reserve", "post", "void"])
@pytest.mark.parametrize("kind", ["lost", "throttle"])
def test_every_write_lands_once_when_sent_again(books: Books, operation: str,
                                                kind: str) -> None:
    """A write refused, or applied with its answer lost, is sent again and lands once."""
    books.grant("u", "a", 9)

    def reserve() -> Answer:
        return books.book.reserve("u", "r", "n", reserved=4, credit=4,
                                  hold_ms=books.now + HOLD_MS, now_ms=books.now)

    made = None if operation == "reserve" else reserve()
    send: Callable[[], Answer] = {"reserve": reserve,
            "post": lambda: books.book.post(made.transfer, 2, now_ms=books.now),  # type: ignore[union-attr,arg-type]
            "void": lambda: books.book.void("u", "r", "n", now_ms=books.now)}[operation]
    books.plan.arm(kind, "transact_write_items")
    with pytest.raises(StoreUnavailable):
        send()
    answer = send()
    assert answer.ok
    expected = {"reserve": 4, "post": 2, "void": 0}[operation]
    assert books.consumed("u") == {"a": expected}


def test_a_resent_reservation_that_took_the_last_credit_is_exists(books: Books) -> None:
    """A reservation whose answer was lost after it drew the last credit is answered exists
    when sent again, not refused for the credit it took itself."""
    books.grant("u", "a", 4)

    def reserve() -> Answer:
        return books.book.reserve("u", "r", "n", reserved=4, credit=4,
                                  hold_ms=books.now + HOLD_MS, now_ms=books.now)

    books.plan.arm("lost", "transact_write_items")
    with pytest.raises(StoreUnavailable):
        reserve()
    assert reserve().result is Result.EXISTS and books.consumed("u") == {"a": 4}


def test_a_conflict_is_retried_inside_the_call(books: Books) -> None:
    """A transaction cancelled for a conflict is retried; the reservation lands once."""
    books.grant("u", "a", 9)
    books.plan.arm("conflict", "transact_write_items", times=2)
    made = books.book.reserve("u", "r", "n", reserved=4, credit=4,
                              hold_ms=books.now + HOLD_MS, now_ms=books.now)
    assert made.result is Result.APPLIED and books.consumed("u") == {"a": 4}


def test_a_leg_of_an_expired_grant_is_forfeited_on_void(books: Books) -> None:
    """Credit going back to a grant that has expired since is forfeited: it stays consumed."""
    books.grant("u", "short", 5, expires_in_ms=1_000)
    made = books.book.reserve("u", "r", "n", reserved=3, credit=3,
                              hold_ms=books.now + HOLD_MS, now_ms=books.now)
    voided = books.book.void("u", "r", "n", known=made.transfer, now_ms=books.now + 1_000)
    assert voided.moved == (Back("short", 0, 3),) and books.consumed("u") == {"short": 3}


def test_a_reversal_commits_with_its_extra_items_or_not_at_all(books: Books) -> None:
    """An extra item whose condition fails (a support record already there) stops the
    reversal: nothing is written and ExtraRefused names the item."""
    from usage_limits.credit import ExtraRefused

    books.grant("u", "a", 9)
    made = books.book.reserve("u", "r", "n", reserved=4, credit=4,
                              hold_ms=books.now + HOLD_MS, now_ms=books.now)
    assert made.transfer is not None
    books.book.post(made.transfer, 4, now_ms=books.now)
    marker = {"Put": {"TableName": "entitlements",
                      "Item": {"pk": {"S": "U#u"}, "sk": {"S": "X#support"}},
                      "ConditionExpression": "attribute_not_exists(pk)"}}
    books.store.client.put_item(TableName="entitlements", Item=marker["Put"]["Item"])
    with pytest.raises(ExtraRefused) as refused:
        books.book.reverse("u", "r", "n", extra=lambda moved: [marker], now_ms=books.now)
    assert refused.value.index == 0
    assert books.book.get("u", "r", "n").state is State.POSTED  # type: ignore[union-attr]
    assert books.consumed("u") == {"a": 4}
