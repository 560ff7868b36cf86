"""The usage records' store, against moto: idempotent puts and lowerings in any order, the
time-ordered statement with its cursor, day totals, active users, and a grant's history."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from moto import mock_aws

from usage_limits.entitlements.charges import ChargeRecord
from usage_limits.entitlements.exceptions import StoreUnavailable
from usage_limits.entitlements.usage import (
    Totals,
    UsageRecord,
    day_totals,
    decode_cursor,
    grant_history,
    hours,
    month_span,
    span_totals,
)
from usage_limits.entitlements.usage_store import UsageSettings, UsageStore
from usage_limits.exceptions import InvalidArgument

T0 = 1_793_491_200_000  # 2026-11-01T00:00:00Z
HOUR = 3_600_000
DAY = 86_400_000


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[UsageStore]:
    """A usage store on a fresh moto table."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        s = UsageStore(UsageSettings(table="usage", region="us-east-1"))
        s.create_table()
        yield s


def record(rid: str, at_ms: int, cost: int = 10, *, user: str = "u1", nonce: str = "n1",
           draws: tuple[tuple[str, int], ...] = ()) -> UsageRecord:
    return UsageRecord(user, rid, nonce, "POST /v1/structured", "free", cost, cost, draws,
                       "charged", at_ms)


def test_a_put_is_idempotent_and_lowering_moves_it_once(store: UsageStore) -> None:
    """A re-sent put changes nothing; a settle then a refund lower the record, and each
    lowering repeated (or one to a higher kept) leaves it as it is."""
    r = record("r1", T0, draws=(("g1", 4),))
    assert store.put(r) is True
    assert store.put(r) is False
    assert store.get("u1", "r1", "n1") == r
    assert store.lower("u1", "r1", "n1", 3, "settled", T0 + 5) is True
    assert store.lower("u1", "r1", "n1", 3, "settled", T0 + 9) is False
    assert store.lower("u1", "r1", "n1", 7, "settled", T0 + 9) is False  # never raised
    assert store.put(r) is False  # a put re-sent late keeps the lowering
    got = store.get("u1", "r1", "n1")
    assert got == r.lowered(3, "settled", T0 + 5)
    assert store.lower("u1", "r1", "n1", 0, "support-refunded", T0 + 20) is True
    got = store.get("u1", "r1", "n1")
    assert got is not None and (got.kept, got.state, got.changed_ms) == (
        0, "support-refunded", T0 + 20)
    assert got.refunded == 10 and got.credit == 4


def test_a_lowering_before_its_put_ends_in_the_same_record(store: UsageStore) -> None:
    """A refund whose record's put has not landed yet makes a partial record; the put then
    completes it without undoing the refund."""
    assert store.lower("u1", "r2", "n1", 0, "refunded", T0 + 50) is True
    partial = store.get("u1", "r2", "n1")
    assert partial is not None and partial.partial and partial.kept == 0
    assert store.put(record("r2", T0)) is False
    got = store.get("u1", "r2", "n1")
    assert got == record("r2", T0).lowered(0, "refunded", T0 + 50)


def test_bad_lowerings_are_refused_before_anything_is_written(store: UsageStore) -> None:
    """A negative kept, or a state that does not match it, is InvalidArgument."""
    for kept, state in ((-1, "refunded"), (0, "settled"), (3, "refunded"), (3, "charged")):
        with pytest.raises(InvalidArgument):
            store.lower("u1", "r3", "n1", kept, state, T0)  # type: ignore[arg-type]
    assert store.get("u1", "r3", "n1") is None


def test_history_is_newest_first_paginated_and_only_the_users_own(store: UsageStore) -> None:
    """Pages of two walk five records newest first within [from, to), a cursor ends the
    last page, and another user's records never appear."""
    for i in range(6):
        store.put(record(f"r{i}", T0 + i * HOUR))
    store.put(record("other", T0 + 2 * HOUR, user="u2"))
    seen, cursor = [], None
    while True:
        page = store.history("u1", T0, T0 + 5 * HOUR, cursor, 2)
        seen += [r.request_id for r in page.records]
        if page.cursor is None:
            break
        cursor = page.cursor
    assert seen == ["r4", "r3", "r2", "r1", "r0"]
    assert [r.request_id for r in store.records("u2", T0, T0 + DAY)] == ["other"]


def test_bad_spans_and_cursors_are_invalid(store: UsageStore) -> None:
    """A span that ends before it starts, a cursor of garbage or of another span, and a
    limit out of range are InvalidArgument."""
    with pytest.raises(InvalidArgument):
        store.history("u1", T0, T0)
    with pytest.raises(InvalidArgument):
        store.history("u1", T0, T0 + DAY, "not-a-cursor")
    store.put(record("a", T0 + 1))
    store.put(record("b", T0 + 2))
    page = store.history("u1", T0, T0 + DAY, None, 1)
    assert page.cursor is not None and decode_cursor(page.cursor).at_ms == T0 + 2
    with pytest.raises(InvalidArgument):
        store.history("u1", T0 + DAY, T0 + 2 * DAY, page.cursor)
    with pytest.raises(InvalidArgument, match="cursor belongs to the statement from "
                                              "2026-11-01T00:00:00.000Z to 2026-11-02"):
        store.history("u1", T0, T0 + DAY + 1, page.cursor)  # the record is in both spans
    with pytest.raises(InvalidArgument):
        store.history("u1", T0, T0 + DAY, None, 0)


def test_day_totals_split_at_utc_midnight_across_a_month_boundary(store: UsageStore) -> None:
    """Records either side of midnight of 31 October / 1 November count on their own UTC
    days, with kept, refunded and credit drawn; every day of the span is listed, the days
    without records with zeros, and the span's totals are the sum of its days."""
    store.put(record("late", T0 - 1, cost=8, draws=(("g1", 8),)))
    store.put(record("early", T0, cost=10))
    store.lower("u1", "early", "n1", 0, "refunded", T0 + 1)
    oct_start, oct_end = month_span("2026-10")
    assert oct_end == T0 and month_span("2026-11")[0] == T0
    every = store.records("u1", oct_start, T0 + DAY)
    totals = day_totals(every, oct_start, T0 + DAY)
    assert [d.day for d in totals] == ["2026-11-01"] + [f"2026-10-{n:02}"
                                                        for n in range(31, 0, -1)]
    assert [(d.day, *vars(d.totals).values()) for d in totals[:3]] == [
        ("2026-11-01", 1, 10, 1, 10, 0, 0), ("2026-10-31", 1, 8, 0, 0, 8, 8),
        ("2026-10-30", 0, 0, 0, 0, 0, 0)]
    assert span_totals(every, oct_start, T0 + DAY) == Totals(
        charges=2, reserved=18, refunds=1, refunded=10, kept=8, credit=8)
    # a span ending at midnight does not touch the day it ends on
    assert [d.day for d in day_totals(every, T0 - DAY, T0)] == ["2026-10-31"]
    assert [r.request_id for r in store.records("u1", *month_span("2026-11"))] == ["early"]


def test_active_users_are_read_per_hour_without_a_scan(store: UsageStore) -> None:
    """Markers name the users active in the hours of a span; users active outside it are
    not listed, and a span too long is refused."""
    store.mark_active("u1", T0 + 10)
    store.mark_active("u1", T0 + 20)
    store.mark_active("u2", T0 + HOUR + 5)
    store.mark_active("u3", T0 + 5 * HOUR)
    assert store.active_users(T0, T0 + 2 * HOUR) == ["u1", "u2"]
    assert store.active_users(T0 + HOUR, T0 + HOUR + 1) == ["u2"]
    assert hours(T0 + 30, T0 + HOUR + 1) == ["2026-11-01T00", "2026-11-01T01"]
    with pytest.raises(InvalidArgument):
        store.active_users(T0, T0 + 100 * DAY)


def test_records_expire_after_the_configured_days(store: UsageStore) -> None:
    """A record's time to live is its instant plus ATTO_USAGE_RECORDS_DAYS."""
    store.put(record("t", T0))
    item = store.client.get_item(TableName="usage", Key={"pk": {"S": "U#u1"},
                                                         "sk": {"S": "t#n1"}})["Item"]
    assert int(item["ttl"]["N"]) == T0 // 1000 + 400 * 86400
    assert UsageSettings.from_env({"ATTO_USAGE_TABLE": "x",
                                   "ATTO_USAGE_RECORDS_DAYS": "30"}).record_days == 30
    for bad in ("0", "ten"):
        with pytest.raises(InvalidArgument):
            UsageSettings.from_env({"ATTO_USAGE_TABLE": "x", "ATTO_USAGE_RECORDS_DAYS": bad})


def test_a_missing_table_is_store_unavailable(store: UsageStore) -> None:
    """DynamoDB refusing the call (no such table) is StoreUnavailable."""
    other = UsageStore(UsageSettings(table="nope", region="us-east-1"))
    with pytest.raises(StoreUnavailable):
        other.put(record("x", T0))


def test_a_record_refuses_to_keep_more_than_it_cost() -> None:
    """A record keeping more than its cost, or refunded while keeping tokens, is invalid."""
    with pytest.raises(InvalidArgument):
        UsageRecord("u", "r", "n", "POST /v1/x", "free", 5, 6)
    with pytest.raises(InvalidArgument):
        UsageRecord("u", "r", "n", "POST /v1/x", "free", 5, 2, state="refunded")


def test_grant_history_lists_creation_draws_returns_void_and_expiry() -> None:
    """A grant's history comes from its item and the charges that drew from it, in time
    order; charges drawing only from other grants are left out."""
    item = {"reference": "inv_1", "tokens": 100, "at": T0, "actor": "arn:op",
            "reason": "bought", "void_at": T0 + 50, "void_actor": "arn:op",
            "void_reason": "chargeback", "expired_at": T0 + 90, "forfeited": 60}
    charges = [
        ChargeRecord("r1", "n1", 30, 0, (("inv_1", 30),), returned=(("inv_1", 30),),
                     state="returned", at_ms=T0 + 10, changed_ms=T0 + 11),
        ChargeRecord("r2", "n1", 40, 40, (("inv_1", 25), ("promo", 15)), at_ms=T0 + 20),
        ChargeRecord("r3", "n1", 5, 5, (("promo", 5),), at_ms=T0 + 30),
    ]
    events = [(e.kind, e.at_ms - T0, e.tokens, e.request_id)
              for e in grant_history(item, charges)]
    assert events == [("created", 0, 100, None), ("draw", 10, 30, "r1"),
                      ("return", 11, 30, "r1"), ("draw", 20, 25, "r2"),
                      ("void", 50, 0, None), ("expired", 90, 60, None)]
