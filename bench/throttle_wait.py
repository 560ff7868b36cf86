"""What ``WAIT 1 <ms>`` after a throttle reservation would cost, on a primary and its replica.

Redis replication is asynchronous: a reservation acknowledged by the primary can be lost
with it if it dies before the replica has it, and after the replica is promoted the
throttle may admit once more what it already admitted (the fleet's failover fault saw 5
calls against a 4/s limit once). ``WAIT 1 <ms>`` after the write would hold the caller until
one replica acknowledged it. This starts a private primary and a replica on loopback and
times, per reservation (``throttle_acquire.lua``):

    evalsha          the reservation alone (one round trip)
    evalsha+wait     the reservation, then WAIT 1 <timeout> (two round trips)
    pipelined        both in one pipeline (one round trip; WAIT still waits for the ack)

and how often WAIT returned before its replica acknowledged (``acked < 1``).

    .venv/bin/python bench/throttle_wait.py              # 2,000 calls per row
    .venv/bin/python bench/throttle_wait.py --calls 500
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import redis

from local.redis_servers import RedisServer
from usage_limits._scripts import script
from usage_limits.keys import provider_keys

#: WAIT's own timeout, ms: the longest a caller would be held for a replica that lags.
WAIT_TIMEOUT_MS = 100


def _args(now_ms: float) -> list[str]:
    """A reservation with a wide rate and wait, so every call is admitted."""
    return [f"{now_ms:.3f}", "0.1", "1000", "1", "1000", "10000", "50", "u", "1", "250",
            uuid.uuid4().hex]


def run(client: redis.Redis, calls: int, mode: str) -> tuple[list[float], int]:
    """Latencies (ms) of ``calls`` reservations in ``mode``, and WAITs not acknowledged."""
    acquire = client.register_script(script("throttle_acquire").source)
    state, prefix, *queue = provider_keys(uuid.uuid4().hex[:12], "gcra", "gcra:call:", "fq",
                                          "fq:entries", "fq:expiry", "fq:users")
    times, unacked = [], 0
    for _ in range(calls):
        keys = [state, prefix + uuid.uuid4().hex, *queue]
        started = time.perf_counter()
        if mode == "evalsha":
            acquire(keys=keys, args=_args(time.time() * 1000))
        elif mode == "evalsha+wait":
            acquire(keys=keys, args=_args(time.time() * 1000))
            unacked += client.wait(1, WAIT_TIMEOUT_MS) < 1
        else:
            pipe = client.pipeline(transaction=False)
            acquire(keys=keys, args=_args(time.time() * 1000), client=pipe)
            pipe.wait(1, WAIT_TIMEOUT_MS)
            unacked += pipe.execute()[1] < 1
        times.append((time.perf_counter() - started) * 1000)
    return times, unacked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    calls = parser.parse_args().calls
    with RedisServer() as primary, RedisServer(
            extra=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
        client = redis.Redis(port=primary.port)
        deadline = time.monotonic() + 10
        while client.info("replication").get("connected_slaves", 0) < 1:
            if time.monotonic() > deadline:
                raise SystemExit(f"replica on port {replica.port} did not connect")
            time.sleep(0.05)
        run(client, 200, "evalsha")  # warm-up: connections, script load
        print(f"{calls} reservations per row, primary and replica on loopback, "
              f"WAIT 1 {WAIT_TIMEOUT_MS}")
        print(f"{'row':<14}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'acked < 1':>11}")
        for mode in ("evalsha", "evalsha+wait", "pipelined"):
            times, unacked = run(client, calls, mode)
            q = statistics.quantiles(times, n=100)
            print(f"{mode:<14}{q[49]:>9.3f}{q[98]:>9.3f}{max(times):>9.3f}{unacked:>11}")
        client.close()


if __name__ == "__main__":
    main()
