"""What one run of the conservation auditor costs, for N active users: DynamoDB calls and
read units, Redis calls, and time.

Each user gets typical books through the real code: a paid grant, then ``--charges``
reservations of 1 token (``EntitlementCache.reserve`` on a private Redis) under a plan whose
30-day quota is 8 tokens, so the later ones draw from the grant and record their draws in
DynamoDB (``commit_draw``, the ``C#`` records); each charge has its usage record and the
user an active-hour marker. DynamoDB is moto, in process. Then one run of the auditor over
the active users (``Auditor.run``), with every DynamoDB call counted by a botocore hook:
read units are computed as DynamoDB bills a strongly consistent read (per call, the bytes
of the items returned rounded up to 4 KB, at least one unit), since moto's own
``ConsumedCapacity`` is a constant.

    .venv/bin/python bench/books_audit.py [--users 200,2000] [--charges 12]

Time on moto is moto's (a few ms per call, in this process); on AWS a call takes a few ms
over the network instead, and the run audits ``ATTO_AUDIT_CONCURRENCY`` users at once.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for local.redis_servers

import boto3  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from moto import mock_aws  # noqa: E402

from local.redis_servers import RedisServer  # noqa: E402
from usage_limits.budget import TokenBudget, Window  # noqa: E402
from usage_limits.entitlements.auditor import Auditor, AuditSettings  # noqa: E402
from usage_limits.entitlements.cache import EntitlementCache  # noqa: E402
from usage_limits.entitlements.config import StoreSettings  # noqa: E402
from usage_limits.entitlements.store import EntitlementStore  # noqa: E402
from usage_limits.entitlements.usage import UsageRecord  # noqa: E402
from usage_limits.entitlements.usage_store import UsageSettings, UsageStore  # noqa: E402

REGION = "us-east-1"
PLAN = [Window(limit=1000, seconds=3600), Window(limit=8, seconds=30 * 86400)]
ROUTE = "POST /v1/embeddings"


def item_bytes(item: dict[str, Any]) -> int:
    """An item's size as DynamoDB counts it, near enough: names plus values (a number is
    about one byte per two digits, plus one)."""
    def value(v: dict[str, Any]) -> int:
        (kind, x), = v.items()
        if kind == "S":
            return len(x.encode())
        if kind == "N":
            return len(x) // 2 + 1
        if kind == "B":
            return len(x)
        if kind in ("BOOL", "NULL"):
            return 1
        if kind == "M":
            return 3 + sum(len(k) + value(w) for k, w in x.items())
        if kind == "L":
            return 3 + sum(value(w) for w in x)
        return len(str(x))
    return sum(len(k) + value(v) for k, v in item.items())


class Meter:
    """Counts a client's calls and the read units they would bill."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.read_units = 0.0
        self.write_units = 0.0
        self.read_bytes = 0

    def attach(self, client: Any) -> Any:
        client.meta.events.register("after-call.dynamodb", self._after)
        return client

    def _after(self, http_response: Any, parsed: dict[str, Any], model: Any,
               **_: Any) -> None:
        op = model.name
        self.calls[op] += 1
        if op in ("Query", "GetItem", "Scan"):
            items = parsed.get("Items") or ([parsed["Item"]] if parsed.get("Item") else [])
            size = sum(item_bytes(i) for i in items)
            self.read_bytes += size
            self.read_units += max(1, math.ceil(size / 4096))
        elif op in ("PutItem", "UpdateItem", "DeleteItem"):
            self.write_units += 1

    def reset(self) -> None:
        self.calls.clear()
        self.read_units = self.write_units = 0.0
        self.read_bytes = 0


async def seed(users: list[str], charges: int, store: EntitlementStore, usage: UsageStore,
               budget: TokenBudget, cache: EntitlementCache) -> None:
    """Typical books for each user, through the real hot-path code."""
    now = int(time.time() * 1000)
    for user in users:
        store.create_grant(user, tokens=500, kind="paid", reference="inv-1",
                           expires_at_ms=None, actor="bench", reason="bench")
        for i in range(charges):
            rid = f"r:{i:04d}"
            d = await cache.reserve(budget, user, rid, 1, route=ROUTE)
            assert d.allowed, d
            if d.draws:
                state = await cache.commit_draw(budget, user, rid, d.nonce, d, route=ROUTE)
                assert state == "recorded", state
            usage.put(UsageRecord(user, rid, d.nonce, ROUTE, "bench", 1, 1, tuple(d.draws),
                                  "charged", now))
        usage.mark_active(user, now)


async def measure(n: int, charges: int, redis_url: str) -> dict[str, Any]:
    """Seed ``n`` users, then time and count one audit run over them."""
    meter = Meter()
    with mock_aws():
        client = meter.attach(boto3.client("dynamodb", region_name=REGION))
        store = EntitlementStore(StoreSettings(table=f"ent-{n}", region=REGION), client=client)
        usage = UsageStore(UsageSettings(table=f"usage-{n}", region=REGION), client=client)
        store.create_table()
        usage.create_table()
        redis = aioredis.Redis.from_url(redis_url)
        budget = TokenBudget(redis, PLAN, entitlements=True)
        cache = EntitlementCache(store)
        users = [uuid.uuid4().hex for _ in range(n)]
        await seed(users, charges, store, usage, budget, cache)
        before = await redis.info("commandstats")
        meter.reset()
        auditor = Auditor(store, redis, usage, settings=AuditSettings(recheck_s=0,
                                                                      write_bound_s=0))
        start = time.perf_counter()
        report = await auditor.run()
        elapsed = time.perf_counter() - start
        after = await redis.info("commandstats")
        await redis.aclose()
    redis_calls = sum(v["calls"] for k, v in after.items() if k.startswith("cmdstat_evalsha")) \
        - sum(v["calls"] for k, v in before.items() if k.startswith("cmdstat_evalsha"))
    return {"users": n, "audited": report.users_audited, "divergences": len(report.divergences),
            "calls": dict(meter.calls), "read_units": meter.read_units,
            "write_units": meter.write_units, "read_bytes": meter.read_bytes,
            "redis_calls": redis_calls, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", default="200,2000", help="comma-separated user counts")
    parser.add_argument("--charges", type=int, default=12, help="charges per user")
    args = parser.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    rows = []
    with RedisServer() as server:
        for n in (int(x) for x in args.users.split(",")):
            rows.append(asyncio.run(measure(n, args.charges, server.url)))
    print(f"one audit run, {args.charges} charges per user (moto DynamoDB, private Redis)")
    print(f"{'users':>6} {'audited':>7} {'diverged':>8} {'DynamoDB calls':>15} "
          f"{'read units':>10} {'RU/user':>7} {'writes':>6} {'Redis calls':>11} "
          f"{'run s':>7} {'ms/user':>7}")
    for r in rows:
        print(f"{r['users']:>6} {r['audited']:>7} {r['divergences']:>8} "
              f"{sum(r['calls'].values()):>15} {r['read_units']:>10.0f} "
              f"{r['read_units'] / r['users']:>7.2f} {r['write_units']:>6.0f} "
              f"{r['redis_calls']:>11} {r['seconds']:>7.2f} "
              f"{1000 * r['seconds'] / r['users']:>7.2f}")
    for r in rows:
        print(f"calls by operation, {r['users']} users: {r['calls']}; bytes read per user "
              f"{r['read_bytes'] / r['users']:.0f}")


if __name__ == "__main__":
    main()
