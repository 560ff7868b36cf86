"""What usage records add to a metered request, and the DynamoDB writes they cost.

Runs in one process against a private redis-server and a local DynamoDB (moto's server,
over HTTP, as ``make serve`` runs it):

- p50/p99 of a full handler invocation (Mangum + FastAPI + middleware + reserve + a
  provider call of ``--provider-ms``) of a metered route with usage records on, side by
  side with the same route with them off, calls interleaved so both see the same machine;
- the DynamoDB writes per request, counted at the client (botocore's ``after-call``
  event) for a request that succeeds, one that settles and one that fails (refunded),
  and the size of a record's item: DynamoDB bills one write unit per write of an item
  up to 1 KB (moto's own ``ConsumedCapacity`` figures are not DynamoDB's, so they are not
  shown);
- the active-user markers written (one per user-hour, whatever the requests).

    .venv/bin/python bench/usage_records.py [--requests 1000] [--provider-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [str(ROOT / "layers" / "usage_limits"), str(ROOT / "layers" / "providers")]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for local.*; the layers come first only in main()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Writes:
    """Counts the DynamoDB calls a client makes, by operation."""

    def __init__(self, client: Any) -> None:
        self.calls: dict[str, int] = {}
        client.meta.events.register("after-call.dynamodb.*", self._count)

    def _count(self, model: Any, **_: Any) -> None:
        self.calls[model.name] = self.calls.get(model.name, 0) + 1

    def total(self) -> int:
        return sum(n for op, n in self.calls.items() if op in ("PutItem", "UpdateItem"))


class Bench:
    """A metered app with an ``ok``, a ``settles`` and a ``fails`` route, each calling a
    stand-in provider that takes ``provider_ms``; records switched on and off per call."""

    def __init__(self, redis_url: str, dynamo_url: str, table: str, provider_ms: float,
                 ) -> None:
        from fastapi import Depends
        from fastapi.responses import JSONResponse
        from mangum import Mangum

        from local.lambda_events import FakeContext, http_event
        from usage_limits.entitlements.usage_store import UsageSettings, UsageStore
        from usage_limits.web import create_app, require_tokens, settings

        os.environ.update(REDIS_URL=redis_url, ATTO_BUDGET="100000000/1h,1000000000/30d",
                          POWERTOOLS_METRICS_DISABLED="true", LOG_LEVEL="WARNING",
                          AWS_ACCESS_KEY_ID="local", AWS_SECRET_ACCESS_KEY="local",
                          AWS_DEFAULT_REGION="us-east-1")
        for name in ("ATTO_USAGE_TABLE", "ATTO_ENTITLEMENTS_TABLE", "ATTO_ENV"):
            os.environ.pop(name, None)
        settings.cache_clear()
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        app = create_app("records")
        pause = provider_ms / 1000
        charged = Depends(require_tokens(cost=3))

        @app.post("/ok", dependencies=[charged])
        async def ok() -> dict[str, bool]:
            await asyncio.sleep(pause)
            return {"ok": True}

        @app.post("/settles")
        async def settles(charge: Any = charged) -> dict[str, bool]:  # noqa: B008
            await asyncio.sleep(pause)
            await charge.settle(1)
            return {"ok": True}

        @app.post("/fails", dependencies=[charged])
        async def fails() -> Any:
            await asyncio.sleep(pause)
            return JSONResponse({"error": {"code": "provider_error", "message": "x"}},
                                status_code=502)

        self.handler = Mangum(app, lifespan="off")
        self.context = FakeContext
        self.store = UsageStore(UsageSettings(table=table, endpoint_url=dynamo_url,
                                              region="us-east-1"))
        self.writes = Writes(self.store.client)
        self.http_event = http_event
        self.calls = 0
        for _ in range(50):  # warm up: imports, connections, script cache
            self.invoke("ok", True)
            self.invoke("ok", False)

    def invoke(self, route: str, records_on: bool, user: str = "bench-user") -> float:
        """One full handler invocation, µs."""
        from usage_limits.entitlements.usage_store import set_usage_store

        set_usage_store(self.store if records_on else None)
        self.calls += 1
        event = self.http_event("POST", f"/{route}", body={}, user=user,
                                request_id=f"{route}-{self.calls}")
        start = time.perf_counter()
        self.handler(event, self.context())
        return (time.perf_counter() - start) * 1e6

    def latency(self, requests: int) -> dict[bool, list[float]]:
        """``requests`` calls with records on and off, interleaved; samples in µs."""
        samples: dict[bool, list[float]] = {True: [], False: []}
        for i in range(requests):
            for on in ((True, False) if i % 2 else (False, True)):
                samples[on].append(self.invoke("ok", on))
        return samples

    def writes_per_request(self, route: str, requests: int = 50) -> float:
        """DynamoDB writes per request of ``route`` with records on (one user already
        marked active this hour)."""
        self.invoke(route, True)
        calls = self.writes.total()
        for _ in range(requests):
            self.invoke(route, True)
        return (self.writes.total() - calls) / requests

    def item_bytes(self) -> int:
        """The largest record item's size as DynamoDB counts it (names + values, bytes)."""
        page = self.store.client.query(
            TableName=self.store.table, KeyConditionExpression="pk = :pk",
            ExpressionAttributeValues={":pk": {"S": "U#bench-user"}}, Limit=50)
        return max(sum(len(k) + len(next(iter(v.values()))) for k, v in item.items())
                   for item in page["Items"])

    def markers(self, users: int) -> tuple[int, int]:
        """(requests, markers written) for ``users`` new users of two requests each."""
        before = self.writes.calls.get("PutItem", 0)
        for i in range(users):
            user = f"marker-{self.calls}-{i}"
            for _ in range(2):
                self.invoke("ok", True, user=user)
        return 2 * users, self.writes.calls.get("PutItem", 0) - before

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
        asyncio.set_event_loop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--provider-ms", type=float, default=20.0,
                        help="how long the stand-in provider call takes")
    parser.add_argument("--quick", action="store_true", help="a short run (200 requests)")
    args = parser.parse_args()
    sys.path[:0] = LAYERS
    if args.quick:
        args.requests = 200
    from local.dynamodb import DynamoServer
    from local.redis_servers import RedisServer

    with RedisServer() as redis_server, DynamoServer() as dynamo:
        bench = Bench(redis_server.url, dynamo.url, dynamo.usage_table, args.provider_ms)
        try:
            samples = bench.latency(args.requests)
            writes = {route: bench.writes_per_request(route)
                      for route in ("ok", "settles", "fails")}
            requests, markers = bench.markers(20)
            size = bench.item_bytes()
        finally:
            bench.close()
    print(f"\nFull handler invocation of a metered route (provider call {args.provider_ms:g} "
          f"ms), {args.requests} requests each, interleaved (ms)\n")
    print("| usage records | p50 ms | p99 ms |")
    print("|---|---:|---:|")
    p50 = {on: percentile(s, 0.5) / 1000 for on, s in samples.items()}
    p99 = {on: percentile(s, 0.99) / 1000 for on, s in samples.items()}
    for on in (False, True):
        print(f"| {'on' if on else 'off'} | {p50[on]:.2f} | {p99[on]:.2f} |")
    print(f"| records add | {p50[True] - p50[False]:+.2f} | {p99[True] - p99[False]:+.2f} |")
    print("\nDynamoDB writes per request with records on (a user already active this hour)\n")
    print("| request | writes | write units |")
    print("|---|---:|---:|")
    names = {"ok": "succeeds", "settles": "settles", "fails": "fails (refunded)"}
    units = 1 if size <= 1024 else -(-size // 1024)
    for route, calls in writes.items():
        print(f"| {names[route]} | {calls:.2f} | {calls * units:.2f} |")
    print(f"\nA record's item: {size} bytes at most, so {units} write unit per write")
    print(f"\nActive-user markers: {markers} written for {requests} requests of "
          f"{requests // 2} new users (one per user-hour)")


if __name__ == "__main__":
    main()
