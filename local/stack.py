"""The local stack: what ``make serve`` and ``make invoke`` start when nothing is configured.

With ``REDIS_URL`` unset a private redis-server is started; with ``LLM_BASE_URL`` unset the
offline provider emulator is started and every provider's base URL and key point at it;
with ``ATTO_ENTITLEMENTS_TABLE`` unset a local DynamoDB (moto's server) with the
entitlements table and the usage records' table is started; with neither ``ATTO_PLANS``
nor ``ATTO_BUDGET`` set, the plans are ``LOCAL_PLANS``: the usual budget as the default
plan, and a ``free`` plan with a small monthly quota (chosen with ``X-Atto-Plan: free``)
to try credit grants on, and a larger ``pro`` plan for an operator to give.
Local mode (``ATTO_ENV=local``) is always on here. With ``ATTO_LOCAL_DATA`` set (``make
serve`` sets ``.local``), that Redis and that DynamoDB keep their state in it across
restarts (budgets, grants, usage records, the audit log); ``make reset-local`` deletes it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .redis_servers import RedisServer

#: Where each provider family lives on the emulator (see local/emulator).
EMULATOR_ROUTES = {
    "LLM_BASE_URL": "/v1",
    "SALARY_BASE_URL": "/adzuna",
    "SEARCH_BASE_URL": "/tavily",
}
EMULATOR_KEYS = {"LLM_API_KEY": "local-key", "SALARY_APP_ID": "local-id",
                 "SALARY_APP_KEY": "local-key", "SEARCH_API_KEY": "local-key",
                 # the emulator's job pages live on loopback; honoured only in local mode
                 "PAGES_ALLOW_PRIVATE_HOSTS": "127.0.0.1"}


#: The emulator's port when it is free (events/env.json and docs/api.md use it).
EMULATOR_PORT = 8100
#: The emulator's address as events and docs name it; ``make invoke`` retargets it.
DOCUMENTED_EMULATOR_URL = f"http://127.0.0.1:{EMULATOR_PORT}"

#: Local values that beat the template's cloud ones unless the shell sets them: quiet logs
#: (one JSON line per request at INFO), no EMF metrics, and a plain local Redis rather than
#: the template's IAM-authenticated cluster.
LOCAL_DEFAULTS = {"LOG_LEVEL": "WARNING", "POWERTOOLS_METRICS_DISABLED": "true",
                  "REDIS_AUTH": "none", "REDIS_CLUSTER": "false"}


#: The plans of the local stack when the shell defines none: ``default`` is the usual
#: ATTO_BUDGET (every example's plan); ``free`` runs out of its 30-day quota after 24
#: tokens, so a grant's draws can be seen within minutes (README, docs/entitlements.md);
#: ``pro`` is the plan docs/operator.md's examples give a user.
LOCAL_PLANS = "default=100/1h,1000/30d;free=100/1h,24/30d;pro=400/1h,20000/30d"


#: The directory that keeps the local Redis and DynamoDB state across restarts (``make
#: serve`` sets it to ``.local``); unset or empty, nothing is kept.
DATA_ENV = "ATTO_LOCAL_DATA"
#: The local Redis keeps its data in an append-only file (fsync every second), so a stop,
#: even a kill, loses at most the last second.
KEEP_REDIS = ["--appendonly", "yes", "--appendfsync", "everysec"]


def _emulator_port(env: dict[str, str]) -> int:
    """``EMULATOR_PORT`` (default 8100) when free, else any free port (0).

    Probed with ``SO_REUSEADDR``, as the emulator binds it: connections of a server that
    just stopped linger in TIME_WAIT for a minute, and without it a quick restart of ``make
    serve`` would find 8100 "in use" and move the emulator (the documented job-page URLs
    then fail). A port another process listens on is still refused.
    """
    import socket

    port = int(env.get("EMULATOR_PORT") or EMULATOR_PORT)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return 0
    return port


@contextlib.contextmanager
def local_stack(env: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Start what is missing, export its settings into ``os.environ``, yield what was set."""
    env = os.environ if env is None else env  # type: ignore[assignment]
    started: dict[str, str] = {"ATTO_ENV": "local"}
    for name, value in LOCAL_DEFAULTS.items():
        if name not in env:
            started[name] = value
    if not env.get("ATTO_PLANS") and not env.get("ATTO_BUDGET"):
        started["ATTO_PLANS"] = LOCAL_PLANS
    with contextlib.ExitStack() as stack:
        data = env.get(DATA_ENV) or None
        if data:
            os.makedirs(os.path.join(data, "redis"), exist_ok=True)
        if not env.get("REDIS_URL"):
            server = stack.enter_context(RedisServer(
                workdir=os.path.join(data, "redis"), extra=KEEP_REDIS) if data
                else RedisServer())
            started["REDIS_URL"] = server.url
        if not env.get("ATTO_ENTITLEMENTS_TABLE"):
            _local_aws_defaults(env, started)
            from .dynamodb import DynamoServer

            dynamo = stack.enter_context(DynamoServer(
                state_file=os.path.join(data, "dynamodb.json") if data else None))
            started["ATTO_ENTITLEMENTS_TABLE"] = dynamo.table
            if not env.get("ATTO_USAGE_TABLE"):
                started["ATTO_USAGE_TABLE"] = dynamo.usage_table
            if not env.get("ATTO_IDEMPOTENCY_TABLE"):
                started["ATTO_IDEMPOTENCY_TABLE"] = dynamo.idempotency_table
            started["ATTO_DYNAMODB_ENDPOINT"] = dynamo.url
        if not env.get("LLM_BASE_URL"):
            from .emulator import EmulatorProcess

            emulator = stack.enter_context(EmulatorProcess(port=_emulator_port(env)))
            for name, suffix in EMULATOR_ROUTES.items():
                started.setdefault(name, env.get(name) or emulator.url + suffix)
            for name, value in EMULATOR_KEYS.items():
                started.setdefault(name, env.get(name) or value)
            started["EMULATOR_URL"] = emulator.url
        env.update(started)
        yield started


def _local_aws_defaults(env: dict[str, str], started: dict[str, str]) -> None:
    """A region, and stand-in credentials when none are configured (the local DynamoDB
    accepts any; real ones are left alone)."""
    if not env.get("AWS_DEFAULT_REGION") and not env.get("AWS_REGION"):
        started["AWS_DEFAULT_REGION"] = env["AWS_DEFAULT_REGION"] = "us-east-1"
    if not env.get("AWS_ACCESS_KEY_ID") and not env.get("AWS_PROFILE"):
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            started[name] = env[name] = "local"
