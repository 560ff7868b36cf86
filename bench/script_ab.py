"""Redis time per plain reservation: this tree's reserve script against a commit's.

Both scripts are loaded into one private redis-server and run in interleaved blocks (the
order alternates), each on its own user at steady state (``bench/budget.py``'s: each call
retires one event as it adds one), with the same arguments: this tree's plain
(entitlements off) call, whose layout the older script shares. A block's Redis time is
``usec_per_call`` of evalsha in INFO commandstats, reset before it; the first two rounds
warm up. A busy moment of a shared machine lands on both columns alike, so the difference
of the medians is what the script change costs (run it twice: the spread is the noise).

    .venv/bin/python bench/script_ab.py                    # against HEAD's first parent
    .venv/bin/python bench/script_ab.py --baseline 720e387 --rounds 12
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import budget as b  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from local.redis_servers import RedisServer  # noqa: E402
from usage_limits import TokenBudget  # noqa: E402
from usage_limits._scripts import script  # noqa: E402

LUA = "layers/usage_limits/usage_limits/lua"
CALLS = 200  # per block


def script_at(commit: str) -> str:
    """budget_reserve.lua as of ``commit``, with its includes pasted in."""
    def show(name: str) -> str:
        return subprocess.run(["git", "show", f"{commit}:{LUA}/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout

    return re.sub(r"^--#include (\S+\.lua)\b.*$", lambda m: show(m.group(1)).rstrip("\n"),
                  show("budget_reserve.lua"), flags=re.M)


async def run(baseline: str, rounds: int, sizes: list[int]) -> None:
    with RedisServer() as server:
        client = aioredis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
        shas = {"baseline": await client.script_load(script_at(baseline)),
                "now": await client.script_load(script("budget_reserve").source)}
        budget = TokenBudget(client, [b.WINDOW])
        print(f"Redis time per plain steady-state reservation (µs, median of {rounds - 2} "
              f"blocks of {CALLS}); baseline {baseline}")
        for n in sizes:
            users = {tag: f"ab-{tag}-{n}" for tag in shas}
            for user in users.values():
                await b.fill(client, budget, user, n)
            done = dict.fromkeys(shas, 0)
            times: dict[str, list[float]] = {tag: [] for tag in shas}
            step = b.spacing_ms(n)
            for rnd in range(rounds):
                for tag in (("baseline", "now") if rnd % 2 else ("now", "baseline")):
                    await client.config_resetstat()
                    for _ in range(CALLS):
                        k = done[tag]
                        keys, args = budget._reserve_call(
                            users[tag], f"m{k:015d}", 1, b.ROUTE, budget.windows,
                            b.T0 + (n + k) * step, "abcdabcd")
                        done[tag] += 1
                        reply = await client.evalsha(shas[tag], len(keys), *keys, *args)
                        assert reply[0] == 1, reply
                    stats = await client.info("commandstats")
                    if rnd >= 2:
                        times[tag].append(float(stats["cmdstat_evalsha"]["usec_per_call"]))
            old, new = (statistics.median(times[t]) for t in ("baseline", "now"))
            print(f"{n:>9,} events | baseline {old:6.1f} | now {new:6.1f} | "
                  f"now / baseline {new / old:.2f}")
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD^", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=12, help="blocks per script and size")
    parser.add_argument("--sizes", default="10,100000", help="events in the window")
    args = parser.parse_args()
    asyncio.run(run(args.baseline, args.rounds, [int(n) for n in args.sizes.split(",")]))


if __name__ == "__main__":
    main()
