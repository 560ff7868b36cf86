"""Provider throttle: one shared limit across processes, against two common alternatives.

Starts a private redis-server, then runs the same load three times: PROCS worker processes
x TASKS asyncio tasks each, all calling one provider limited to RATE calls/s for DURATION
seconds, every task asking for its next call as soon as the previous one started.

    ours       usage_limits.ProviderThrottle (GCRA reservation in Redis, sleep to the slot)
    aiolimiter AsyncLimiter(RATE, 1) in each process (an in-process limiter)
    pyrate     pyrate_limiter Limiter over a RedisBucket (shared sliding-window log in
               Redis; waiters poll it with the library's default buffer)

Columns:
    granted/s      calls started in the run / DURATION
    max in 1 s     most call starts in any sliding window [t, t + 1 s); GCRA's bound with
                   burst 1 is RATE * t + 1 = 21 (a late start can share a window with the
                   slot one second after it)
    max in 0.1 s   the same over 100 ms: how bursty the calls are (bound 3)
    util %         granted/s / RATE
    late p50/p99   ours: call start minus its reserved slot. pyrate: call start minus the
                   moment its capacity freed (the start of the call RATE places earlier + 1 s,
                   i.e. when the sliding window let it in). aiolimiter: n/a (no shared
                   schedule: each process has its own limit, so nothing is "late")
    refused        calls that gave up: no slot before the end of the run (ours: ProviderBusy,
                   one per task whose next slot would fall after the end; the others: timeout)
    redis/adm      Redis commands sent by the workers during the run (counted in the client;
                   commands inside scripts are not round trips) per call started, refused
                   calls included
    evalsha/adm    ours only: script calls of admitted calls per admitted call

    .venv/bin/python bench/throttle.py            # 8 x 25 tasks at 20/s for 10 s, each
    .venv/bin/python bench/throttle.py --quick    # 3 s each
    .venv/bin/python bench/throttle.py --out DIR  # where the PNG goes (default bench/out/)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for local.redis_servers
sys.path.insert(1, str(ROOT / "layers" / "usage_limits"))

PROCS, TASKS, RATE = 8, 25, 20.0
LIMITERS = ["ours", "aiolimiter", "pyrate"]


# --------------------------------------------------------------------------- worker side

async def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """One process: TASKS tasks calling the limiter back to back until the end time."""
    import redis.asyncio as aioredis

    client = aioredis.Redis(port=cfg["port"], socket_timeout=30)
    # Warm pool: one open connection per task, as in a service that has been running.
    await asyncio.gather(*(client.ping() for _ in range(cfg["tasks"])))
    kind, rate = cfg["limiter"], cfg["rate"]
    sent: dict[str, int] = {}  # commands this process sent to Redis, by name
    execute = client.execute_command

    async def counted(*args: Any, **options: Any) -> Any:
        name = str(args[0]).lower()
        sent[name] = sent.get(name, 0) + 1
        return await execute(*args, **options)  # type: ignore[no-untyped-call]

    client.execute_command = counted  # type: ignore[method-assign]
    starts: list[float] = []
    slots: list[float] = []
    waits: list[float] = []  # ours: reserved slot minus request time
    refused = 0

    if kind == "ours":
        from usage_limits.exceptions import ProviderBusy
        from usage_limits.throttle import ProviderThrottle

        throttle = ProviderThrottle(client, "bench", rate=rate, burst=1)

        async def call(end: float) -> bool:
            nonlocal refused
            try:
                admission = await throttle.admit(max_wait_s=max(0.0, end - time.time()))
            except ProviderBusy:
                refused += 1
                return False
            starts.append(admission.granted_at)
            slots.append(admission.slot_at)
            waits.append(admission.slot_at - admission.requested_at)
            return True

    elif kind == "aiolimiter":
        from aiolimiter import AsyncLimiter

        limiter = AsyncLimiter(rate, 1)

        async def call(end: float) -> bool:
            nonlocal refused
            try:
                async with asyncio.timeout(max(0.0, end - time.time())):
                    await limiter.acquire()
            except TimeoutError:
                refused += 1
                return False
            starts.append(time.time())
            return True

    else:
        from pyrate_limiter import Duration, Limiter, Rate, RedisBucket

        bucket = await RedisBucket.init([Rate(int(rate), Duration.SECOND)], client,
                                        "pyrate:bench")
        pyrate = Limiter(bucket)

        async def call(end: float) -> bool:
            nonlocal refused
            left = end - time.time()
            if left <= 0:
                return False
            if await pyrate.try_acquire_async("bench", 1, blocking=True, timeout=left):
                starts.append(time.time())
                return True
            refused += 1
            return False

    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    go = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    sent.clear()  # setup (PING, SCRIPT LOAD) is not part of the load
    await asyncio.sleep(max(0.0, go["start"] - time.time()))

    async def task() -> None:
        while time.time() < go["end"] and await call(go["end"]):
            pass

    await asyncio.gather(*(task() for _ in range(cfg["tasks"])))
    await client.aclose()
    return {"starts": starts, "slots": slots, "waits": waits, "refused": refused,
            "sent": sent}


# --------------------------------------------------------------------------- driver side

def run_limiter(kind: str, port: int, duration: float) -> dict[str, Any]:
    """Start PROCS workers, release them together, gather what they recorded."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "layers" / "usage_limits"), os.environ.get("PYTHONPATH", "")])}
    cfg = {"limiter": kind, "port": port, "rate": RATE, "tasks": TASKS}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(PROCS)]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "READY":
                raise RuntimeError(f"{kind} worker failed to start")
        start = time.time() + 0.3
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"start": start, "end": start + duration}) + "\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=duration + 120)
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return {"start": start, "end": start + duration,
            "starts": sorted(t for r in results for t in r["starts"]),
            "late": sorted(s - slot for r in results if r["slots"]
                           for s, slot in zip(r["starts"], r["slots"], strict=True)),
            "late_waited": sorted(s - slot for r in results if r["slots"]
                                  for s, slot, w in zip(r["starts"], r["slots"], r["waits"],
                                                        strict=True) if w > 0.001),
            "refused": sum(r["refused"] for r in results),
            "sent": sum(sum(r["sent"].values()) for r in results),
            "evalsha": sum(r["sent"].get("evalsha", 0) for r in results)}


def max_in_window(times: list[float], width: float = 1.0) -> int:
    """Most times in any half-open window [t, t + width)."""
    best, j = 0, 0
    for i, t in enumerate(times):
        while j < len(times) and times[j] < t + width:
            j += 1
        best = max(best, j - i)
    return best


def pyrate_lateness(times: list[float], limit: int, window: float = 1.0) -> list[float]:
    """Start minus the moment a sliding-window log let the call in (start[i - limit] + window)."""
    return sorted(times[i] - (times[i - limit] + window) for i in range(limit, len(times)))


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), sharex=True)
    for ax, (kind, run) in zip(axes, runs.items(), strict=True):
        times, start = run["starts"], run["start"]
        grid = [start + k * 0.05 for k in range(int((run["end"] - start) / 0.05) + 1)]
        lo = hi = 0
        counts = []
        for g in grid:  # calls started in (g - 1 s, g]
            while hi < len(times) and times[hi] <= g:
                hi += 1
            while lo < hi and times[lo] <= g - 1.0:
                lo += 1
            counts.append(hi - lo)
        bins = [0] * (len(grid) + 1)
        for t in times:  # calls per 100 ms, scaled to a rate
            k = int((t - start) / 0.1)
            if 0 <= k < len(bins):
                bins[k] += 10
        ax.step([k * 0.1 for k in range(len(bins))], bins, where="post", lw=0.6,
                color="0.6", label="calls per 100 ms x 10")
        ax.plot([g - start for g in grid], counts, lw=1.4, label="calls in the last 1 s")
        ax.axhline(RATE, color="red", ls="--", lw=1, label=f"limit {RATE:g}/s")
        ax.set_title(kind, fontsize=10, loc="left")
        ax.set_ylabel("calls / s")
        ax.set_ylim(0, max(max(counts, default=0), max(bins, default=0), RATE) * 1.1)
        ax.set_xlim(0, run["end"] - start)
        ax.legend(loc="lower right", fontsize=8)
    axes[-1].set_xlabel("seconds since start")
    fig.suptitle(f"{PROCS} processes x {TASKS} tasks, one provider limited to {RATE:g}/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


async def reset(port: int) -> None:
    """Empty the server and preload our script (no NOSCRIPT round trip in the run)."""
    import redis.asyncio as aioredis

    from usage_limits._scripts import script

    client = aioredis.Redis(port=port)
    try:
        await client.flushall()
        await client.script_load(script("throttle_acquire").source)
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 s per limiter instead of 10 s")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out"), help="folder for the PNG")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(asyncio.run(worker(json.loads(args.worker)))), flush=True)
        return

    from local.redis_servers import RedisServer

    duration = 3.0 if args.quick else 10.0
    runs: dict[str, dict[str, Any]] = {}
    rows = []
    with RedisServer() as server:
        for kind in LIMITERS:
            asyncio.run(reset(server.port))
            run = run_limiter(kind, server.port, duration)
            runs[kind] = run
            starts = [t for t in run["starts"] if run["start"] <= t <= run["end"] + 0.05]
            n = len(starts)
            late = run["late"] if kind == "ours" else (
                pyrate_lateness(starts, int(RATE)) if kind == "pyrate" else [])
            rows.append([
                kind, f"{n / duration:.2f}", str(max_in_window(starts)),
                str(max_in_window(starts, 0.1)),
                f"{100 * n / (RATE * duration):.1f}",
                f"{1000 * pct(late, 0.5):.2f}" if late else "n/a",
                f"{1000 * pct(late, 0.99):.2f}" if late else "n/a",
                str(run["refused"]),
                f"{run['sent'] / n:.2f}" if n else "n/a",
                f"{(run['evalsha'] - run['refused']) / n:.2f}" if kind == "ours" and n else "",
            ])
    png = Path(args.out) / "throttle.png"
    plot(runs, png)

    head = ["limiter", "granted/s", "max in 1 s", "max in 0.1 s", "util %", "late p50 ms",
            "late p99 ms", "refused", "redis/adm", "evalsha/adm"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print(f"{PROCS} processes x {TASKS} tasks, limit {RATE:g}/s (burst 1), {duration:g} s each")
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    waited = runs["ours"]["late_waited"]
    print(f"ours, calls that slept to their slot ({len(waited)} of {len(runs['ours']['late'])}):"
          f" lateness p50 {1000 * pct(waited, 0.5):.2f} ms, p99 {1000 * pct(waited, 0.99):.2f} ms,"
          f" max {1000 * max(waited, default=float('nan')):.2f} ms; calls admitted at once are"
          f" 'late' by their script round trip")
    print(f"bounds: any t-second window holds at most {RATE:g}*t + 1 calls "
          f"(21 per 1 s, 3 per 0.1 s)")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
