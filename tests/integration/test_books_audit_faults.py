"""The conservation auditor's read of a user's ledger (``budget_audit_read.lua``) through
every network fault: a read that came back is exact, one that did not leaves the user
"not audited", and neither reports a divergence that is not there nor repairs anything.

The books are made by real traffic through the handlers (``test_books_audit``), with one
usage record of a credit-drawing charge deleted, so a good audit finds exactly one
``record_missing`` and repairs it. The auditor reaches Redis through the fault proxy with
the production client (``REDIS_RETRIES=1``): one fault is absorbed by redis-py's re-send,
two make the read fail.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from local.redis_servers import RedisServer
from tests.faultproxy import Fault, FaultProxy, script_sha
from tests.integration.test_books_audit import (  # noqa: F401  (fixtures)
    SETTINGS,
    env,
    patch,
    plain,
    run,
    traffic,
    usage_store,
    write_records,
)
from tests.integration.test_entitlements_hotpath import store
from tests.ledger_rig import SOCKET_TIMEOUT_S
from usage_limits._scripts import script
from usage_limits.connection import redis_from_env
from usage_limits.entitlements.audit import AuditReport
from usage_limits.entitlements.auditor import Auditor
from usage_limits.entitlements.usage import UsageRecord

READ = script_sha(script("budget_audit_read").sha)
NOT_AUDITED = ("not audited: DynamoDB or Redis did not answer",)
#: A lost reply, a cut reply and a re-send absorbed; a lost reply, a lost command and a
#: cut before the command failing the read (the ledger scripts' tests try every fault;
#: this read writes nothing, so these stand for the rest).
CASES = [(Fault.DROP_REPLY, 1), (Fault.CUT_REPLY, 1), (Fault.DUPLICATE, 1),
         (Fault.DROP_REPLY, 2), (Fault.DROP_COMMAND, 2), (Fault.CUT_COMMAND, 2)]
IDS = [f"{f.value}x{t}" for f, t in CASES]
#: The proxy fronts the session's standalone server: the env fixture's standalone case.
STANDALONE = pytest.mark.parametrize("env", ["standalone"], indirect=True)


def after_first(match: Callable[[list[bytes]], bool]) -> Callable[[list[bytes]], bool]:
    """``match``, except for the first command it matches (which passes untouched)."""
    seen = [0]

    def matcher(args: list[bytes]) -> bool:
        if not match(args):
            return False
        seen[0] += 1
        return seen[0] > 1
    return matcher


def books_with_a_missing_record(user: str, mp: pytest.MonkeyPatch) -> UsageRecord:
    """Traffic for ``user``, then the usage record of one credit-drawing charge deleted;
    returns that record (a good audit repairs it: its charge record proves it)."""
    traffic(user, mp)
    victim = next(r for r in write_records(user) if r.draws)
    s = usage_store()
    s.client.delete_item(TableName=s.table, Key=s._ser({
        "pk": "U#" + user, "sk": f"{victim.request_id}#{victim.nonce}"}))
    return victim


def faulty_run(proxy: FaultProxy, **kwargs: Any) -> AuditReport:
    """One run of an auditor whose Redis client goes through ``proxy`` (as production's)."""
    async def go() -> AuditReport:
        client = redis_from_env(url=proxy.url, retries=1, socket_timeout_s=SOCKET_TIMEOUT_S)
        try:
            return await Auditor(store(), client, usage_store(), settings=SETTINGS).run(
                **kwargs)
        finally:
            await client.aclose()
    return run(go())


def direct_run(server: RedisServer, **kwargs: Any) -> AuditReport:
    """One run of an auditor straight to Redis (no faults)."""
    async def go() -> AuditReport:
        client = redis_from_env(url=server.url)
        try:
            return await Auditor(store(), client, usage_store(), settings=SETTINGS).run(
                **kwargs)
        finally:
            await client.aclose()
    return run(go())


def mine(report: AuditReport, user: str) -> list[tuple[str, tuple[str, ...], bool]]:
    """The user's divergences in ``report``: kind, request ids, repaired."""
    return [(d.kind, d.request_ids, d.repaired) for d in report.divergences
            if d.user_id == user]


@STANDALONE
@pytest.mark.parametrize("fault,times", CASES, ids=IDS)
def test_a_read_through_a_fault_is_exact_or_not_audited(
        plain: Any, patch: pytest.MonkeyPatch,  # noqa: F811  (fixtures imported above)
        fault_proxy: FaultProxy, redis_server: RedisServer, fault: Fault, times: int) -> None:
    """A fault absorbed by the re-send leaves the audit exact (the one missing record found
    and repaired, nothing else); a read that failed reports the user not audited, with no
    divergence, no repair and the run's mark left where it was, and the next run audits
    the user and repairs the record."""
    user = uuid.uuid4().hex
    victim = books_with_a_missing_record(user, patch)
    injection = fault_proxy.inject(fault, match=READ, times=times,
                                   delay_s=2 * SOCKET_TIMEOUT_S)
    report = faulty_run(fault_proxy)
    assert injection.hits == times
    records = usage_store()
    if times == 1:
        assert mine(report, user) == [("record_missing", (victim.request_id,), True)]
        assert report.users_audited == 1 and user not in report.notes
        assert report.users_not_audited == 0
        assert records.get(user, victim.request_id, victim.nonce) is not None
        assert Auditor(store(), settings=SETTINGS).last_mark() == report.until_ms
        return
    assert report.divergences == () and report.repaired == ()
    assert report.users_audited == 0 and report.notes[user] == NOT_AUDITED
    assert report.users_not_audited == 1  # what UsersNotAudited publishes, and alarms on
    assert records.get(user, victim.request_id, victim.nonce) is None  # nothing written
    assert Auditor(store(), settings=SETTINGS).last_mark() is None  # the mark stays
    later = direct_run(redis_server)
    assert mine(later, user) == [("record_missing", (victim.request_id,), True)]
    assert records.get(user, victim.request_id, victim.nonce) is not None


@STANDALONE
@pytest.mark.parametrize("fault", [Fault.DROP_REPLY, Fault.CUT_COMMAND])
def test_a_recheck_that_fails_reports_and_repairs_nothing(
        plain: Any, patch: pytest.MonkeyPatch,  # noqa: F811  (fixtures imported above)
        fault_proxy: FaultProxy, fault: Fault) -> None:
    """When the first read finds the missing record and the recheck's read fails, the user
    is not audited: nothing reported, nothing repaired (a repair rests on both reads)."""
    user = uuid.uuid4().hex
    victim = books_with_a_missing_record(user, patch)
    injection = fault_proxy.inject(fault, match=after_first(READ), times=2,
                                   delay_s=2 * SOCKET_TIMEOUT_S)
    report = faulty_run(fault_proxy, users=[user])
    assert injection.hits == 2  # the recheck's read and its re-send
    assert report.divergences == () and report.repaired == ()
    assert report.notes[user] == NOT_AUDITED and report.users_not_audited == 1
    assert usage_store().get(user, victim.request_id, victim.nonce) is None

