"""One request's transfer against moto: the DynamoDB calls a request makes, and every
outcome told truly when DynamoDB refuses, conflicts or loses an answer."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from tests.dynamofaults import FaultPlan, FaultyClient
from usage_limits.credit import State, TransferBook, outbox
from usage_limits.credit.request import RequestTransfer, abandoned_of
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore

HOLD_MS = 30_000


class Counting:
    """A client that counts the calls made through it, by operation."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._inner, name)
        if not callable(real) or name.startswith("_") or name in ("meta", "exceptions"):
            return real

        def call(**kwargs: Any) -> Any:
            self.calls[name] += 1
            return real(**kwargs)
        return call


class Rig:
    """A store, a book whose calls are counted and can fail, and one user's grant."""

    def __init__(self) -> None:
        settings = StoreSettings(table="entitlements", region="us-east-1")
        raw = boto3.client("dynamodb", region_name="us-east-1")
        self.store = EntitlementStore(settings, client=raw)
        self.store.create_table()
        self.plan = FaultPlan()
        self.counting = Counting(FaultyClient(raw, self.plan))
        self.book = TransferBook(settings, client=self.counting)
        self.now = int(time.time() * 1000)
        self.store.create_grant("u", tokens=20, kind="paid", reference="g", expires_at_ms=None,
                                actor="op", reason="test")
        self.hint = self.store.load("u").grants

    def request(self, rid: str = "r", hold_ms: int = HOLD_MS) -> RequestTransfer:
        self.counting.calls.clear()
        return RequestTransfer(self.book, "u", rid, "n", hold_ms=self.now + hold_ms,
                               route="/v1/x", plan="free")

    def consumed(self) -> int:
        return self.store.load("u").grants[0].consumed

    def stored(self, rid: str = "r") -> Any:
        return self.book.get("u", rid, "n")


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    """A fresh table on moto and an empty outbox."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    outbox.clear()
    with mock_aws():
        yield Rig()
    outbox.clear()


async def test_a_credit_request_makes_two_calls_when_it_succeeds(rig: Rig) -> None:
    """Reserve (one transaction) and post (one update): two DynamoDB calls in all."""
    req = rig.request()
    assert (await req.reserve(8, 5, rig.hint)).outcome == "go"
    assert await req.post(8) == "posted"
    assert sum(rig.counting.calls.values()) == 2 and rig.consumed() == 5


async def test_a_credit_request_makes_two_calls_when_it_fails(rig: Rig) -> None:
    """Reserve and void: two DynamoDB calls, and the credit is back."""
    req = rig.request()
    await req.reserve(8, 5, rig.hint)
    assert await req.void()
    assert sum(rig.counting.calls.values()) == 2 and rig.consumed() == 0
    assert rig.stored().state is State.VOIDED


async def test_a_quota_only_request_writes_its_item_and_posts_it(rig: Rig) -> None:
    """A charge the quota covers has no legs: one update to reserve, one to post."""
    req = rig.request()
    await req.reserve(3, 0)
    assert await req.post(2) == "posted"
    assert rig.counting.calls == Counter(update_item=2)
    assert (rig.stored().kept, rig.stored().legs) == (2, ())


async def test_a_refusal_writes_nothing_and_says_what_credit_there_is(rig: Rig) -> None:
    """More credit than the grants hold: refused, with the balance, nothing written."""
    opened = await rig.request().reserve(30, 25, rig.hint)
    assert (opened.outcome, opened.credit) == ("refused", 20)
    assert rig.stored() is None and rig.consumed() == 0


@pytest.mark.parametrize("kind", ["lost", "throttle"])
async def test_a_reservation_without_an_answer_is_undone(rig: Rig, kind: str) -> None:
    """A reservation that lands with its answer lost, or is refused, is voided at once: the
    request can say nothing was charged."""
    rig.plan.arm(kind, "transact_write_items")
    opened = await rig.request().reserve(8, 5, rig.hint)
    assert opened.outcome == "undone" and rig.consumed() == 0
    assert rig.stored().state is State.VOIDED


async def test_a_void_without_an_answer_waits_in_the_outbox(rig: Rig) -> None:
    """When neither the reservation nor its void answers, the void is kept and lands later;
    the reservation can never land after it."""
    rig.plan.arm("lost", "transact_write_items")
    rig.plan.arm("throttle", "get_item")
    assert (await rig.request().reserve(8, 5, rig.hint)).outcome == "unknown"
    assert outbox.kept() == 1 and rig.consumed() == 5
    assert await outbox.retry() == 1
    assert outbox.kept() == 0 and rig.consumed() == 0


async def test_a_lost_post_is_sent_again_and_stands_once(rig: Rig) -> None:
    """A post whose answer was lost is sent again and answered as posted."""
    req = rig.request()
    await req.reserve(8, 5, rig.hint)
    rig.plan.arm("lost", "update_item")
    assert await req.post(8) == "posted" and rig.consumed() == 5


@pytest.mark.parametrize("first, state", [("throttle", State.VOIDED),
                                          ("lost", State.REVERSED)])
async def test_a_post_never_answered_is_undone_by_the_outbox(rig: Rig, first: str,
                                                             state: State) -> None:
    """A post that answers neither time withholds the answer; the outbox voids the
    transfer, or reverses it when the first post had landed."""
    req = rig.request()
    await req.reserve(8, 5, rig.hint)
    rig.plan.arm(first, "update_item")
    rig.plan.arm("throttle", "update_item")
    assert await req.post(8) == "unknown"
    assert await outbox.retry() == 1
    assert rig.stored().state is state and rig.consumed() == 0


async def test_a_killed_request_is_voided_by_the_users_next_load(rig: Rig) -> None:
    """A request killed after its reservation leaves a pending transfer; once its hold has
    ended, the user's next load of the cache voids it and the credit comes back."""
    await rig.request("killed", hold_ms=10).reserve(8, 5, rig.hint)
    assert abandoned_of(rig.book, "u", rig.now) == 0  # within its hold
    assert abandoned_of(rig.book, "u", rig.now + 11) == 1
    assert rig.stored("killed").state is State.VOIDED and rig.consumed() == 0


async def test_a_request_past_its_hold_cannot_post(rig: Rig) -> None:
    """A post after the hold finds the transfer abandoned: it is voided, not served."""
    req = rig.request(hold_ms=-1)
    await req.reserve(8, 5, rig.hint)
    assert await req.post(8) == "voided" and rig.consumed() == 0


async def test_a_void_after_the_post_leaves_the_charge_standing(rig: Rig) -> None:
    """Voiding a transfer that was posted changes nothing and says it is not voided."""
    req = rig.request()
    await req.reserve(8, 5, rig.hint)
    assert await req.post(8) == "posted"
    assert not await req.void()
    assert rig.stored().state is State.POSTED and rig.consumed() == 5
