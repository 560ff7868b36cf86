"""What operator changes cost one user's in-flight requests: 503s per change rate.

N processes (default 8) each run the entitlements part of the request path (reserve, the
draw recorded in DynamoDB, keep / refund / settle; ``local/credit_load.py``) for ONE user
with a paid grant and a 2-token quota (so nearly every charge draws credit), while the
main process makes operator changes through the operator actions (a small extra grant, a
plan change, a void of the extra grant, a support refund, in turn) at a given rate. Each
rate is a phase of its own with a fresh user, side by side in one run: requests, 503s,
their share, and the step that made each 503; after each phase, whether credit is
conserved (every grant's consumed equals its live charge records, and the user's copy
holds what DynamoDB holds).

    .venv/bin/python bench/operator_changes.py                  # 20 s per rate
    .venv/bin/python bench/operator_changes.py --quick          # 4 s per rate, 4 processes
    .venv/bin/python bench/operator_changes.py --rates 0,1 --seconds 30 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "layers" / "usage_limits", ROOT / "layers" / "providers"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from local.credit_load import (  # noqa: E402
    Target,
    ledger,
    one_request,
    operator_change,
    operator_for,
    redis_client,
    store_for,
)

#: The user's paid grant: large enough that exhaustion is not what the run measures.
GRANT = 100_000
COST = 2
RATES = (0.0, 0.2, 1.0, 5.0)


async def _requests(target: Target, url: str, table: str, user: str, worker: int,
                    stop_at: float) -> list[dict[str, Any]]:
    """Requests one after another until ``stop_at``; every fourth refunded, every fourth
    settled to 1 token."""
    from usage_limits.entitlements.cache import EntitlementCache

    client = redis_client(target)
    budget, cache = ledger(client), EntitlementCache(store_for(url, table))
    out: list[dict[str, Any]] = []
    try:
        await client.ping()
        i = 0
        while time.time() < stop_at:
            lower_to = {1: 0, 2: 1}.get(i % 4)
            o = await one_request(cache, budget, user, f"w{worker}-{i}", COST, lower_to)
            out.append(o.__dict__)
            i += 1
    finally:
        await client.aclose()
    return out


def _worker(args: tuple[Any, ...]) -> list[dict[str, Any]]:
    import logging

    # the cache's warnings are collected per request (their cause), not printed
    logging.getLogger("usage_limits.entitlements").propagate = False
    return asyncio.run(_requests(*args))


async def _operator(target: Target, url: str, table: str, user: str, rate: float,
                    stop_at: float) -> Counter[str]:
    """Operator changes at ``rate`` per second until ``stop_at``; their kinds, counted."""
    from usage_limits.entitlements.cache import EntitlementCache

    client = redis_client(target)
    store = store_for(url, table)
    budget = ledger(client)
    operator = operator_for(store, budget, EntitlementCache(store))
    made: Counter[str] = Counter()
    try:
        n = 0
        next_at = time.time() + 0.5 / rate if rate else stop_at
        while rate and time.time() < stop_at:
            await asyncio.sleep(max(0.0, next_at - time.time()))
            if time.time() >= stop_at:
                break
            made[await operator_change(operator, user, n)] += 1
            n += 1
            next_at += 1.0 / rate
    finally:
        await client.aclose()
    return made


async def conserved(target: Target, url: str, table: str, user: str) -> dict[str, Any]:
    """Whether credit is conserved for ``user`` at rest: per grant, consumed equals its
    live charge records, within [0, tokens]; the user's copy holds what DynamoDB holds."""
    from usage_limits.entitlements.cache import EntitlementCache, live_grants

    store = store_for(url, table)
    record = store.load(user)
    held: Counter[str] = Counter()
    for charge in store.charge_records(user):
        held.update(charge.consumed)
    per_grant = all(g.consumed == held.get(g.reference, 0) and 0 <= g.consumed <= g.tokens
                    for g in record.grants)
    client = redis_client(target)
    try:
        report = await EntitlementCache(store).usage(ledger(client), user)
        copy = {g.reference: g.remaining for g in report.grants}
    finally:
        await client.aclose()
    truth = {g.reference: g.remaining for g in live_grants(record, int(time.time() * 1000))}
    return {"per_grant": per_grant, "copy_matches": copy == truth,
            "consumed": sum(g.consumed for g in record.grants)}


def phase(pool: Any, target: Target, url: str, table: str, rate: float, processes: int,
          seconds: float) -> dict[str, Any]:
    """One rate: a fresh user, ``processes`` workers for ``seconds``, operator changes at
    ``rate``. Returns the phase's figures."""
    user = "opch-" + uuid.uuid4().hex[:8]
    store = store_for(url, table)
    store.create_grant(user, tokens=GRANT, kind="paid", reference="paid", expires_at_ms=None,
                       actor="bench", reason="operator-changes")
    stop_at = time.time() + 1.0 + seconds  # the workers' start-up inside the first second
    pending = pool.map_async(_worker, [(target, url, table, user, w, stop_at)
                                       for w in range(processes)])
    time.sleep(1.0)
    made = asyncio.run(_operator(target, url, table, user, rate, stop_at))
    outcomes = [o for per in pending.get() for o in per]
    unavailable = [o for o in outcomes if o["status"] == "unavailable"]
    records = {(c.request_id, c.nonce): c for c in store.charge_records(user)}
    # a 503 saying "nothing was charged" must hold no credit in the record of truth
    untrue = 0
    for o in unavailable:
        record = records.get((o["request_id"], o["nonce"]))
        if "nothing was charged" in o["message"] and record is not None \
                and any(record.consumed.values()):
            untrue += 1
    return {"rate": rate, "seconds": seconds, "changes": sum(made.values()),
            "made": dict(made), "requests": len(outcomes),
            "served": sum(o["status"] == "served" for o in outcomes),
            "rejected": sum(o["status"] == "rejected" for o in outcomes),
            "unavailable": len(unavailable),
            "share": len(unavailable) / len(outcomes) if outcomes else 0.0,
            "causes": dict(Counter(o["cause"] for o in unavailable)),
            "messages": dict(Counter(o["message"] for o in unavailable)),
            "untrue_messages": untrue,
            "spent": sum(o["spent"] for o in outcomes),
            **asyncio.run(conserved(target, url, table, user))}


def table_rows(rows: list[dict[str, Any]]) -> str:
    """The results as a fixed-width table (``made/s``: the rate the changes achieved; one
    change takes several DynamoDB calls, so a loaded host makes fewer than asked)."""
    lines = [f"{'changes/s':>9} {'made/s':>6} {'changes':>7} {'requests':>8} {'503':>5} "
             f"{'share':>7} {'conserved':>9}  causes of 503"]
    for r in rows:
        causes = ", ".join(f"{k} {v}" for k, v in sorted(r["causes"].items())) or "-"
        ok = "yes" if r["per_grant"] and r["copy_matches"] and not r["untrue_messages"] \
            else "NO"
        rate = "none" if not r["rate"] else f"{r['rate']:g}"
        lines.append(f"{rate:>9} {r['changes'] / r['seconds']:>6.2f} {r['changes']:>7} "
                     f"{r['requests']:>8} {r['unavailable']:>5} {100 * r['share']:>6.2f}% "
                     f"{ok:>9}  {causes}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, help="default 8 (--quick: 4)")
    parser.add_argument("--seconds", type=float, help="per rate; default 20 (--quick: 4)")
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES),
                        help="operator changes per second, comma-separated (0: none)")
    parser.add_argument("--quick", action="store_true",
                        help="4 processes, 4 s per rate unless given (a smoke run)")
    parser.add_argument("--cluster", action="store_true", help="a 3-master cluster")
    parser.add_argument("--json", help="write the rows as JSON here too")
    args = parser.parse_args()
    args.processes = args.processes or (4 if args.quick else 8)
    args.seconds = args.seconds or (4.0 if args.quick else 20.0)
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        parser.error(f"--rates: {args.rates!r} is not comma-separated numbers")
    if any(r < 0 for r in rates) or args.processes < 1 or args.seconds <= 0:
        parser.error("rates must be >= 0, --processes >= 1 and --seconds > 0")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "local")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

    from local.dynamodb import DynamoServer
    from local.redis_servers import RedisCluster3, RedisServer

    redis_cm: Any = RedisCluster3() if args.cluster else RedisServer()
    with redis_cm as redis_server, DynamoServer(table="operator-changes") as dynamo:
        target: Target = (("cluster", list(redis_server.startup_nodes)) if args.cluster
                          else ("standalone", [("127.0.0.1", redis_server.port)]))
        rows = []
        with mp.get_context("spawn").Pool(args.processes) as pool:
            for rate in rates:
                rows.append(phase(pool, target, dynamo.url, dynamo.table, rate,
                                  args.processes, args.seconds))
    print(f"operator changes vs one user's requests: {args.processes} processes, "
          f"{args.seconds:g} s per rate, cost {COST}, quota 2 tokens, grant {GRANT}")
    print(table_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
