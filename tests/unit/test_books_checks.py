"""The conservation auditor's pure parts: its checks, the ledger read's decoding, the
recheck, the sample and its settings (no servers)."""

from __future__ import annotations

from typing import Any

import pytest

from usage_limits.entitlements.audit import (
    CachedGrant,
    Divergence,
    LedgerCharge,
    LedgerView,
    check_credit,
    check_grants,
    confirmed,
    parse_view,
)
from usage_limits.entitlements.auditor import Auditor, AuditSettings, sampled
from usage_limits.entitlements.charges import ChargeRecord
from usage_limits.entitlements.models import Change, Grant
from usage_limits.exceptions import InvalidArgument

NOW = 1_800_000_000_000
BOUND = 300_000


def grant(reference: str = "inv", tokens: int = 100, consumed: int = 0,
          created_ms: int = NOW - 86_400_000) -> Grant:
    return Grant(reference=reference, tokens=tokens, consumed=consumed, kind="paid",
                 expires_at_ms=None, created=Change("op", "why", created_ms))


def charge(rid: str, drawn: int, *, returned: int = 0, nonce: str = "n1") -> ChargeRecord:
    return ChargeRecord(rid, nonce, cost=drawn, kept=drawn - returned,
                        draws=(("inv", drawn),),
                        returned=(("inv", returned),) if returned else (), at_ms=NOW - 1000)


def view(remaining: int, charges: tuple[LedgerCharge, ...] = (), epoch: int = 3) -> LedgerView:
    return LedgerView(NOW, 30 * 86_400_000, epoch, (CachedGrant("inv", remaining, None),),
                      charges)


def test_a_grant_whose_records_hold_its_consumption_balances() -> None:
    """consumed = drawn less returned over its charge records: nothing to report."""
    records = [charge("r1", 3), charge("r2", 2, returned=2), charge("r3", 4, returned=1)]
    assert check_grants("u", [grant(consumed=6)], records) == []


def test_a_grant_off_by_one_and_a_negative_one_are_reported() -> None:
    """One token more consumed than held is grant_consumed (1 token, the ids); a negative
    consumed breaks tokens = remaining + consumed as well."""
    records = [charge("r1", 3)]
    (d,) = check_grants("u", [grant(consumed=4)], records)
    assert (d.kind, d.tokens, d.reference, d.request_ids) == ("grant_consumed", 1, "inv",
                                                              ("r1",))
    kinds = {x.kind for x in check_grants("u", [grant(consumed=-1)], [])}
    assert kinds == {"grant_unbalanced", "grant_consumed"}


def test_a_grant_older_than_its_records_may_hold_more_than_they_show() -> None:
    """A grant created before the records' time to live may consume more than its
    remaining records hold, never less."""
    old = grant(consumed=9, created_ms=NOW - 500 * 86_400_000)
    since = NOW - 400 * 86_400_000
    assert check_grants("u", [old], [charge("r1", 3)], records_since_ms=since) == []
    (d,) = check_grants("u", [grant(consumed=1, created_ms=old.created.at_ms)],
                        [charge("r1", 3)], records_since_ms=since)
    assert d.kind == "grant_consumed" and d.tokens == 2


def test_a_young_draw_not_yet_recorded_is_allowed_an_old_one_is_not() -> None:
    """The copy holds less by a draw younger than the write bound whose record has not
    landed: balanced. The same draw older than the bound is draw_unrecorded, and the copy
    short of it."""
    young = LedgerCharge("r9", "n9", 2, NOW - 1000, draws=(("inv", 2),), draw_epoch=3)
    found, notes = check_credit("u", [grant(consumed=0)], view(98, (young,)), [], NOW,
                                write_bound_ms=BOUND)
    assert (found, notes) == ([], [])
    old = LedgerCharge("r9", "n9", 2, NOW - BOUND - 1, draws=(("inv", 2),), draw_epoch=3)
    found, _ = check_credit("u", [grant(consumed=0)], view(98, (old,)), [], NOW,
                            write_bound_ms=BOUND)
    assert sorted((d.kind, d.tokens) for d in found) == [("credit_short", 2),
                                                         ("draw_unrecorded", 2)]


def test_no_cached_copy_is_a_note_and_a_voided_grant_still_cached_is_excess() -> None:
    """A copy not loaded is not compared; a copy still holding a grant that DynamoDB has
    voided lets the user spend it: credit_excess."""
    found, notes = check_credit("u", [grant()], view(100, epoch=-1), [], NOW,
                                write_bound_ms=BOUND)
    assert found == [] and notes
    voided = Grant("inv", 100, 0, "paid", None, Change("op", "why", NOW - 5000),
                   voided=Change("op", "charge-back", NOW - 1000))
    (d,), _ = check_credit("u", [voided], view(100), [], NOW, write_bound_ms=BOUND)
    assert (d.kind, d.tokens, d.reference) == ("credit_excess", 100, "inv")
    assert d.fix.startswith("atto-admin reload u ")


def test_the_ledger_read_decodes_grants_and_charges() -> None:
    """budget_audit_read.lua's reply becomes the view: clock, longest window, epoch, the
    copy's grants and each counted charge with its draws."""
    reply = [b"1800000000000", b"2592000000", b"4",
             [b"g1", b"7 0 paid 1 10", b"g2", b"0 1900000000000 promo 2 5 lx"], 0,
             b"r:2", b"1799999999000", b"3 nonce2 POST /v1/x", b"#4 g1=2 g2=1",
             b"r:1", b"1799999998000", b"1 nonce1 GET /v1/y", b""]
    v = parse_view(reply)
    assert (v.clock_ms, v.longest_ms, v.epoch, v.truncated) == (NOW, 2_592_000_000, 4, False)
    assert v.grants == (CachedGrant("g1", 7, None), CachedGrant("g2", 0, 1_900_000_000_000))
    assert v.charges == (
        LedgerCharge("r:2", "nonce2", 3, NOW - 1000, "POST /v1/x", (("g1", 2), ("g2", 1)), 4),
        LedgerCharge("r:1", "nonce1", 1, NOW - 2000, "GET /v1/y"))


def test_only_what_both_reads_find_is_confirmed() -> None:
    """A divergence the second read no longer finds (a write that was on its way) is
    dropped; one found twice is kept with the second read's tokens."""
    a = Divergence("credit_short", "u", 2, reference="inv")
    b = Divergence("record_missing", "u", 1, ("r1",))
    assert confirmed([a, b], [Divergence("credit_short", "u", 3, reference="inv")]) == [
        Divergence("credit_short", "u", 3, reference="inv")]


def test_the_sample_takes_about_its_share_and_differs_per_run() -> None:
    """A share of 1 takes everyone; a quarter takes about a quarter, and another hour's run
    takes other users."""
    users = [f"user-{i}" for i in range(4000)]
    assert all(sampled(u, "h", 1.0) for u in users[:50])
    first = {u for u in users if sampled(u, "2026-12-02T10", 0.25)}
    second = {u for u in users if sampled(u, "2026-12-02T11", 0.25)}
    assert 800 < len(first) < 1200 and 800 < len(second) < 1200
    assert len(first & second) < 0.5 * len(first)


def test_settings_come_from_the_environment_and_refuse_bad_values() -> None:
    """Empty means the default; a value out of range or not a number is refused, naming
    its variable."""
    s = AuditSettings.from_env({"ATTO_AUDIT_SAMPLE": "0.1", "ATTO_AUDIT_RECHECK_S": "",
                                "ATTO_AUDIT_CONCURRENCY": "4"})
    assert (s.sample, s.recheck_s, s.concurrency) == (0.1, 2.0, 4)
    for name, value in (("ATTO_AUDIT_SAMPLE", "0"), ("ATTO_AUDIT_SAMPLE", "2"),
                        ("ATTO_AUDIT_MAX_USERS", "0"), ("ATTO_AUDIT_WRITE_BOUND_S", "x"),
                        ("ATTO_AUDIT_CONCURRENCY", "100")):
        with pytest.raises(InvalidArgument, match=name):
            AuditSettings.from_env({name: value})


class _Store:
    """Grants and charge records of two users; ``down`` fails to answer."""

    def __init__(self, down: str) -> None:
        self.down = down

    def load(self, user: str) -> Any:
        from usage_limits.entitlements.exceptions import StoreUnavailable
        from usage_limits.entitlements.models import UserEntitlements

        if user == self.down:
            raise StoreUnavailable("unreachable")
        return UserEntitlements(user, None, None, (grant(consumed=3),))

    def charge_records(self, user: str) -> list[ChargeRecord]:
        return [charge("r1", 2)]


def test_a_user_whose_store_fails_is_a_note_and_the_others_are_audited() -> None:
    """One user's books cannot be read: the run notes it and audits the others (a grant
    off by one found), instead of failing as a whole."""
    import asyncio

    auditor = Auditor(_Store(down="b"), settings=AuditSettings(recheck_s=0))  # type: ignore[arg-type]
    report = asyncio.run(auditor.run(users=["a", "b", "c"], now_ms=NOW))
    assert report.users_audited == 2 and set(report.notes) >= {"b"}
    assert report.users_not_audited == 1
    assert "not audited" in report.notes["b"][0]
    assert sorted(d.user_id for d in report.divergences) == ["a", "c"]


class _Books:
    """Balanced books for any user: one grant, not drawn from."""

    def load(self, user: str) -> Any:
        from usage_limits.entitlements.models import UserEntitlements

        return UserEntitlements(user, None, None, (grant(),))

    def charge_records(self, user: str) -> list[ChargeRecord]:
        return []


class _Active:
    """A usage-record store whose active users are ``users``."""

    def __init__(self, users: list[str]) -> None:
        self.users = users

    def active_users(self, since_ms: int, until_ms: int) -> list[str]:
        return list(self.users)

    def records(self, user: str, since_ms: int, until_ms: int) -> list[Any]:
        return []


def test_a_bounded_run_counts_who_it_left_and_the_next_hour_takes_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run over more active users than its bound audits the bound, counts the rest as not
    audited (UsersNotAudited) and keeps its mark; runs of other hours pick other users, so
    none is left out for ever by its name's place in the alphabet."""
    import asyncio

    users = [f"user-{i:02d}" for i in range(20)]
    auditor = Auditor(_Books(), usage=_Active(users),  # type: ignore[arg-type]
                      settings=AuditSettings(recheck_s=0, max_users=5), sweep_expiry=False)
    marks: list[int] = []
    monkeypatch.setattr(auditor, "last_mark", lambda: None)
    monkeypatch.setattr(auditor, "set_mark", lambda until, report: marks.append(until))
    seen: set[str] = set()
    for hour in range(8):
        audited: list[str] = []
        real = auditor.audit_user

        async def spy(user: str, now_ms: int | None, _real: Any = real,
                      _out: list[str] = audited) -> Any:
            _out.append(user)
            return await _real(user, now_ms)

        monkeypatch.setattr(auditor, "audit_user", spy)
        report = asyncio.run(auditor.run(now_ms=NOW + hour * 3_600_000))
        assert (report.users_audited, report.users_not_audited) == (5, 15)
        assert report.balanced and len(set(audited)) == 5
        seen |= set(audited)
    assert marks == []  # never moved while users were left: the next run starts there
    assert len(seen) > 10  # the first five of the alphabet would be 5
