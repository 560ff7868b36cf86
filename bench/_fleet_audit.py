"""The conservation audit at the end of a fleet run: do the books of its users balance?

``bench/fleet.py`` calls ``run_audit`` once its load and faults are over (and the kept
refunds had their chance to land) and fails the run on any divergence::

    report = run_audit(redis.url, dynamo.url, entitlements_table=dynamo.table,
                       usage_table=dynamo.usage_table, users=fleet_users,
                       cluster=args.cluster)
    if not report.balanced:
        ...  # print report.to_json()["divergences"], exit non-zero

Every user is checked (grants against their charge records, the cached credit against
DynamoDB's, the ledger's charges against the usage records), each divergence re-read once
before it counts; nothing is repaired.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from usage_limits.entitlements.audit import AuditReport
from usage_limits.entitlements.auditor import Auditor, AuditSettings
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore
from usage_limits.entitlements.usage_store import UsageSettings, UsageStore


def run_audit(redis_url: str, dynamo_url: str | None, *, entitlements_table: str,
              usage_table: str | None = None, users: Sequence[str] | None = None,
              cluster: bool = False, region: str = "us-east-1", write_bound_s: float = 0.0,
              recheck_s: float = 1.0, concurrency: int = 8) -> AuditReport:
    """Audit the books of ``users`` (default: those active in the last hour, from the usage
    records) and return the report (``report.balanced`` False: the run fails).

    Args:
        redis_url: the ledger (``redis://host:port``; with ``cluster``, any node).
        dynamo_url: the DynamoDB endpoint (``local.dynamodb.DynamoServer.url``); None:
            boto3's own (AWS, or moto's in-process mock).
        entitlements_table: the entitlements table.
        usage_table: the usage records' table (None: usage records are not compared).
        users: the users to audit.
        cluster: ``redis_url`` is a node of a Redis Cluster.
        write_bound_s: how long records may take to land (0 once the load has stopped).
        recheck_s: the pause before a divergence is read again.
        concurrency: users audited at once.

    Raises:
        InvalidArgument: neither ``users`` nor a ``usage_table`` to find them.
        StoreUnavailable, LimiterUnavailable: DynamoDB or Redis failed.
    """
    store = EntitlementStore(StoreSettings(table=entitlements_table, endpoint_url=dynamo_url,
                                           region=region, read_timeout_s=10.0))
    usage = None if usage_table is None else UsageStore(UsageSettings(
        table=usage_table, endpoint_url=dynamo_url, region=region, read_timeout_s=10.0))
    settings = AuditSettings(write_bound_s=write_bound_s, recheck_s=recheck_s,
                             concurrency=concurrency)

    async def go() -> AuditReport:
        redis: Any
        if cluster:
            from redis.asyncio.cluster import RedisCluster

            redis = RedisCluster.from_url(redis_url)
        else:
            from redis.asyncio import Redis

            redis = Redis.from_url(redis_url)
        try:
            auditor = Auditor(store, redis, usage, settings=settings, repair=False)
            return await auditor.run(users=users, move_mark=False)
        finally:
            await redis.aclose()

    loop = asyncio.new_event_loop()  # never made current: the caller's thread keeps its own
    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()
