"""The fleet's faults. Each takes the run's context and returns ``{"fault", "start", "end",
...}`` in epoch seconds: ``end`` is when the fault stopped (Redis answers again, the
emulator's forced answers are used up, a replica took over)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import _fleet_worker

from usage_limits.keys import provider_keys


@dataclass
class Context:
    redis: Any  # _fleet_servers.FleetRedis
    emulator: Any  # local.emulator.EmulatorProcess
    env: dict[str, str]
    out_dir: str
    timeout_s: float
    lease_s: float
    stop_at: float = 0.0
    dynamo: Any = None  # local.dynamodb.DynamoServer, when the run has entitlements
    injected_429: dict[str, int] = field(default_factory=dict)
    later: list[Callable[[], dict[str, Any]]] = field(default_factory=list)


def _drained(ctx: Context, family: str, timeout_s: float) -> float:
    """Wait until the emulator used up the forced answers of ``family``; when that was."""
    deadline = min(time.time() + timeout_s, ctx.stop_at)
    while time.time() < deadline:
        pending = ctx.emulator.stats(times=False)["families"][family]["pending"]
        if not pending["fail_next"] and not pending["spike_next"]:
            return time.time()
        time.sleep(0.05)
    return time.time()


def redis_restart(ctx: Context) -> dict[str, Any]:
    """SIGKILL a Redis master and start it again on the same port after ``down_s``; it
    reloads its append-only file (fsync always), so the ledger survives."""
    node = ctx.redis.masters()[0]
    down_s = 1.0 if ctx.redis.cluster else 2.0  # below the cluster node timeout: no failover
    start = time.time()
    node.stop(kill=True)
    time.sleep(down_s)
    node.start()
    if ctx.redis.cluster:
        ctx.redis.wait_healthy(20.0)
    return {"fault": "redis-restart", "start": start, "end": time.time(),
            "note": f"master :{node.port} down {down_s:g}s"}


def script_flush(ctx: Context) -> dict[str, Any]:
    """SCRIPT FLUSH on every master: the next EVALSHA gets NOSCRIPT and falls back to EVAL."""
    start = time.time()
    for node in ctx.redis.masters():
        node.cli("script", "flush")
    return {"fault": "script-flush", "start": start, "end": time.time()}


def redis_slow(ctx: Context) -> dict[str, Any]:
    """DEBUG SLEEP 1 on every master: longer than the clients' 0.5 s socket timeout."""
    start = time.time()
    threads = [threading.Thread(target=node.cli, args=("debug", "sleep", "1"))
               for node in ctx.redis.masters()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"fault": "redis-slow", "start": start, "end": time.time(), "note": "DEBUG SLEEP 1"}


def ledger_refused(ctx: Context) -> dict[str, Any]:
    """For 1.5 s every master refuses scripts (ACL: NOPERM on EVAL/EVALSHA) while plain
    commands work: the ledger unavailable, the idempotency store available, as when a
    user's ledger keys and an idempotency record live on different shards and only the
    ledger's is down. Reservations fail (503, refund kept) while the keys can be claimed
    again, so a client's retry is served by another environment while the refund is kept."""
    start = time.time()
    for node in ctx.redis.masters():
        node.cli("acl", "setuser", "default", "-eval", "-evalsha")
    time.sleep(1.5)
    for node in ctx.redis.masters():
        node.cli("acl", "setuser", "default", "+eval", "+evalsha")
    return {"fault": "ledger-refused", "start": start, "end": time.time(),
            "note": "EVAL/EVALSHA refused 1.5 s, plain commands served"}


def upstream_5xx(ctx: Context) -> dict[str, Any]:
    """A storm of 500s: the next 20 LLM calls fail."""
    start = time.time()
    ctx.emulator.fail_next(20, 500, family="llm")
    return {"fault": "upstream-5xx", "start": start, "end": _drained(ctx, "llm", 20.0),
            "note": "next 20 llm calls -> 500"}


def upstream_429(ctx: Context) -> dict[str, Any]:
    """A storm of 429s with Retry-After 1 s: the next 8 LLM calls."""
    start = time.time()
    ctx.emulator.fail_next(8, 429, family="llm", retry_after_s=1.0)
    ctx.injected_429["llm"] = ctx.injected_429.get("llm", 0) + 8
    return {"fault": "upstream-429", "start": start, "end": _drained(ctx, "llm", 20.0),
            "note": "next 8 llm calls -> 429, Retry-After 1s"}


def upstream_latency(ctx: Context) -> dict[str, Any]:
    """The next 3 LLM answers take longer than the Lambda timeout: the call must give up
    before the deadline with a refunded 502."""
    start = time.time()
    spike_ms = (ctx.timeout_s + 1.0) * 1000
    ctx.emulator.spike_next(3, latency_ms=spike_ms, family="llm")
    return {"fault": "upstream-latency", "start": start, "end": _drained(ctx, "llm", 20.0),
            "note": f"next 3 llm answers +{spike_ms:.0f} ms"}


def kill_lease_holder(ctx: Context) -> dict[str, Any]:
    """A Lambda holding one of search's two in-flight leases (its upstream call hangs) is
    SIGKILLed; its lease must expire on its own ``lease_s`` after it was taken."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    port = hole.getsockname()[1]
    got = threading.Event()
    conns: list[socket.socket] = []

    def accept() -> None:
        hole.settimeout(15.0)
        try:
            conn, _ = hole.accept()
            conns.append(conn)
            conn.settimeout(5.0)
            conn.recv(65536)  # the request arrived: the caller holds its lease now
            got.set()
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    env = {**ctx.env, "SEARCH_BASE_URL": f"http://127.0.0.1:{port}"}
    victim = multiprocessing.get_context("spawn").Process(
        target=_fleet_worker.main, name="victim",
        args=("victim", env, os.path.join(ctx.out_dir, "records-victim.jsonl"),
              time.time() + 60, 0, ["victim-user"], ctx.timeout_s),
        kwargs={"only": "company_research", "lease_s": ctx.lease_s})
    victim.start()
    start = time.time()
    ok = got.wait(20.0)
    leases_key = provider_keys("search", "leases")[0]
    client = ctx.redis.client()
    before = {m: s for m, s in client.zrange(leases_key, 0, -1, withscores=True)}
    killed_at = time.time()
    if victim.pid:
        os.kill(victim.pid, signal.SIGKILL)
    victim.join(5)
    held: dict[bytes, float] = {}
    if ok:
        time.sleep(1.0)  # the fleet's own leases are released by now
        now_ms = time.time() * 1000
        held = {m: s for m, s in client.zrange(leases_key, 0, -1, withscores=True)
                if m in before and s > now_ms}
    for c in conns:
        c.close()
    hole.close()
    expiry = max(held.values()) / 1000 if held else None
    result = {"fault": "kill-lease-holder", "start": start, "end": killed_at,
              "note": f"victim held a search lease: {ok}; leaked leases seen: {len(held)}",
              "lease_s": ctx.lease_s,
              "slot_back_after_kill_s": round(expiry - killed_at, 3) if expiry else None}

    def freed() -> dict[str, Any]:
        # Measured after the run: when the leaked lease stopped counting (its expiry) and
        # whether Redis still lists it as live.
        now_ms = time.time() * 1000
        live = [m for m, s in client.zrange(leases_key, 0, -1, withscores=True)
                if m in held and s > now_ms]
        return {"leaked_lease_live_at_end": len(live)}

    ctx.later.append(freed)
    return result


def failover(ctx: Context) -> dict[str, Any]:
    """SIGKILL the master serving the busiest user's keys and wait until its replica is
    promoted (cluster only); the old master is started again and rejoins as a replica."""
    if not ctx.redis.cluster:
        return {"fault": "failover", "start": time.time(), "end": time.time(),
                "note": "skipped: standalone Redis has no replica"}
    node = ctx.redis.master_of("ul:{u:user-0}:log")
    start = time.time()
    node.stop(kill=True)
    waited = ctx.redis.wait_promoted(node, 30.0)
    end = time.time()
    node.start()  # rejoins as a replica of the promoted node
    return {"fault": "failover", "start": start, "end": end,
            "note": f"master :{node.port} killed; replica promoted after {waited:.2f}s"}


def _dynamo_fault(ctx: Context, name: str, kind: str, seconds: float, *,
                  operations: tuple[str, ...] | None = None, count: int | None = None,
                  note: str) -> dict[str, Any]:
    """Inject ``kind`` into the fleet's DynamoDB for ``seconds`` (``operations``: None for
    every call the request and operator paths make)."""
    if ctx.dynamo is None:
        return {"fault": name, "start": time.time(), "end": time.time(),
                "note": "skipped: the run has no DynamoDB"}
    ops = operations or DYNAMO_OPERATIONS
    start = time.time()
    before = dict(ctx.dynamo.injected)
    ctx.dynamo.inject(kind, operations=ops, seconds=seconds, count=count)
    time.sleep(seconds)
    hits = ctx.dynamo.injected.get(kind, 0) - before.get(kind, 0)
    return {"fault": name, "start": start, "end": time.time(), "calls_hit": hits,
            "note": f"{note}; {hits} calls met it"}


#: The DynamoDB operations of the request path and the operator path.
DYNAMO_OPERATIONS = ("TransactWriteItems", "Query", "GetItem", "UpdateItem", "PutItem")


def dynamo_down(ctx: Context) -> dict[str, Any]:
    """For 1 s DynamoDB answers every call 503 ServiceUnavailable (botocore retries)."""
    return _dynamo_fault(ctx, "dynamo-down", "down", 1.0,
                         note="every call 503 ServiceUnavailable for 1 s")


def dynamo_conflict(ctx: Context) -> dict[str, Any]:
    """For 2 s every transaction is cancelled with TransactionConflict on every item."""
    return _dynamo_fault(ctx, "dynamo-conflict", "conflict", 2.0,
                         operations=("TransactWriteItems",),
                         note="every transaction TransactionCanceledException "
                              "(TransactionConflict) for 2 s")


def dynamo_throttle(ctx: Context) -> dict[str, Any]:
    """For 0.4 s every call is throttled (ThrottlingException), then for 0.4 s refused for
    capacity (ProvisionedThroughputExceededException): botocore backs off and retries."""
    first = _dynamo_fault(ctx, "dynamo-throttle", "throttle", 0.4, note="")
    second = _dynamo_fault(ctx, "dynamo-throttle", "capacity", 0.4, note="")
    return {"fault": "dynamo-throttle", "start": first["start"], "end": second["end"],
            "calls_hit": first.get("calls_hit", 0) + second.get("calls_hit", 0),
            "note": f"ThrottlingException 0.4 s ({first['note'].split('; ')[1]}), then "
                    f"ProvisionedThroughputExceededException 0.4 s "
                    f"({second['note'].split('; ')[1]})"}


def dynamo_lost(ctx: Context) -> dict[str, Any]:
    """The next 6 transactions (within 3 s) are applied and their answers lost: the
    connection closes before the reply (botocore retries; the retry finds it applied)."""
    return _dynamo_fault(ctx, "dynamo-lost", "lost", 3.0, operations=("TransactWriteItems",),
                         count=6, note="next 6 transactions applied, answer lost")


FAULTS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "redis-restart": redis_restart,
    "script-flush": script_flush,
    "redis-slow": redis_slow,
    "kill-lease-holder": kill_lease_holder,
    "upstream-latency": upstream_latency,
    "upstream-5xx": upstream_5xx,
    "upstream-429": upstream_429,
    "ledger-refused": ledger_refused,
    "failover": failover,
    "dynamo-down": dynamo_down,
    "dynamo-conflict": dynamo_conflict,
    "dynamo-throttle": dynamo_throttle,
    "dynamo-lost": dynamo_lost,
}
#: When each fault fires, as a fraction of the run.
SCHEDULE = {"redis-restart": 0.08, "script-flush": 0.2, "redis-slow": 0.25,
            "upstream-5xx": 0.33, "upstream-429": 0.4, "upstream-latency": 0.5,
            "kill-lease-holder": 0.55, "ledger-refused": 0.65, "failover": 0.75,
            "dynamo-down": 0.14, "dynamo-conflict": 0.7, "dynamo-throttle": 0.6,
            "dynamo-lost": 0.8}
