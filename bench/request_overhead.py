"""What the budget guard adds to a request, and what each handler costs to import.

Runs in one process against a private redis-server:

- p50/p99 of a full handler invocation (Mangum + FastAPI + middleware + reserve) for a
  guarded route, side by side with the same route without ``require_tokens``, calls
  interleaved so both see the same machine;
- Redis round trips per request for each (commands the client sends);
- the cold-start import time of every handler module (median of fresh interpreters).

    .venv/bin/python bench/request_overhead.py [--requests 3000] [--imports 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "layers" / "usage_limits"),
                str(ROOT / "layers" / "providers")]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RoundTrips:
    """Counts the commands the process's Redis client sends (one per round trip)."""

    def __init__(self, client) -> None:  # type: ignore[no-untyped-def]
        self.count = 0
        send = client.execute_command

        async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.count += 1
            return await send(*args, **kwargs)

        client.execute_command = counted


def invocation_bench(requests: int) -> list[tuple[str, float, float, float]]:
    from fastapi import Depends
    from mangum import Mangum

    from local.lambda_events import FakeContext, http_event, lambda_loop
    from local.redis_servers import RedisServer
    from usage_limits.web import create_app, require_tokens, runtime, settings

    rows = []
    with RedisServer() as server, lambda_loop():
        os.environ.update(REDIS_URL=server.url, ATTO_BUDGET="100000000/1h,1000000000/30d",
                          POWERTOOLS_METRICS_DISABLED="true", LOG_LEVEL="WARNING")
        settings.cache_clear()
        app = create_app("overhead")

        @app.post("/guarded", dependencies=[Depends(require_tokens(cost=1))])
        async def guarded() -> dict[str, bool]:
            return {"ok": True}

        @app.post("/plain")
        async def plain() -> dict[str, bool]:
            return {"ok": True}

        handler = Mangum(app, lifespan="off")
        events = {name: http_event("POST", f"/{name}", body={}) for name in ("guarded", "plain")}
        for _ in range(200):  # warm up: imports, connection, script cache
            for event in events.values():
                handler(event, FakeContext())
        trips = RoundTrips(runtime.get_redis.__globals__["_client"])
        timings: dict[str, list[float]] = {"guarded": [], "plain": []}
        commands = {"guarded": 0, "plain": 0}
        for i in range(requests):
            for name in (("guarded", "plain") if i % 2 else ("plain", "guarded")):
                event = dict(events[name])
                event["requestContext"] = {**event["requestContext"], "requestId": f"{name}-{i}"}
                before = trips.count
                start = time.perf_counter()
                handler(event, FakeContext())
                timings[name].append((time.perf_counter() - start) * 1e6)
                commands[name] += trips.count - before
        for name in ("plain", "guarded"):
            t = timings[name]
            rows.append((name, percentile(t, 0.5), percentile(t, 0.99), commands[name] / requests))
    return rows


def import_bench(repeats: int) -> list[tuple[str, float]]:
    from local.template import functions

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "layers" / "usage_limits"), str(ROOT / "layers" / "providers")])}
    rows = []
    for fn in functions():
        module = fn.code_dir.strip("/").replace("/", ".") + ".app"
        if not (ROOT / fn.code_dir / "app.py").exists():
            continue
        code = ("import time; t = time.perf_counter(); import " + module +
                "; print(time.perf_counter() - t)")
        samples = [float(subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                                        capture_output=True, text=True, check=True).stdout)
                   for _ in range(repeats)]
        rows.append((module, statistics.median(samples) * 1000))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--imports", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a short run (300 requests)")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.imports = 300, 2
    rows = invocation_bench(args.requests)
    print(f"\nFull handler invocation, {args.requests} requests each (µs)\n")
    print("| route | p50 µs | p99 µs | Redis round trips / request |")
    print("|---|---:|---:|---:|")
    for name, p50, p99, cmds in rows:
        label = "with require_tokens" if name == "guarded" else "without require_tokens"
        print(f"| {label} | {p50:.0f} | {p99:.0f} | {cmds:.2f} |")
    (_, p50_plain, _, c_plain), (_, p50_guard, _, c_guard) = rows
    print(f"| guard adds | {p50_guard - p50_plain:+.0f} | | {c_guard - c_plain:+.2f} |")
    print("\nCold-start import of each handler module "
          f"(median of {args.imports} fresh interpreters)\n")
    print("| module | import ms |")
    print("|---|---:|")
    for module, ms in import_bench(args.imports):
        print(f"| {module} | {ms:.0f} |")


if __name__ == "__main__":
    main()
