"""A support refund completed by a second attempt removes the charge the first attempt
claimed, never a newer charge of the same id: real Redis, moto DynamoDB."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from moto import mock_aws

from usage_limits.budget import TokenBudget, Window, new_nonce
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.operator import Operator
from usage_limits.entitlements.plans import Plans
from usage_limits.entitlements.store import EntitlementStore

TABLE = "support-refund-retry"
PLAN = ((100, 3600),)


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[EntitlementStore]:
    """An entitlement table in moto."""
    for name, value in {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with mock_aws():
        table = EntitlementStore(StoreSettings(table=TABLE, region="us-east-1"))
        table.create_table()
        yield table


async def test_a_repeated_refund_never_refunds_a_newer_charge_of_the_id(
        standalone_client: aioredis.Redis, store: EntitlementStore) -> None:
    """A support refund that removed charge A and died before answering is repeated after a
    retry charged B under the same id: the repeat answers the first refund and leaves B."""
    user, rid = uuid.uuid4().hex, "k:" + uuid.uuid4().hex
    budget = TokenBudget(standalone_client, windows=[Window(limit=100, seconds=3600)])
    first = new_nonce()
    assert (await budget.reserve(user, rid, cost=5, nonce=first)).allowed
    # the first support attempt: recorded with its audit entry, the ledger lowered, no answer
    store.refund_charge(user, rid, first, tokens=5, actor="jane", reason="wrong answer")
    assert await budget.refund(user, rid, nonce=first)
    # the client's retry under the same id is charged again, with its own nonce
    again = await budget.reserve(user, rid, cost=7)
    assert again.allowed and not again.duplicate
    operator = Operator(store, Plans.single(PLAN), budget)
    done, created = await operator.refund(user, rid, actor="jane", reason="wrong answer")
    assert (done.tokens, created) == (5, False)
    assert (await budget.usage(user)).windows[0].used == 7
    assert [e.action for e in store.audit(user)] == ["refund"]


async def test_a_refund_whose_ledger_part_failed_is_finished_by_a_repeat(
        standalone_client: aioredis.Redis, store: EntitlementStore) -> None:
    """When Redis fails after the refund was recorded, the answer says the refund is
    recorded (NotRefreshed, 503); the repeat gives the windows their tokens back once."""
    from redis.asyncio import Redis

    from usage_limits.entitlements import NotRefreshed

    user, rid = uuid.uuid4().hex, "r:" + uuid.uuid4().hex
    budget = TokenBudget(standalone_client, windows=[Window(limit=100, seconds=3600)])
    assert (await budget.reserve(user, rid, cost=5)).allowed
    operator = Operator(store, Plans.single(PLAN), budget)
    dead = TokenBudget(Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2),
                       windows=[Window(limit=100, seconds=3600)])
    operator.budget = dead
    original = budget.charge

    async def found(user_id: str, request_id: str):  # type: ignore[no-untyped-def]
        return await original(user_id, request_id)

    dead.charge = found  # type: ignore[method-assign]  # the lookup works, the lowering fails
    with pytest.raises(NotRefreshed, match="recorded"):
        await operator.refund(user, rid, actor="jane", reason="empty answer")
    assert (await budget.usage(user)).windows[0].used == 5
    operator.budget = budget
    done, created = await operator.refund(user, rid, actor="jane", reason="empty answer")
    assert (done.tokens, created) == (5, False)
    assert (await budget.usage(user)).windows[0].used == 0
    assert [e.action for e in store.audit(user)] == ["refund"]
