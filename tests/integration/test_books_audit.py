"""The conservation auditor over real traffic: clean books report nothing, and each kind of
divergence planted is found, with the user, the ids, the tokens and a fix.

Real Redis (standalone, then the 3-node cluster), moto DynamoDB, the emulator; traffic goes
through the real handlers (as in ``test_credit_exactness``), the divergences are planted
straight into DynamoDB or Redis afterwards.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.test_credit_exactness import books_balance, fail_once, fill_quota
from tests.integration.test_entitlements_hotpath import (  # noqa: F401  (env: a fixture)
    embed,
    env,
    grant,
    op,
    remaining,
    store,
)
from usage_limits.entitlements.audit import UserAudit
from usage_limits.entitlements.auditor import Auditor, AuditSettings
from usage_limits.entitlements.usage import UsageRecord, active_key
from usage_limits.entitlements.usage_store import UsageSettings, UsageStore
from usage_limits.keys import user_keys
from usage_limits.web import runtime

USAGE_TABLE = "books-usage"

#: No pause before the second read, and every record is expected at once.
SETTINGS = AuditSettings(recheck_s=0, write_bound_s=0)


@pytest.fixture
def plain(env: Any) -> Iterator[Any]:  # noqa: F811  (the fixture imported above)
    """A plain Redis client of the environment's server (``env`` of the hot-path tests),
    with the usage records' table made in its moto account and written by the handlers."""
    from usage_limits.entitlements.usage_store import set_usage_store

    usage_store().create_table()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTO_USAGE_TABLE", USAGE_TABLE)
        set_usage_store(None)
        try:
            yield env
        finally:
            set_usage_store(None)


@pytest.fixture
def patch() -> Any:
    """A MonkeyPatch of the test's own: undoing it leaves the environment's settings."""
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def usage_store() -> UsageStore:
    """The usage records' store of the test's moto table."""
    return UsageStore(UsageSettings(table=USAGE_TABLE, region="us-east-1"))


def run(coro: Any) -> Any:
    """Run ``coro`` on a loop of its own, never made current (the handlers' Mangum needs
    the thread's own loop afterwards)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def audit(user: str, *, records: bool = True, **kwargs: Any) -> UserAudit:
    """One audit of ``user`` over the environment's store and ledger (and usage records)."""
    async def go() -> UserAudit:
        auditor = Auditor(store(), runtime.get_redis(), usage_store() if records else None,
                          settings=SETTINGS, **kwargs)
        return await auditor.audit_user(user)
    return run(go())


def ledger_charges(user: str) -> list[Any]:
    """The charges the ledger counts for ``user`` (their ids, nonces, costs, routes)."""
    async def go() -> list[Any]:
        auditor = Auditor(store(), runtime.get_redis(), settings=SETTINGS)
        return list((await auditor.read_ledger(user, int(time.time() * 1000))).charges)
    return run(go())


def write_records(user: str) -> list[UsageRecord]:
    """The usage records the handlers wrote of the charges the ledger counts."""
    counted = {(c.request_id, c.nonce) for c in ledger_charges(user)}
    now = int(time.time() * 1000)
    return [r for r in usage_store().records(user, now - 86_400_000, now + 1)
            if (r.request_id, r.nonce) in counted]


def traffic(user: str, patch: pytest.MonkeyPatch) -> None:
    """A grant, the quota filled, charges drawing credit and one failed (refunded)."""
    grant(user, "inv", 50)
    fill_quota(user)
    assert embed(user, 3) == [200] * 3
    with pytest.MonkeyPatch.context() as mp:
        fail_once(mp)
        assert embed(user, 1) == [502]
    assert embed(user, 1) == [200]


def test_clean_books_after_real_traffic_report_nothing(plain: Any,
                                                       patch: pytest.MonkeyPatch) -> None:
    """After grants, draws and a refunded failure through the handlers, the audit finds no
    divergence."""
    user = uuid.uuid4().hex
    traffic(user, patch)
    books_balance(user)
    assert audit(user, records=False).divergences == ()
    assert len(write_records(user)) == 8
    report = audit(user)
    assert report.divergences == () and report.notes == (), report


def test_a_grant_consumed_off_by_one_is_found(plain: Any, patch: pytest.MonkeyPatch) -> None:
    """A grant whose consumed is one more than its charge records hold is reported with its
    reference, one token and a fix."""
    user = uuid.uuid4().hex
    traffic(user, patch)
    s = store()
    s.client.update_item(TableName=s.table, Key=s._ser({"pk": "U#" + user, "sk": "E#G#inv"}),
                         UpdateExpression="ADD #c :one",
                         ExpressionAttributeNames={"#c": "consumed"},
                         ExpressionAttributeValues=s._ser({":one": 1}))
    found = [d for d in audit(user, records=False).divergences if d.kind == "grant_consumed"]
    assert len(found) == 1, found
    d = found[0]
    assert (d.user_id, d.reference, d.tokens) == (user, "inv", 1)
    assert d.request_ids and "atto-admin" in d.fix


def test_a_cached_copy_with_more_credit_than_dynamodb_is_found(plain: Any,
                                                              patch: pytest.MonkeyPatch) -> None:
    """A Redis copy raised by 7 tokens above DynamoDB's remaining is a credit_excess of 7
    on that grant; dropping the copy makes it a note, not a divergence."""
    user = uuid.uuid4().hex
    traffic(user, patch)
    assert remaining(user) == {"inv": 46}
    (ent,) = user_keys(user, "ent")
    value = plain.hget(ent, "g:inv").decode().split(" ")
    plain.hset(ent, "g:inv", " ".join([str(int(value[0]) + 7), *value[1:]]))
    found = audit(user, records=False).divergences
    assert [(d.kind, d.reference, d.tokens) for d in found] == [("credit_excess", "inv", 7)]
    plain.delete(ent)
    dropped = audit(user, records=False)
    assert dropped.divergences == () and any("no cached copy" in n for n in dropped.notes)


def test_a_cached_copy_short_of_credit_is_found(plain: Any, patch: pytest.MonkeyPatch) -> None:
    """A Redis copy holding 2 tokens less than DynamoDB (credit the user lost) is a
    credit_short of 2."""
    user = uuid.uuid4().hex
    traffic(user, patch)
    (ent,) = user_keys(user, "ent")
    value = plain.hget(ent, "g:inv").decode().split(" ")
    plain.hset(ent, "g:inv", " ".join([str(int(value[0]) - 2), *value[1:]]))
    found = audit(user, records=False).divergences
    assert [(d.kind, d.reference, d.tokens) for d in found] == [("credit_short", "inv", 2)]


def test_a_counted_charge_with_no_record_is_found_and_repaired_when_provable(
        plain: Any, patch: pytest.MonkeyPatch) -> None:
    """Charges the ledger counts with no usage record are each a record_missing with its
    request id; the one drawn from credit is proven by its charge record and repaired,
    the one that drew nothing is left to a person; a second audit finds only that one."""
    user = uuid.uuid4().hex
    traffic(user, patch)
    records = write_records(user)
    drawn = next(r for r in records if r.draws)
    plain_one = next(r for r in records if not r.draws)
    s = usage_store()
    for r in (drawn, plain_one):
        s.client.delete_item(TableName=s.table, Key=s._ser({
            "pk": "U#" + user, "sk": f"{r.request_id}#{r.nonce}"}))
    found = audit(user).divergences
    assert sorted((d.kind, d.request_ids, d.tokens, d.repaired) for d in found) == sorted([
        ("record_missing", (drawn.request_id,), 1, True),
        ("record_missing", (plain_one.request_id,), 1, False)])
    assert all("--repair" in d.fix for d in found)
    assert s.get(user, drawn.request_id, drawn.nonce).kept == 1
    again = audit(user).divergences
    assert [(d.kind, d.request_ids) for d in again] == [
        ("record_missing", (plain_one.request_id,))]


def test_a_refunded_record_the_ledger_still_counts_is_found(
        plain: Any, patch: pytest.MonkeyPatch) -> None:
    """A usage record lowered to refunded while the ledger still counts the charge is a
    record_refunded with the charge's id, its cost and the refund command."""
    user = uuid.uuid4().hex
    traffic(user, patch)
    records = write_records(user)
    victim = records[0]
    assert usage_store().lower(user, victim.request_id, victim.nonce, 0, "refunded",
                               int(time.time() * 1000))
    found = audit(user).divergences
    assert [(d.kind, d.request_ids, d.tokens) for d in found] == [
        ("record_refunded", (victim.request_id,), 1)]
    assert found[0].fix.startswith(f"atto-admin refund {user} ")


def test_a_charged_record_the_ledger_does_not_count_is_found(
        plain: Any, patch: pytest.MonkeyPatch) -> None:
    """A charged usage record of a charge the ledger no longer counts (removed behind its
    back) is a record_not_counted; with the ledger dropped entirely there is nothing to
    compare and a note says so."""
    user = uuid.uuid4().hex
    traffic(user, patch)
    records = write_records(user)
    # the newest charge without credit: one the ledger's oldest counted charge predates
    victim = max((r for r in records if not r.draws), key=lambda r: r.at_ms)
    assert victim.at_ms > min(r.at_ms for r in records)
    log, ev = user_keys(user, "log", "ev")
    plain.zrem(log, victim.request_id)
    plain.hdel(ev, victim.request_id)
    found = audit(user).divergences
    assert [(d.kind, d.request_ids, d.tokens) for d in found] == [
        ("record_not_counted", (victim.request_id,), 1)]
    plain.delete(*user_keys(user, "log", "ev", "meta", "ent", "dr"))
    dropped = audit(user)
    assert dropped.divergences == ()
    assert any("usage records not compared" in n for n in dropped.notes)


def plant_off_by_one(user: str) -> None:
    """The user's grant ``inv`` consumes one token more than its charge records hold."""
    s = store()
    s.client.update_item(TableName=s.table, Key=s._ser({"pk": "U#" + user, "sk": "E#G#inv"}),
                         UpdateExpression="ADD #c :one",
                         ExpressionAttributeNames={"#c": "consumed"},
                         ExpressionAttributeValues=s._ser({":one": 1}))


def test_a_scheduled_run_audits_the_active_users_logs_and_publishes(
        plain: Any, patch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The auditor function audits the users with records since its last run (not one
    without), logs its report as one JSON line, publishes LedgerDivergence and its tokens,
    and keeps its mark for the next run."""
    from usage_limits.entitlements.usage_store import set_usage_store

    auditor_fn = importlib.import_module("functions.auditor.app")
    patch.setenv("ATTO_AUDIT_RECHECK_S", "0")
    patch.setenv("ATTO_AUDIT_WRITE_BOUND_S", "0")
    set_usage_store(usage_store())
    patch.setattr("usage_limits.entitlements.usage_store._store", usage_store())
    active, idle = uuid.uuid4().hex, uuid.uuid4().hex
    for user in (active, idle):
        traffic(user, patch)
        write_records(user)
        plant_off_by_one(user)
    now = int(time.time() * 1000)
    s = usage_store()
    for at in (now - 3_600_000, now):  # the idle user's markers go: its hours look idle
        s.client.delete_item(TableName=s.table, Key=s._ser(active_key(idle, at)))
    s.mark_active(active, now)
    capsys.readouterr()
    report = auditor_fn.handler({}, None)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith("{")]
    assert report["users_audited"] >= 1 and not report["balanced"]
    mine = [d for d in report["divergences"] if d["user_id"] in (active, idle)]
    # the grant consumes one more than its records, so the copy holds one more than it
    assert sorted((d["user_id"], d["kind"], d["tokens"]) for d in mine) == [
        (active, "credit_excess", 1), (active, "grant_consumed", 1)]
    logged = [x for x in lines if x.get("message") == "books audit"]
    assert len(logged) == 1 and logged[0]["divergence_count"] == report["divergence_count"]
    emf = [x for x in lines if "LedgerDivergence" in x]
    assert len(emf) == 1 and emf[0]["LedgerDivergence"] == [float(report["divergence_count"])]
    assert emf[0]["LedgerDivergenceTokens"] == [float(report["divergence_tokens"])]
    assert emf[0]["UsersNotAudited"] == [0.0] and report["users_not_audited"] == 0
    assert Auditor(store(), settings=SETTINGS).last_mark() is not None
    one = auditor_fn.handler({"users": [idle]}, None)
    assert sorted((d["user_id"], d["kind"]) for d in one["divergences"]) == [
        (idle, "credit_excess"), (idle, "grant_consumed")]


def test_the_operator_books_route_audits_one_user(plain: Any,
                                                  patch: pytest.MonkeyPatch) -> None:
    """POST /admin/v1/books with a user reports that user's divergences with their fixes;
    reload drops the cached copy, after which the credit is not compared."""
    from usage_limits.entitlements.usage_store import set_usage_store

    set_usage_store(usage_store())
    patch.setattr("usage_limits.entitlements.usage_store._store", usage_store())
    user = uuid.uuid4().hex
    traffic(user, patch)
    write_records(user)
    (ent,) = user_keys(user, "ent")
    value = plain.hget(ent, "g:inv").decode().split(" ")
    plain.hset(ent, "g:inv", " ".join([str(int(value[0]) + 3), *value[1:]]))
    patch.setenv("ATTO_AUDIT_RECHECK_S", "0")
    body = op("POST", "/admin/v1/books", {"user_id": user}).body
    assert [(d["kind"], d["reference"], d["tokens"]) for d in body["divergences"]] == [
        ("credit_excess", "inv", 3)]
    assert body["divergences"][0]["fix"].startswith(f"atto-admin reload {user}")
    assert op("POST", f"/admin/v1/users/{user}/reload").body["reloaded"] is True
    again = op("POST", "/admin/v1/books", {"user_id": user}).body
    assert again["balanced"] is True, again


def test_the_fleet_end_audit_reports_balanced_books_and_a_planted_divergence(
        plain: Any, patch: pytest.MonkeyPatch) -> None:
    """bench/_fleet_audit.run_audit over the environment's Redis and tables: balanced after
    real traffic, not balanced once a grant is off by one."""
    from bench._fleet_audit import run_audit

    user = uuid.uuid4().hex
    traffic(user, patch)
    write_records(user)
    kwargs: dict[str, Any] = {"entitlements_table": store().table, "usage_table": USAGE_TABLE,
                              "users": [user], "cluster": plain.__class__.__name__ ==
                              "RedisCluster", "recheck_s": 0}
    url = os.environ["REDIS_URL"]
    assert run_audit(url, None, **kwargs).balanced
    plant_off_by_one(user)
    report = run_audit(url, None, **kwargs)
    assert not report.balanced and report.users_audited == 1


def test_records_older_than_a_rebuilt_ledger_are_a_note_not_a_divergence(
        plain: Any, patch: pytest.MonkeyPatch) -> None:
    """After the ledger was dropped and rebuilt (a restart without persistence), charges
    made before it are not counted by it: their standing records are a note, while a
    record newer than the rebuilt ledger's oldest charge would still be compared."""
    user = uuid.uuid4().hex
    traffic(user, patch)
    plain.delete(*user_keys(user, "log", "ev", "meta", "dr"))  # the ledger lost, ent kept
    assert embed(user, 1) == [200]  # the ledger rebuilt by a new charge
    report = audit(user)
    assert [d.kind for d in report.divergences
            if d.kind in ("record_not_counted", "record_missing")] == []
    assert any("older than the oldest charge the ledger counts" in n
               for n in report.notes)
