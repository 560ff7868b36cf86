"""The conservation auditor over real traffic: clean books report nothing, and each kind of
divergence planted is found, with the user, the ids, the tokens and a fix.

Real Redis (standalone, then the 3-node cluster), moto DynamoDB, the emulator; traffic goes
through the real handlers (as in ``test_credit_exactness``), the divergences are planted
straight into DynamoDB or Redis afterwards.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from tests.integration.test_credit_exactness import books_balance, fail_once, fill_quota
from tests.integration.test_entitlements_hotpath import (  # noqa: F401  (env: a fixture)
    embed,
    env,
    grant,
    remaining,
    store,
)
from usage_limits.entitlements.audit import UserAudit
from usage_limits.entitlements.auditor import Auditor, AuditSettings
from usage_limits.keys import user_keys
from usage_limits.web import runtime

#: No pause before the second read, and every record is expected at once.
SETTINGS = AuditSettings(recheck_s=0, write_bound_s=0)


@pytest.fixture
def plain(env: Any) -> Any:  # noqa: F811  (the fixture imported above)
    """A plain Redis client of the environment's server (``env`` of the hot-path tests)."""
    return env


@pytest.fixture
def patch() -> Any:
    """A MonkeyPatch of the test's own: undoing it leaves the environment's settings."""
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def usage_store() -> Any:
    """The usage-record store of the environment (None before it exists)."""
    return None


def audit(user: str, **kwargs: Any) -> UserAudit:
    """One audit of ``user`` over the environment's store and ledger."""
    async def go() -> UserAudit:
        auditor = Auditor(store(), runtime.get_redis(), usage_store(), settings=SETTINGS,
                          **kwargs)
        return await auditor.audit_user(user)
    return asyncio.run(go())


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
    report = audit(user)
    assert report.divergences == (), report


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
    found = [d for d in audit(user).divergences if d.kind == "grant_consumed"]
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
    found = audit(user).divergences
    assert [(d.kind, d.reference, d.tokens) for d in found] == [("credit_excess", "inv", 7)]
    plain.delete(ent)
    dropped = audit(user)
    assert dropped.divergences == () and any("no cached copy" in n for n in dropped.notes)


def test_a_cached_copy_short_of_credit_is_found(plain: Any, patch: pytest.MonkeyPatch) -> None:
    """A Redis copy holding 2 tokens less than DynamoDB (credit the user lost) is a
    credit_short of 2."""
    user = uuid.uuid4().hex
    traffic(user, patch)
    (ent,) = user_keys(user, "ent")
    value = plain.hget(ent, "g:inv").decode().split(" ")
    plain.hset(ent, "g:inv", " ".join([str(int(value[0]) - 2), *value[1:]]))
    found = audit(user).divergences
    assert [(d.kind, d.reference, d.tokens) for d in found] == [("credit_short", "inv", 2)]
