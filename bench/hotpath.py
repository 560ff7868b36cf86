"""The hot path, now and as it was: one table, both trees measured in the same run.

"As it was" is the code at a fixed baseline commit (``--baseline``, default ``0e3336c``),
extracted with ``git archive`` into a temporary directory; "now" is this working tree. The
measuring code is this tree's (``bench/budget.py``, ``bench/request_overhead.py``,
``bench/cold_start.py``) for both: only the code under ``layers/`` and ``functions/`` differs.
Each tree runs in its own worker processes (``PYTHONPATH`` = that tree's layers), all on one
private redis-server, and the workers take turns round by round (the order rotates), so a
busy moment of the shared machine lands on every column alike.

Rows:

- reserve p50 / trivial ``EVALSHA return 1`` p50 with 10 and with 100k events in the
  window (``bench/budget.py``'s steady state: each reservation retires one event);
- Redis time per steady-state reservation (``usec_per_call`` of evalsha in INFO
  commandstats, reset before each block of calls);
- what the guard adds to a full handler call beyond its reservation's round trip: p50 of a
  guarded invocation - p50 of the same route unguarded - p50 of the guard's reservation
  awaited alone on the same loop and client (``bench/request_overhead.py``); in wall time,
  and again in the CPU time of the calling thread, which leaves out the wait for Redis and
  the time other processes held the CPU (so it holds on a busy shared machine);
- cold start, import + first invocation, lazy / eager, median over handlers
  (``bench/cold_start.py``); in wall time, and again in the CPU time of the process;
- the same handlers as deployed (``bench/cold_start.py --deployed``: provider keys from
  Secrets Manager, ``REDIS_AUTH=iam`` over TLS, entitlements on): import + first
  invocation, the first invocation after a SnapStart restore, and a warm request's p50,
  each the median over handlers.

Worker kinds: ``ledger`` and ``guard`` per tree, and a second ``ledger`` of "now" with
hiredis hidden from the interpreter, to show what hiredis alone does. The baseline had no
hiredis, so "as it was" runs without it.

    .venv/bin/python bench/hotpath.py            # full run (a few minutes)
    .venv/bin/python bench/hotpath.py --quick    # every row, fewer calls (a minute or two)
    .venv/bin/python bench/hotpath.py --guard-only --rounds 10  # the two guard rows alone
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
BASELINE = "0e3336c"
#: Set in a worker's environment to hide hiredis from its interpreter.
NO_HIREDIS_ENV = "BENCH_NO_HIREDIS"


@dataclass(frozen=True)
class Preset:
    """How much to measure."""

    sizes: tuple[int, ...]
    rounds: int
    ledger_calls: int  # per size, kind and round
    guard_calls: int  # per kind and round
    cold_repeats: int
    cold_handlers: tuple[str, ...] | None  # None: every handler
    warm_requests: int  # per deployed cold run


FULL = Preset(sizes=(10, 100_000), rounds=10, ledger_calls=200, guard_calls=300,
              cold_repeats=3, cold_handlers=None, warm_requests=20)
#: Short, but with enough calls for a p50 to hold on a shared machine (a handler call is
#: under a millisecond): the cold starts take most of its minute. Three handlers, so the
#: median over them is one handler's, as in the full run: structured (the keyed event),
#: embeddings and usage. Three runs each, as in the full run: with two, a handler's "median"
#: is the mean of two, and one run slowed by the shared machine moves it.
QUICK = Preset(sizes=(10, 100_000), rounds=5, ledger_calls=150, guard_calls=300,
               cold_repeats=3, cold_handlers=("structured", "embeddings", "usage"),
               warm_requests=10)


# ----------------------------------------------------------------------------- workers


def _worker_paths(tree: Path) -> None:
    """This tree's layers first, then this checkout's root (``local``) and bench."""
    sys.path[:0] = [str(tree / "layers" / "usage_limits"), str(tree / "layers" / "providers"),
                    str(ROOT), str(BENCH)]


def _hide_hiredis() -> None:
    sys.modules["hiredis"] = None  # type: ignore[assignment]  # import hiredis now fails


def _serve(handle: Any) -> None:
    """Answer the parent's JSON commands, one per stdin line, with one JSON line each."""
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "stop":
            break
        reply = handle(command)
        sys.stdout.write("REPLY " + json.dumps(reply) + "\n")
        sys.stdout.flush()


def ledger_worker(redis_url: str, tag: str, preset: Preset) -> None:
    """budget.py's steady-state ledgers, one per size, under user names tagged ``tag``."""
    import budget as b
    import redis.asyncio as aioredis
    import redis.utils

    from usage_limits import TokenBudget

    loop = asyncio.new_event_loop()
    client = aioredis.Redis.from_url(redis_url, socket_timeout=30)
    tb = TokenBudget(client, [b.WINDOW])

    async def setup() -> tuple[str, list[b.Ledger]]:
        trivial = await client.script_load(b.TRIVIAL)
        await tb.reserve(f"{tag}-warm-up", "warm-up", 1, now_ms=b.T0)
        ledgers = [b.Ledger(client, tb, "", n, prefix=tag) for n in preset.sizes]
        for ledger in ledgers:
            await ledger.prepare()
        return trivial, ledgers

    trivial_sha, ledgers = loop.run_until_complete(setup())

    async def trivial() -> None:
        await client.evalsha(trivial_sha, 0)

    async def one_round(calls: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        series = b.Series()
        await b.block(client, series, calls, trivial)
        out["trivial"] = [series.samples, series.server_usec, series.server_calls]
        for ledger in ledgers:
            series = b.Series()
            await b.block(client, series, calls, ledger.reserve)
            out[str(ledger.n)] = [series.samples, series.server_usec, series.server_calls]
        return out

    def handle(command: dict[str, Any]) -> Any:
        if command["op"] == "info":
            import usage_limits
            return {"usage_limits": usage_limits.__file__, "hiredis": redis.utils.HIREDIS_AVAILABLE}
        return loop.run_until_complete(one_round(command["calls"]))

    _serve(handle)
    loop.run_until_complete(client.aclose())


def guard_worker(redis_url: str, tag: str) -> None:
    """request_overhead.py's guarded and unguarded routes, for a user tagged ``tag``."""
    import logging

    import redis.utils
    from request_overhead import Invocations

    logging.disable(logging.WARNING)
    bench = Invocations(redis_url, user=f"{tag}-guard")

    def handle(command: dict[str, Any]) -> Any:
        if command["op"] == "info":
            import usage_limits
            return {"usage_limits": usage_limits.__file__, "hiredis": redis.utils.HIREDIS_AVAILABLE}
        return bench.round(command["calls"])

    _serve(handle)
    bench.close()


class Worker:
    """A worker subprocess running one kind of measurement against one tree."""

    def __init__(self, kind: str, tree: Path, tag: str, redis_url: str, preset: str, *,
                 hiredis: bool) -> None:
        self.kind, self.tag, self.tree = kind, tag, tree
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if not hiredis:
            env[NO_HIREDIS_ENV] = "1"
        else:
            env.pop(NO_HIREDIS_ENV, None)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), "--worker", kind, "--tree", str(tree),
             "--tag", tag, "--redis", redis_url, "--preset", preset],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def ask(self, **command: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("REPLY "):
                return json.loads(line[len("REPLY "):])
        raise RuntimeError(f"{self.kind} worker of {self.tag} exited ({self.proc.wait()})")

    def stop(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


# ----------------------------------------------------------------------------- parent


def baseline_tree(commit: str, folder: Path) -> Path:
    """``layers/`` and ``functions/`` of ``commit``, extracted into ``folder``."""
    archive = folder / "baseline.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(ROOT), "archive", commit, "layers", "functions"],
                       stdout=out, check=True)
    tree = folder / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


class Gathered:
    """Samples and Redis time of each kind of call of one worker, over all rounds."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self.usec: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add_ledger(self, reply: dict[str, Any]) -> None:
        for name, (samples, usec, calls) in reply.items():
            self.samples.setdefault(name, []).extend(samples)
            self.usec[name] = self.usec.get(name, 0.0) + usec
            self.calls[name] = self.calls.get(name, 0) + calls

    def add_guard(self, reply: dict[str, list[float]]) -> None:
        for name, samples in reply.items():
            self.samples.setdefault(name, []).extend(samples)

    def p50(self, name: str) -> float:
        return p50(self.samples[name])

    def server(self, name: str) -> float:
        return self.usec[name] / max(1, self.calls[name])


def run(preset_name: str, baseline: str, *, guard_only: bool = False,
        rounds: int | None = None) -> dict[str, Any]:
    """Measure both trees; returns the numbers the table shows.

    Args:
        preset_name: ``quick`` or ``full``.
        baseline: the commit of "as it was".
        guard_only: run only the guard workers (the two guard rows, no cold start).
        rounds: interleaved rounds instead of the preset's.
    """
    sys.path[:0] = [str(ROOT), str(BENCH)]
    import cold_start

    from local.redis_servers import RedisServer

    preset = QUICK if preset_name == "quick" else FULL
    if rounds is not None:
        preset = dataclasses.replace(preset, rounds=rounds)
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        trees = {"now": ROOT, "was": baseline_tree(baseline, Path(tmp))}
        specs = [("ledger", "now", True), ("ledger", "now-nohiredis", False),
                 ("ledger", "was", False), ("guard", "now", True), ("guard", "was", False)]
        if guard_only:
            specs = [spec for spec in specs if spec[0] == "guard"]
        workers = {}
        try:
            for kind, tag, hiredis in specs:
                tree = trees[tag.split("-")[0]]
                workers[(kind, tag)] = Worker(kind, tree, tag, server.url, preset_name,
                                              hiredis=hiredis)
            for (kind, tag), worker in workers.items():
                info = worker.ask(op="info")
                expected = str(worker.tree / "layers")
                if not info["usage_limits"].startswith(expected):
                    raise RuntimeError(f"{kind}/{tag} imported {info['usage_limits']}")
                worker.hiredis = info["hiredis"]  # type: ignore[attr-defined]
            gathered = {key: Gathered() for key in workers}
            order = list(workers)
            for r in range(preset.rounds):
                for key in order[r % len(order):] + order[:r % len(order)]:
                    kind, _ = key
                    calls = preset.ledger_calls if kind == "ledger" else preset.guard_calls
                    reply = workers[key].ask(op="round", calls=calls)
                    if kind == "ledger":
                        gathered[key].add_ledger(reply)
                    else:
                        gathered[key].add_guard(reply)
            kind = "guard" if guard_only else "ledger"
            hiredis = {tag: workers[(kind, tag)].hiredis  # type: ignore[attr-defined]
                       for _, tag, _ in specs if (kind, tag) in workers}
        finally:
            for worker in workers.values():
                worker.stop()
        server.cli("FLUSHALL")
        handlers = list(preset.cold_handlers) if preset.cold_handlers else None
        cold = None if guard_only else cold_start.bench(
            preset.cold_repeats, tracing=False, secrets=False,
            trees={"now": trees["now"], "was": trees["was"]}, handlers=handlers, server=server)
        deployed = None if guard_only else cold_start.bench(
            preset.cold_repeats, tracing=False, secrets=True, deployed=True,
            warm=preset.warm_requests, trees={"now": trees["now"], "was": trees["was"]},
            handlers=handlers)
    return {"preset": preset, "gathered": gathered, "cold": cold, "deployed": deployed,
            "hiredis": hiredis,
            "baseline": baseline, "guard_only": guard_only, "quick": preset_name == "quick"}


def table(result: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Rows of (measure, now, as it was, now without hiredis, target)."""
    import cold_start

    g, preset = result["gathered"], result["preset"]
    rows = []

    def ledger(tag: str) -> Gathered:
        return g.get(("ledger", tag))  # type: ignore[no-any-return]

    tags = ("now", "was", "now-nohiredis")
    for n in () if result["guard_only"] else preset.sizes:
        cells = []
        for tag in tags:
            led = ledger(tag)
            cells.append(f"{led.p50(str(n)) / led.p50('trivial'):.2f}x "
                         f"({led.p50(str(n)):.0f} vs {led.p50('trivial'):.0f} µs)")
        rows.append((f"reserve p50 / trivial EVALSHA p50, {n:,} events", *cells,
                     "<= 1.5x (stretch 1.3x)"))
    for n in () if result["guard_only"] else preset.sizes:
        cells = [f"{ledger(tag).server(str(n)):.1f} µs" for tag in tags]
        rows.append((f"Redis time per steady-state reservation, {n:,} events", *cells,
                     "<= 30 µs"))
    guard_cells = []
    for tag in ("now", "was"):
        gu = g[("guard", tag)]
        extra = gu.p50("guarded") - gu.p50("plain") - gu.p50("reserve")
        guard_cells.append(f"{extra:+.0f} µs ({gu.p50('guarded'):.0f} - {gu.p50('plain'):.0f}"
                           f" - {gu.p50('reserve'):.0f})")
    rows.append(("guard beyond its reservation (guarded - plain - reserve, p50)",
                 *guard_cells, "", "<= 60 µs"))
    cpu_cells = []
    for tag in ("now", "was"):
        gu = g[("guard", tag)]
        guarded, plain, reserve = (gu.p50(f"{k}_cpu") for k in ("guarded", "plain", "reserve"))
        cpu_cells.append(f"{guarded - plain - reserve:+.0f} µs ({guarded:.0f} - {plain:.0f}"
                         f" - {reserve:.0f})")
    rows.append(("the same in CPU time of the calling thread (p50)", *cpu_cells, "",
                 "<= 60 µs"))
    if result["guard_only"]:
        return rows
    cold_cells = []
    for tag in ("now", "was"):
        lazy, eager, ratio = cold_start.median_ratio(result["cold"][tag])
        cold_cells.append(f"{ratio:.2f}x ({lazy:.0f} vs {eager:.0f} ms)")
    rows.append(("cold start lazy / eager, import + 1st call, median over handlers",
                 *cold_cells, "", "<= 0.70x"))
    cpu_cells = []
    for tag in ("now", "was"):
        lazy, eager, ratio = cold_start.median_cpu_ratio(result["cold"][tag])
        cpu_cells.append(f"{ratio:.2f}x ({lazy:.0f} vs {eager:.0f} ms)")
    rows.append(("the same in CPU time of the process", *cpu_cells, "", "<= 0.70x"))
    medians = {tag: cold_start.deployed_medians(result["deployed"][tag]) for tag in ("now", "was")}
    for key, name, unit in (
            ("cold", "cold start as deployed, import + 1st call, median over handlers", "ms"),
            ("restore", "1st call after a SnapStart restore, as deployed, median over handlers",
             "ms"),
            ("warm", "warm request p50 as deployed, median over handlers", "µs")):
        rows.append((name, *(f"{medians[tag][key]:.0f} {unit}" for tag in ("now", "was")), "",
                     ""))
    return rows


def print_table(result: dict[str, Any]) -> None:
    preset = result["preset"]
    quick = " (--quick)" if result["quick"] else ""
    quick += " (--guard-only)" if result["guard_only"] else ""
    handlers = ", ".join(preset.cold_handlers) if preset.cold_handlers else "every handler"
    calls = (f"{preset.guard_calls} handler calls per kind and round" if result["guard_only"]
             else f"{preset.ledger_calls} ledger calls and {preset.guard_calls} handler calls "
                  f"per kind and round; cold start {handlers}, median of "
                  f"{preset.cold_repeats} runs")
    print(f"\nHot path, now and as it was ({result['baseline']}), one run{quick}: "
          f"{preset.rounds} interleaved rounds; {calls}. hiredis: "
          + ", ".join(f"{tag} {'yes' if on else 'no'}" for tag, on in result["hiredis"].items())
          + "\n")
    print("| measure | now | as it was | now without hiredis | target |")
    print("|---|---|---|---|---|")
    for row in table(result):
        print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every row, fewer calls")
    parser.add_argument("--baseline", default=BASELINE, help="the commit of 'as it was'")
    parser.add_argument("--guard-only", action="store_true",
                        help="only the two guard rows (no ledger rows, no cold start)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: the preset's)")
    parser.add_argument("--worker", choices=("ledger", "guard"), help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--redis", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if os.environ.get(NO_HIREDIS_ENV):
            _hide_hiredis()
        _worker_paths(Path(args.tree))
        preset = QUICK if args.preset == "quick" else FULL
        if args.worker == "ledger":
            ledger_worker(args.redis, args.tag, preset)
        else:
            guard_worker(args.redis, args.tag)
        return
    print_table(run("quick" if args.quick else "full", args.baseline,
                    guard_only=args.guard_only, rounds=args.rounds))


if __name__ == "__main__":
    main()
