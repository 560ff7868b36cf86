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


async def test_unfinished_claim_does_not_refund_a_newer_charge_of_the_id(
        standalone_client: aioredis.Redis, store: EntitlementStore) -> None:
    """An attempt that claimed and refunded charge A, then died, is completed by the next
    call without refunding charge B that a retry made later under the same id."""
    user, rid = uuid.uuid4().hex, "k:" + uuid.uuid4().hex
    budget = TokenBudget(standalone_client, windows=[Window(limit=100, seconds=3600)])
    first = new_nonce()
    assert (await budget.reserve(user, rid, cost=5, nonce=first)).allowed
    # the first support attempt: claimed, refunded in the ledger, never finished
    store.claim_support_refund(user, rid, claimed=5, actor="jane", reason="wrong answer",
                               nonce=first)
    assert await budget.refund(user, rid, nonce=first)
    # the client's retry under the same id is charged again, with its own nonce
    again = await budget.reserve(user, rid, cost=7)
    assert again.allowed and not again.duplicate
    operator = Operator(store, Plans.single(PLAN), budget)
    done, _ = await operator.refund(user, rid, actor="jane", reason="wrong answer")
    assert done.tokens == 5
    assert (await budget.usage(user)).windows[0].used == 7
