"""The local DynamoDB server's injected faults (``DynamoServer.inject``), as the fleet uses
them: each refusal reaches the store as DynamoDB's own error, a lost answer leaves its
write applied, and a fault ends after its calls or its time."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from local.dynamodb import FAULT_KINDS, DynamoServer, refusal
from tests.dynamo import local_dynamo
from usage_limits.entitlements import StoreUnavailable
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore


@pytest.fixture(scope="module")
def dynamo() -> Iterator[DynamoServer]:
    with local_dynamo("faults") as server:
        yield server


#: More calls than the store and botocore make for one change, retries included.
EVERY_TRY = 10


def _store(server: DynamoServer) -> EntitlementStore:
    """As few attempts as botocore allows: its back-off would only slow the test down."""
    return EntitlementStore(StoreSettings(table=server.table, endpoint_url=server.url,
                                          region="us-east-1", max_attempts=1))


def _grant(store: EntitlementStore, user: str, reference: str) -> object:
    return store.create_grant(user, tokens=10, kind="paid", reference=reference,
                              expires_at_ms=None, actor="test", reason="faults")


@pytest.mark.parametrize("kind, code", [
    ("conflict", "TransactionConflict"), ("throttle", "ThrottlingException"),
    ("capacity", "ProvisionedThroughputExceededException"), ("down", "ServiceUnavailable")])
def test_a_refused_call_writes_nothing(dynamo: DynamoServer, kind: str, code: str) -> None:
    """Transactions refused as ``kind`` raise StoreUnavailable naming DynamoDB's code and
    write nothing; once the fault ends the change goes through."""
    store, user = _store(dynamo), uuid.uuid4().hex
    dynamo.inject(kind, seconds=10, count=EVERY_TRY)
    with pytest.raises(StoreUnavailable, match=code):
        _grant(store, user, "a")
    dynamo.clear()
    assert store.load(user).grants == ()
    _grant(store, user, "a")
    assert [g.reference for g in store.load(user).grants] == ["a"]


def test_a_lost_answer_leaves_the_write_applied(dynamo: DynamoServer) -> None:
    """A transaction whose every answer is lost (the connection closes) has landed: the
    store reports it unreachable, and the record holds the write, once."""
    store, user = _store(dynamo), uuid.uuid4().hex
    dynamo.inject("lost", seconds=10, count=EVERY_TRY)
    with pytest.raises(StoreUnavailable, match="unreachable"):
        _grant(store, user, "a")
    dynamo.clear()
    assert [g.reference for g in store.load(user).grants] == ["a"]


def test_a_fault_names_its_operations_and_ends_in_time(dynamo: DynamoServer) -> None:
    """Reads pass a fault on transactions; a fault on every call ends after its seconds."""
    store, user = _store(dynamo), uuid.uuid4().hex
    dynamo.inject("conflict", seconds=10, count=1)
    assert store.load(user).grants == ()  # a Query: not a transaction
    with pytest.raises(StoreUnavailable):
        _grant(store, user, "a")
    dynamo.inject("down", operations=("Query",), seconds=0.3)
    with pytest.raises(StoreUnavailable, match="ServiceUnavailable"):
        store.load(user)
    time.sleep(0.35)
    assert store.load(user).grants == ()


def test_unknown_kinds_are_refused_and_refusals_have_dynamodbs_shape() -> None:
    """An unknown fault kind is a ValueError; a conflict names a reason for every item."""
    with pytest.raises(ValueError, match="unknown DynamoDB fault"):
        DynamoServer().inject("meteor")
    assert "lost" in FAULT_KINDS
    error = refusal("conflict", 3)
    assert error["Error"]["Code"] == "TransactionCanceledException"
    assert [r["Code"] for r in error["CancellationReasons"]] == ["TransactionConflict"] * 3
    assert "CancellationReasons" not in refusal("throttle")


def test_a_store_makes_at_most_max_attempts_attempts_per_call(dynamo: DynamoServer) -> None:
    """``max_attempts`` counts every attempt of a call, the first included (botocore's
    ``total_max_attempts``): a read refused every time is tried exactly that often."""
    for attempts in (1, 2):
        store = EntitlementStore(StoreSettings(table=dynamo.table, endpoint_url=dynamo.url,
                                               region="us-east-1", max_attempts=attempts))
        before = dynamo.injected.get("down", 0)
        dynamo.inject("down", operations=("GetItem",), seconds=10, count=EVERY_TRY)
        with pytest.raises(StoreUnavailable, match="ServiceUnavailable"):
            store.grant(uuid.uuid4().hex, "a")
        dynamo.clear()
        assert dynamo.injected.get("down", 0) - before == attempts
