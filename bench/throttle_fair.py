"""Provider throttle: fair shares of a saturated provider, against first come, first served.

Starts a private redis-server and two providers limited to RATE calls/s (burst 1, the default
15 ms jitter allowance), then runs both side by side for DURATION seconds from the same
processes: HEAVY_PROCS processes each keep HEAVY_TASKS requests of the user ``heavy`` in
flight (40 in all), and LIGHT_USERS other processes each keep one request of their own user
in flight. Each request asks for a slot (``ProviderThrottle.admit``, wait limit 29 s), then
holds the "upstream call" for CALL_S and asks again.

    fcfs   every request under one user (``user=None``): the queue is first come, first
           served, as it was before fair queuing
    fair   every request under its own user: start-time fair queuing across users

Columns (over the slots booked from WARMUP_S after the start to the end):
    wait p50/p95   slot booked minus the moment the request asked, seconds
    share          the user's share of the slots booked
    calls/adm      script calls per admission (1 when a slot is booked at once)
and per provider: slots per second against the limit, the most slots in any 1 s window,
requests refused (ProviderBusy), script calls per admission over all users.

    .venv/bin/python bench/throttle_fair.py            # 60 s
    .venv/bin/python bench/throttle_fair.py --quick    # 6 s (what the test runs)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for local.redis_servers
sys.path.insert(1, str(ROOT / "layers" / "usage_limits"))

RATE = 10.0
HEAVY_PROCS, HEAVY_TASKS, LIGHT_USERS = 4, 10, 4
CALL_S = 0.05
WAIT_LIMIT_S = 29.0
MODES = ("fcfs", "fair")


def worker(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One process: its tasks on both providers, until the end; every admission's record."""
    return asyncio.run(_worker(cfg))


async def _worker(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import redis.asyncio as aioredis

    from usage_limits.exceptions import ProviderBusy
    from usage_limits.throttle import ProviderThrottle

    client = aioredis.Redis(port=cfg["port"], socket_timeout=30)
    await asyncio.gather(*(client.ping() for _ in range(2 * cfg["tasks"])))
    records: list[dict[str, Any]] = []

    async def task(mode: str) -> None:
        throttle = ProviderThrottle(client, f"{cfg['run']}-{mode}", rate=RATE, burst=1)
        user = cfg["user"] if mode == "fair" else None
        while time.time() < cfg["end"]:
            asked = time.time()
            try:
                got = await throttle.admit(max_wait_s=WAIT_LIMIT_S, user=user)
            except ProviderBusy:
                records.append({"mode": mode, "user": cfg["user"], "refused": True})
                continue
            records.append({"mode": mode, "user": cfg["user"], "refused": False,
                            "asked": asked, "slot": got.slot_at, "calls": got.calls})
            await asyncio.sleep(CALL_S)

    await asyncio.sleep(max(0.0, cfg["start"] - time.time()))
    tasks = [asyncio.create_task(task(mode)) for mode in MODES for _ in range(cfg["tasks"])]
    # Requests still waiting at the end are dropped: their slots lie after it.
    await asyncio.wait(tasks, timeout=max(0.0, cfg["end"] - time.time()) + 0.5)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()
    return records


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def max_in_window(times: list[float], width: float = 1.0) -> int:
    """The most of ``times`` in any half-open window [t, t + width)."""
    ordered, best, first = sorted(times), 0, 0
    for last, t in enumerate(ordered):
        while ordered[first] <= t - width:
            first += 1
        best = max(best, last - first + 1)
    return best


def run(duration: float, warmup: float) -> dict[str, Any]:
    """Both modes side by side; per mode and user: waits, shares, calls per admission."""
    from local.redis_servers import RedisServer

    users = ["heavy"] * HEAVY_PROCS + [f"light{i + 1}" for i in range(LIGHT_USERS)]
    with RedisServer() as server:
        start = time.time() + 8.0  # the processes start and connect meanwhile
        cfgs = [{"port": server.port, "run": f"fair-{int(start)}", "user": user,
                 "tasks": HEAVY_TASKS if user == "heavy" else 1, "start": start,
                 "end": start + duration} for user in users]
        with multiprocessing.get_context("spawn").Pool(len(cfgs)) as pool:
            records = [r for part in pool.map(worker, cfgs) for r in part]
    lo, hi = start + warmup, start + duration
    out: dict[str, Any] = {"duration": duration, "warmup": warmup, "modes": {}}
    for mode in MODES:
        mine = [r for r in records if r["mode"] == mode]
        booked = [r for r in mine if not r["refused"] and lo <= r["slot"] < hi]
        rows = {}
        for user in dict.fromkeys(users):
            theirs = [r for r in booked if r["user"] == user]
            waits = [r["slot"] - r["asked"] for r in theirs]
            rows[user] = {"p50": pct(waits, 0.5), "p95": pct(waits, 0.95),
                          "share": len(theirs) / max(1, len(booked)),
                          "calls": sum(r["calls"] for r in theirs) / max(1, len(theirs)),
                          "refused": sum(1 for r in mine if r["user"] == user and r["refused"])}
        slots = [r["slot"] for r in mine if not r["refused"]]
        out["modes"][mode] = {
            "users": rows, "rate": len(booked) / (hi - lo),
            "max_1s": max_in_window(slots),
            "calls": sum(r["calls"] for r in booked) / max(1, len(booked)),
            "refused": sum(1 for r in mine if r["refused"])}
    return out


def table(result: dict[str, Any]) -> str:
    """The result as a Markdown table, then one line per provider."""
    lines = ["| user | fcfs wait p50 / p95 s | fcfs share | fair wait p50 / p95 s | fair share"
             " | fair calls/adm |", "|---|---|---|---|---|---|"]
    fcfs, fair = (result["modes"][m]["users"] for m in MODES)
    for user in fcfs:
        a, b = fcfs[user], fair[user]
        lines.append(f"| {user} | {a['p50']:.2f} / {a['p95']:.2f} | {100 * a['share']:.1f}% | "
                     f"{b['p50']:.2f} / {b['p95']:.2f} | {100 * b['share']:.1f}% | "
                     f"{b['calls']:.2f} |")
    for mode in MODES:
        m = result["modes"][mode]
        lines.append(f"{mode}: {m['rate']:.2f} slots/s of {RATE:g}/s "
                     f"({100 * m['rate'] / RATE:.1f}%), at most {m['max_1s']} in any 1 s, "
                     f"{m['refused']} refused, {m['calls']:.2f} script calls per admission")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 s instead of 60 s")
    parser.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = parser.parse_args()
    duration, warmup = (6.0, 2.0) if args.quick else (60.0, 5.0)
    result = run(duration, warmup)
    print(f"{HEAVY_PROCS} processes x {HEAVY_TASKS} requests of one heavy user, "
          f"{LIGHT_USERS} light users x 1 request, provider at {RATE:g}/s (burst 1), "
          f"{duration:g} s, counted from {warmup:g} s")
    print(table(result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
