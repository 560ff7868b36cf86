"""Token budget ledger: cost of a reservation as the window fills up.

Starts a private redis-server, fills one user's 30-day window with N spend events (through
the real reservation script, in pipelines, times spread evenly over the window), then
measures admitted reservations at steady state: each call happens one event-spacing later
than the previous one, so one old event leaves the window as the new one enters and N stays
constant. Side by side: a trivial ``EVALSHA return 1`` and a naive script that sums the
whole window on every call (what the running totals avoid).

Columns: client latency p50/p99 (µs, asyncio client, one connection), Redis server time per
call (µs, ``usec_per_call`` of evalsha in INFO commandstats, reset before each run), and
Redis memory per spend event (MEMORY USAGE SAMPLES 0 of log + ev + meta, divided by N).
Lua garbage of the naive script is collected (unmeasured) after each of its runs.

A second table measures entitlements (plan overrides, grants, suspensions) on the same
server in the same rounds, 10 events in each user's window: plain reserve (entitlements
off), entitlements on with an empty ent, with a plan override, with 3 grants that do not
draw, and with 3 grants that every call draws from (a 1-token quota, so each cost-1 call is
covered by the earliest grant); each row's p50 and Redis time against plain's.

    .venv/bin/python bench/budget.py            # full run (about a minute)
    .venv/bin/python bench/budget.py --quick    # fewer calls per size
    .venv/bin/python bench/budget.py --quick --entitlements-only   # the second table only
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for local.redis_servers

import redis.asyncio as aioredis  # noqa: E402

from local.redis_servers import RedisServer  # noqa: E402
from usage_limits import TokenBudget, Window  # noqa: E402
from usage_limits._scripts import script  # noqa: E402
from usage_limits.keys import user_keys  # noqa: E402

SIZES = [10, 1_000, 10_000, 100_000]
WINDOW = Window(limit=10**12, seconds=30 * 86_400)  # never full: every reservation admitted
T0 = 1_700_000_000_000
ROUTE = "/v1/structured"
FILL_CHUNK = 5_000
WARM_UP = 20  # unmeasured reservations per size before measuring

TRIVIAL = "return 1"
# The design this ledger replaces: sum every event of the window on every call.
NAIVE = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf')
local total = 0
for i = 1, #ids, 1000 do
  local recs = redis.call('HMGET', KEYS[2], unpack(ids, i, math.min(i + 999, #ids)))
  for j = 1, #recs do total = total + tonumber(string.match(recs[j], '^%d+')) end
end
return total
"""


def spacing_ms(n: int) -> int:
    """Time between two events when n of them fill the window evenly."""
    return WINDOW.ms // n


async def fill(client: aioredis.Redis, budget: TokenBudget, user: str, n: int) -> None:
    """n admitted reservations of cost 1 with 16-character ids, spread over the window."""
    reserve = script("budget_reserve")
    step = spacing_ms(n)
    for first in range(0, n, FILL_CHUNK):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(n, first + FILL_CHUNK)):
            keys, args = budget._reserve_call(user, f"{i:016d}", 1, ROUTE, budget.windows,
                                              T0 + i * step, f"{i % 2**32:08x}")
            pipe.evalsha(reserve.sha, len(keys), *keys, *args)
        await pipe.execute()


class Series:
    """Latency samples and Redis server time of one kind of call, gathered over rounds."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.server_usec = 0.0
        self.server_calls = 0

    def p50(self) -> float:
        return statistics.median(self.samples)

    def p99(self) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]

    def server(self) -> float:
        return self.server_usec / max(1, self.server_calls)


async def block(client: aioredis.Redis, series: Series, calls: int, make_call) -> None:  # type: ignore[no-untyped-def]
    """Run ``calls`` awaited calls, adding their latency and evalsha server time to series."""
    await client.config_resetstat()
    for _ in range(calls):
        start = time.perf_counter_ns()
        await make_call()
        series.samples.append((time.perf_counter_ns() - start) / 1000)
    stats = (await client.info("commandstats")).get("cmdstat_evalsha", {})
    series.server_usec += float(stats.get("usec", 0))
    series.server_calls += int(stats.get("calls", 0))


async def bytes_per_event(client: aioredis.Redis, user: str, n: int) -> float:
    total = 0
    for key in user_keys(user, "log", "ev", "meta"):
        total += await client.memory_usage(key, samples=0) or 0
    return total / n


class Ledger:
    """One user's window of n events, kept at steady state by successive reservations."""

    def __init__(self, client: aioredis.Redis, budget: TokenBudget, naive_sha: str,
                 n: int, prefix: str = "bench") -> None:
        self.client, self.budget, self.naive_sha, self.n = client, budget, naive_sha, n
        self.user, self.step, self.k = f"{prefix}-{n}", spacing_ms(n), 0

    async def prepare(self) -> float:
        """Fill the window with n events and warm up; returns the bytes per event."""
        await fill(self.client, self.budget, self.user, self.n)
        memory = await bytes_per_event(self.client, self.user, self.n)
        for _ in range(WARM_UP):
            await self.reserve()
        return memory

    async def reserve(self) -> None:
        # the call at (n + k) * step retires event k as it adds one: n stays constant
        d = await self.budget.reserve(self.user, f"m{self.k:015d}", 1, route=ROUTE,
                                      now_ms=T0 + (self.n + self.k) * self.step)
        self.k += 1
        assert d.allowed and d.windows[-1].used == self.n, d

    async def naive(self) -> None:
        log, ev = user_keys(self.user, "log", "ev")
        boundary = T0 + (self.n + self.k - 1) * self.step - WINDOW.ms  # last reservation's
        assert await self.client.evalsha(self.naive_sha, 2, log, ev, boundary) == self.n


#: Events in each window of the entitlements table.
ENT_EVENTS = 10
#: The entitlements table's plans: the plain one, and a 1-token quota every call overflows.
ENT_CATALOG = {"plain": [WINDOW], "pro": [Window(limit=10**12 - 1, seconds=30 * 86_400)],
               "drawing": [Window(limit=1, seconds=30 * 86_400)]}
GRANT_TOKENS = 10**11


def three_grants(now: int) -> list[Any]:
    """Three large grants of different kinds and expiries (the promo one is drawn first)."""
    # imported here: bench/hotpath.py imports this module against older trees too
    from usage_limits.budget import LiveGrant

    return [LiveGrant("inv_1", GRANT_TOKENS, GRANT_TOKENS, None, "paid", now),
            LiveGrant("promo_1", GRANT_TOKENS, GRANT_TOKENS, now + 400 * 86_400_000, "promo",
                      now),
            LiveGrant("inv_2", GRANT_TOKENS, GRANT_TOKENS, now + 400 * 86_400_000, "paid", now)]


class EntLedger:
    """One user's steady-state window of ENT_EVENTS events under one entitlements setup."""

    def __init__(self, client: aioredis.Redis, name: str, budget: TokenBudget, plan: str,
                 override: str | None = None, grants: int = 0) -> None:
        self.client, self.name, self.budget, self.plan = client, name, budget, plan
        self.override, self.grants = override, grants
        self.user, self.step, self.k = f"ent-{name}", spacing_ms(ENT_EVENTS), 0
        self.drawn = 0

    async def prepare(self) -> None:
        """Load ent (entitlements on), fill the window, warm up."""
        if self.budget.entitlements:
            grants = three_grants(T0) if self.grants else []
            assert await self.budget.load_entitlements(
                self.user, epoch=1, plan=self.override, suspended_until_ms=None,
                grants=grants, ttl_s=60 * 86_400)
        filler = TokenBudget(self.client, [WINDOW])  # plain charges: nothing drawn
        await fill(self.client, filler, self.user, ENT_EVENTS)
        for _ in range(WARM_UP):
            await self.reserve()

    async def reserve(self) -> None:
        d = await self.budget.reserve(self.user, f"m{self.k:015d}", 1, route=ROUTE,
                                      plan_name=self.plan,
                                      now_ms=T0 + (ENT_EVENTS + self.k) * self.step)
        self.k += 1
        assert d.allowed and not d.duplicate, d
        self.drawn += d.drawn


def ent_ledgers(client: aioredis.Redis) -> list[EntLedger]:
    """The rows of the entitlements table, plain first."""
    off = TokenBudget(client, [WINDOW])
    on = TokenBudget(client, [WINDOW], catalog=ENT_CATALOG, entitlements=True)
    return [EntLedger(client, "plain (entitlements off)", off, "plain"),
            EntLedger(client, "entitlements on, empty ent", on, "plain"),
            EntLedger(client, "plan override", on, "plain", override="pro"),
            EntLedger(client, "3 grants, not drawing", on, "plain", grants=3),
            EntLedger(client, "3 grants, drawing", on, "drawing", grants=3)]


def print_ent_table(rows: list[tuple[EntLedger, Series]], calls: int, quick: bool) -> None:
    plain = rows[0][1]
    head = (f"{'reserve, ' + str(ENT_EVENTS) + ' events in window':>32} | {'p50':>5} "
            f"{'p99':>6} {'server':>6} | {'p50 / plain':>11} {'server / plain':>14} | "
            f"{'drawn':>6}")
    print()
    print(f"Entitlements, {calls} admitted cost-1 reservations per row"
          f"{' (--quick)' if quick else ''}; times in µs, server = Redis time per call")
    print(head)
    print("-" * len(head))
    for ledger, r in rows:
        print(f"{ledger.name:>32} | {r.p50():>5.0f} {r.p99():>6.0f} {r.server():>6.1f} | "
              f"{r.p50() / plain.p50():>11.2f} {r.server() / plain.server():>14.2f} | "
              f"{ledger.drawn:>6}")
    worst = max(r.p50() for ledger, r in rows if "override" in ledger.name
                or "not drawing" in ledger.name) / plain.p50()
    print(f"target: override and 3 grants p50 <= 1.1x plain (worst {worst:.2f}x)")


async def run_entitlements(quick: bool) -> None:
    rounds, per_round = (10, 150) if quick else (20, 300)  # 10 events: cheap even in full
    with RedisServer() as server:
        client = aioredis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
        await client.script_load(script("budget_reserve").source)  # fill pipelines EVALSHA
        ledgers = ent_ledgers(client)
        for ledger in ledgers:
            await ledger.prepare()
        series = [Series() for _ in ledgers]
        for _ in range(rounds):
            for ledger, r in zip(ledgers, series, strict=True):
                await block(client, r, per_round, ledger.reserve)
        await client.aclose()
    print_ent_table(list(zip(ledgers, series, strict=True)), rounds * per_round, quick)


async def run(quick: bool) -> None:
    rounds, per_round = (5, 60) if quick else (15, 200)
    naive_budget_calls = 10_000 if quick else 60_000  # per round, divided by n
    with RedisServer() as server:
        client = aioredis.Redis(host="127.0.0.1", port=server.port, socket_timeout=30)
        budget = TokenBudget(client, [WINDOW])
        trivial_sha = await client.script_load(TRIVIAL)
        naive_sha = await client.script_load(NAIVE)
        await budget.reserve("warm-up", "warm-up", 1, now_ms=T0)  # loads the ledger script

        async def trivial() -> None:
            await client.evalsha(trivial_sha, 0)

        ledgers = [Ledger(client, budget, naive_sha, n) for n in SIZES]
        memory = [await ledger.prepare() for ledger in ledgers]
        base = Series()
        reserves = [Series() for _ in ledgers]
        naives = [Series() for _ in ledgers]
        # rounds interleave every kind of call, so a busy moment of a shared machine
        # spreads over all of them instead of spoiling one row
        for _ in range(rounds):
            await block(client, base, per_round, trivial)
            for ledger, r, nv in zip(ledgers, reserves, naives, strict=True):
                await block(client, r, per_round, ledger.reserve)
                await block(client, nv, max(1, naive_budget_calls // ledger.n), ledger.naive)
                # the naive script leaves Lua garbage (tables of up to 100k ids) that Lua
                # would otherwise collect during the next calls, billing them for it
                await client.eval("collectgarbage('collect')", 0)
        await client.aclose()
    rows = [(ledger.n, r, nv, mem)
            for ledger, r, nv, mem in zip(ledgers, reserves, naives, memory, strict=True)]
    print_table(base, rows, rounds * per_round, quick)


def print_table(base: Series, rows: list[tuple[int, Series, Series, float]], calls: int,
                quick: bool) -> None:
    small = rows[0][1]
    head = (f"{'events in window':>16} | {'reserve p50':>11} {'p99':>6} {'server':>6} | "
            f"{'naive p50':>10} {'p99':>8} {'server':>8} | {'B/event':>7} | "
            f"{'p50 / trivial':>13} {'p50 / 10 ev':>11} {'server / 10 ev':>14}")
    print(f"Token budget ledger, one 30-day window, {calls} admitted cost-1 reservations per "
          f"size{' (--quick)' if quick else ''}; times in µs, server = Redis time per call")
    print(head)
    print("-" * len(head))
    print(f"{'trivial EVALSHA':>16} | {base.p50():>11.0f} {base.p99():>6.0f} "
          f"{base.server():>6.1f} | {'':>10} {'':>8} {'':>8} | {'':>7} | {1:>13.2f}")
    for n, r, nv, memory in rows:
        print(f"{n:>16,} | {r.p50():>11.0f} {r.p99():>6.0f} {r.server():>6.1f} | "
              f"{nv.p50():>10.0f} {nv.p99():>8.0f} {nv.server():>8.1f} | {memory:>7.0f} | "
              f"{r.p50() / base.p50():>13.2f} {r.p50() / small.p50():>11.2f} "
              f"{r.server() / small.server():>14.2f}")
    big = rows[-1]
    worst = max(r.p50() for _, r, _, _ in rows) / base.p50()
    print(f"targets: reserve p50 <= 1.3x trivial (worst {worst:.2f}x); 100k events <= 1.2x "
          f"10 events (p50 {big[1].p50() / small.p50():.2f}x, server "
          f"{big[1].server() / small.server():.2f}x); <= 150 B/event (100k: {big[3]:.0f} B)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls per size")
    parser.add_argument("--entitlements-only", action="store_true",
                        help="only the entitlements table")
    args = parser.parse_args()
    if not args.entitlements_only:
        asyncio.run(run(args.quick))
    asyncio.run(run_entitlements(args.quick))


if __name__ == "__main__":
    main()
