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
import asyncio
import os
import statistics
import subprocess
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


class RoundTrips:
    """Counts the commands the process's Redis client sends (one per round trip)."""

    def __init__(self, client) -> None:  # type: ignore[no-untyped-def]
        self.count = 0
        send = client.execute_command

        async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.count += 1
            return await send(*args, **kwargs)

        client.execute_command = counted


class Invocations:
    """A guarded and an unguarded route of one app, called as Lambda calls a handler.

    ``round`` interleaves three kinds of call on the environment's one event loop: a full
    handler invocation of the guarded route, the same of the unguarded route, and the
    guard's own reservation awaited on its own (same client, ledger and plan), so the guard's
    Python around its round trip is guarded - unguarded - reservation. Each call is timed
    twice: wall time, and the CPU time of the calling thread (``time.thread_time``), which
    leaves out the wait for Redis and the time another process held the CPU, so it holds on
    a busy shared machine where wall-time differences of tens of µs are noise.

    Args:
        redis_url: the redis-server to use.
        user: the caller (one per tree, so two trees never share a budget's keys).
    """

    def __init__(self, redis_url: str, user: str = "user-123") -> None:
        from fastapi import Depends
        from mangum import Mangum

        from local.lambda_events import FakeContext, http_event
        from usage_limits.web import create_app, require_tokens, runtime, settings

        os.environ.update(REDIS_URL=redis_url, ATTO_BUDGET="100000000/1h,1000000000/30d",
                          POWERTOOLS_METRICS_DISABLED="true", LOG_LEVEL="WARNING")
        settings.cache_clear()
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        app = create_app("overhead")

        @app.post("/guarded", dependencies=[Depends(require_tokens(cost=1))])
        async def guarded() -> dict[str, bool]:
            return {"ok": True}

        @app.post("/plain")
        async def plain() -> dict[str, bool]:
            return {"ok": True}

        self.handler = Mangum(app, lifespan="off")
        self.context = FakeContext
        self.user, self.settings, self.runtime = user, settings, runtime
        self.events = {name: http_event("POST", f"/{name}", body={}, user=user)
                       for name in ("guarded", "plain")}
        self.calls = 0
        self.last_cpu = 0.0  # CPU µs of the last invoke() or reserve()
        for _ in range(200):  # warm up: imports, connection, script cache
            self.invoke("guarded")
            self.invoke("plain")
            self.reserve()
        self.trips = RoundTrips(runtime.get_redis.__globals__["_client"])

    def invoke(self, name: str) -> float:
        """One full handler invocation of route ``name``, µs (its CPU µs in ``last_cpu``)."""
        self.calls += 1
        event = dict(self.events[name])
        event["requestContext"] = {**event["requestContext"],
                                   "requestId": f"{name}-{self.calls}"}
        context = self.context()
        start, cpu = time.perf_counter(), time.thread_time()
        self.handler(event, context)
        self.last_cpu = (time.thread_time() - cpu) * 1e6
        return (time.perf_counter() - start) * 1e6

    def reserve(self) -> float:
        """The guard's reservation alone, awaited on the same loop and client, µs."""
        self.calls += 1
        rid = f"direct-{self.calls}"

        async def timed() -> float:
            budget = self.runtime.get_budget(self.settings().plan)
            start, cpu = time.perf_counter(), time.thread_time()
            await budget.reserve(self.user, rid, cost=1, route="/guarded")
            self.last_cpu = (time.thread_time() - cpu) * 1e6
            return (time.perf_counter() - start) * 1e6

        return self.loop.run_until_complete(timed())

    def round(self, requests: int) -> dict[str, list[float]]:
        """``requests`` calls of each kind, interleaved in a rotating order; samples in µs,
        wall time under each kind's name and CPU time under ``<kind>_cpu``."""
        kinds = {"guarded": lambda: self.invoke("guarded"),
                 "plain": lambda: self.invoke("plain"), "reserve": self.reserve}
        order = list(kinds)
        samples: dict[str, list[float]] = {key: [] for name in kinds
                                           for key in (name, f"{name}_cpu")}
        for i in range(requests):
            for name in order[i % 3:] + order[:i % 3]:
                samples[name].append(kinds[name]())
                samples[f"{name}_cpu"].append(self.last_cpu)
        return samples

    def round_trips(self, name: str, requests: int = 50) -> float:
        """Redis commands sent per full invocation of route ``name``."""
        before = self.trips.count
        for _ in range(requests):
            self.invoke(name)
        return (self.trips.count - before) / requests

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
        asyncio.set_event_loop(None)


class Parts:
    """Wall time spent inside chosen functions during guarded invocations, µs per request.

    Each function is wrapped in place (module attribute or method) by a timer that adds its
    inclusive time to ``spent[label]``; nested parts are reported inclusive, so a parent's
    own share is its time minus its children's.
    """

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        import functools
        import inspect

        original = getattr(owner, name)
        spent = self.spent
        spent.setdefault(label, 0.0)
        if inspect.iscoroutinefunction(original):
            @functools.wraps(original)
            async def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    spent[label] += time.perf_counter() - start
        else:
            @functools.wraps(original)
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    spent[label] += time.perf_counter() - start
        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def reset(self) -> None:
        for label in self.spent:
            self.spent[label] = 0.0

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def profile_guard(requests: int) -> list[tuple[str, float]]:
    """Where the guard's time goes: µs per request in each part, and the rest.

    Calls the guarded and the unguarded route alternately; the parts are timed during the
    guarded calls only, and each row is a median over requests (a busy machine's preemptions
    would swamp means). "The rest" is guarded - unguarded minus the guard's steps (identify,
    prepare, charge: the reservation is made inside charge), the RateLimit headers and the
    metrics flush: the metered route's identification wrapper and endpoint wrapper, the
    middleware's per-request work that a charge adds, and the timers themselves.
    """
    from local.redis_servers import RedisServer
    from usage_limits import budget as budget_module
    from usage_limits import budget as ledger
    from usage_limits._scripts import LuaScript
    from usage_limits.web import guard, identity, middleware
    from usage_limits.web import observability as obs

    with RedisServer() as server:
        bench = Invocations(server.url)
        parts = Parts()
        client = bench.runtime.get_redis.__globals__["_client"]
        # the guard's steps, which the metered route runs (FastAPI no longer solves it)
        parts.wrap(guard.TokenGuard, "identify", "guard: identify (before validation)")
        parts.wrap(guard, "_identify", "  _identify (user id, log keys, user hash)")
        parts.wrap(identity, "request_id", "  identity.request_id")
        parts.wrap(guard.TokenGuard, "prepare", "guard: prepare (plan, ledger, Charge)")
        parts.wrap(guard.TokenGuard, "charge", "guard: charge, all of it")
        parts.wrap(guard, "settings", "settings()")
        parts.wrap(guard.runtime, "get_budget", "runtime.get_budget")
        parts.wrap(ledger.TokenBudget, "reserve", "TokenBudget.reserve, all of it")
        parts.wrap(ledger.TokenBudget, "_reserve_call", "  _reserve_call (validation, args)")
        parts.wrap(LuaScript, "__call__", "  LuaScript call (EVALSHA round trip)")
        parts.wrap(client, "execute_command", "    redis-py execute_command (send, wait, parse)")
        parts.wrap(budget_module, "_decode_reservation", "  _decode_reservation")
        parts.wrap(guard.obs, "count", "obs.count")
        parts.wrap(middleware, "_ratelimit_headers", "RateLimit headers (middleware)")
        parts.wrap(obs, "flush", "obs.flush (metrics line)")
        timings: dict[str, list[float]] = {"guarded": [], "plain": []}
        per_request: dict[str, list[float]] = {label: [] for label in parts.spent}
        try:
            for i in range(requests):
                for name in (("guarded", "plain") if i % 2 else ("plain", "guarded")):
                    parts.reset()
                    timings[name].append(bench.invoke(name))
                    if name == "guarded":
                        for label, spent in parts.spent.items():
                            per_request[label].append(spent * 1e6)
        finally:
            parts.restore()
            bench.close()
    rows = [(label, statistics.median(spent)) for label, spent in per_request.items()]
    guarded = statistics.median(timings["guarded"])
    plain = statistics.median(timings["plain"])
    spent = dict(rows)
    adds = guarded - plain
    trip = spent["  LuaScript call (EVALSHA round trip)"]
    rest = (adds - spent["guard: identify (before validation)"]
            - spent["guard: prepare (plan, ledger, Charge)"] - spent["guard: charge, all of it"]
            - spent["RateLimit headers (middleware)"] - spent["obs.flush (metrics line)"])
    return [("guarded invocation", guarded), ("unguarded invocation", plain),
            ("guard adds", adds), ("guard adds beyond its round trip (adds - LuaScript call)",
                                   adds - trip),
            *rows, ("the rest: the metered route's wrappers, the middleware", rest)]


def invocation_bench(requests: int) -> list[tuple[str, float, float, float]]:
    from local.redis_servers import RedisServer

    rows = []
    with RedisServer() as server:
        bench = Invocations(server.url)
        try:
            samples = bench.round(requests)
            for name in ("plain", "guarded"):
                t = samples[name]
                rows.append((name, percentile(t, 0.5), percentile(t, 0.99),
                             bench.round_trips(name)))
        finally:
            bench.close()
    return rows


def import_bench(repeats: int) -> list[tuple[str, float]]:
    from local.template import functions

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "layers" / "usage_limits"), str(ROOT / "layers" / "providers")])}
    rows = []
    for fn in functions():
        module = fn.code_dir.strip("/").replace("/", ".") + ".app"
        # one row per function (admin is listed once per route)
        if not (ROOT / fn.code_dir / "app.py").exists() or any(m == module for m, _ in rows):
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
    parser.add_argument("--profile", action="store_true",
                        help="only: where the guard's time goes, part by part")
    args = parser.parse_args()
    sys.path[:0] = LAYERS
    if args.profile:
        requests = 300 if args.quick else args.requests
        print(f"\nWhere a guarded invocation's time goes, {requests} requests (µs per request;"
              " nested parts are inclusive)\n")
        print("| part | µs |")
        print("|---|---:|")
        for label, micros in profile_guard(requests):
            print(f"| {label.replace(' ', '&nbsp;', len(label) - len(label.lstrip()))} "
                  f"| {micros:.1f} |")
        return
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
