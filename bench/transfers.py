"""The DynamoDB side of one request, per path: calls made and their time, against the local
DynamoDB server (moto's, over HTTP, as ``make serve`` runs it).

    python bench/transfers.py [--requests 200] [--quick] [--json rows.json]

Paths: a request drawing credit that succeeds (reserve, post) or fails (reserve, void); a
quota-only request (its item at reserve time, then post); a credit request planned from a
stale grant hint (a refused write and a re-read before its reserve lands). Times are the
local server's, on this machine: they compare paths, not AWS.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[1] / "layers" / "usage_limits")]

from local.dynamodb import DynamoServer  # noqa: E402
from usage_limits.credit import TransferBook  # noqa: E402
from usage_limits.credit.request import RequestTransfer  # noqa: E402
from usage_limits.entitlements.config import StoreSettings  # noqa: E402
from usage_limits.entitlements.store import EntitlementStore  # noqa: E402

PATHS = ("credit, served", "credit, failed", "quota only", "credit, stale hint")


class Counting:
    """A boto3 client that counts its calls."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._inner, name)
        if not callable(real) or name.startswith("_") or name in ("meta", "exceptions"):
            return real

        def call(**kwargs: Any) -> Any:
            self.calls[name] += 1
            return real(**kwargs)
        return call


async def one(book: TransferBook, store: EntitlementStore, path: str, i: int,
              hint: Any) -> None:
    """One request of ``path``."""
    req = RequestTransfer(book, "bench", f"p{PATHS.index(path)}-{i}", "n",
                          hold_ms=int(time.time() * 1000) + 60_000)
    if path == "quota only":
        await req.reserve(3, 0)
        await req.post(3)
        return
    if path == "credit, stale hint":  # grant a as it was before other requests spent it
        hint = tuple(dataclasses.replace(g, consumed=0) if g.reference == "a" else g
                     for g in hint)
    opened = await req.reserve(3, 2, hint)
    if opened.outcome != "go":
        raise RuntimeError(f"{path}: {opened}")
    if path == "credit, failed":
        await req.void()
    else:
        await req.post(3)


def run(requests: int) -> list[dict[str, Any]]:
    """Every path, ``requests`` times each; one row per path."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "local")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "local")
    rows = []
    with DynamoServer(table="bench-transfers") as server:
        settings = StoreSettings(table=server.table, region="us-east-1",
                                 endpoint_url=server.url)
        store = EntitlementStore(settings)
        store.create_grant("bench", tokens=10**9, kind="paid", reference="b",
                           expires_at_ms=None, actor="bench", reason="bench")
        store.create_grant("bench", tokens=2 * requests, kind="promo", reference="a",
                           expires_at_ms=int(time.time() * 1000) + 86_400_000,
                           actor="bench", reason="bench")
        counting = Counting(TransferBook(settings).client)
        book = TransferBook(settings, client=counting)
        for path in PATHS:
            if path == "credit, stale hint":  # spend grant a: every hint of it is stale
                left = next(g.remaining for g in store.load("bench").grants
                            if g.reference == "a")
                drain = RequestTransfer(book, "bench", "drain", "n",
                                        hold_ms=int(time.time() * 1000) + 60_000)
                asyncio.run(drain.reserve(left, left, store.load("bench").grants))
                asyncio.run(drain.post(left))
            times, calls = [], []
            for i in range(requests):
                hint = store.load("bench").grants  # fresh, outside the timing
                counting.calls.clear()
                start = time.perf_counter()
                asyncio.run(one(book, store, path, i, hint))
                times.append((time.perf_counter() - start) * 1000)
                calls.append(sum(counting.calls.values()))
            rows.append({"path": path, "requests": requests,
                         "calls": statistics.median(calls), "calls_max": max(calls),
                         "p50_ms": round(statistics.median(times), 2),
                         "p95_ms": round(sorted(times)[int(0.95 * (len(times) - 1))], 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="20 requests per path")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    rows = run(20 if args.quick else args.requests)
    print(f"{'path':<22}{'calls':>7}{'max':>5}{'p50 ms':>9}{'p95 ms':>9}")
    for r in rows:
        print(f"{r['path']:<22}{r['calls']:>7}{r['calls_max']:>5}{r['p50_ms']:>9}"
              f"{r['p95_ms']:>9}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
