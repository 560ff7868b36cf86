"""Many threads reserving, posting and voiding transfers on one small grant at once, through
a shared local DynamoDB server: the grant is never overdrawn and its consumption is exactly
what the transfers still draw."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from local.dynamodb import DynamoServer
from tests.dynamo import local_dynamo
from usage_limits.credit import Result, TransferBook
from usage_limits.credit.legs import consumed_by
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore

THREADS = 6
GRANT = 40
COST = 3
PER_THREAD = 6


@pytest.fixture(scope="module")
def dynamo() -> Iterator[DynamoServer]:
    """A local DynamoDB server reached over HTTP, with the table."""
    with local_dynamo("credit-book-concurrency") as server:
        yield server


def _settings(server: DynamoServer) -> StoreSettings:
    return StoreSettings(table=server.table, region="us-east-1", endpoint_url=server.url)


def test_concurrent_transfers_never_overdraw_and_balance(dynamo: DynamoServer) -> None:
    """Reservations race for a grant of 40 tokens (3 each, every third voided, every third
    posted below its cost): no more is drawn than the grant holds, every refusal comes only
    once the grant cannot cover it, and consumed = legs - returns."""
    store = EntitlementStore(_settings(dynamo))
    store.create_grant("racer", tokens=GRANT, kind="paid", reference="g", expires_at_ms=None,
                       actor="op", reason="race")
    results: list[Result] = []
    lock = threading.Lock()
    start = threading.Barrier(THREADS)

    def worker(n: int) -> None:
        book = TransferBook(_settings(dynamo))
        hint = book.grants("racer")
        start.wait()
        for i in range(PER_THREAD):
            now = int(time.time() * 1000)
            made = book.reserve("racer", f"t{n}-{i}", "n", reserved=COST, credit=COST,
                                hold_ms=now + 60_000, grants=hint)
            hint = made.grants or hint
            with lock:
                results.append(made.result)
            if made.transfer is None:
                continue
            if i % 3 == 0:
                book.void("racer", made.transfer.request_id, "n", known=made.transfer)
            else:
                book.post(made.transfer, COST if i % 3 == 1 else 1)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    book = TransferBook(_settings(dynamo))
    grant = book.grants("racer")[0]
    transfers = book.transfers("racer")
    assert 0 <= grant.consumed <= GRANT
    assert grant.consumed == consumed_by((t.legs, t.back) for t in transfers)["g"]
    assert set(results) <= {Result.APPLIED, Result.EXCEEDS_CREDIT}
    if Result.EXCEEDS_CREDIT in results:  # refused only once the grant could not cover it
        assert grant.tokens - grant.consumed < COST or any(
            t.state.value == "pending" for t in transfers)
