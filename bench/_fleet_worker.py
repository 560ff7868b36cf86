"""One fleet process = one Lambda execution environment.

It imports the real function modules once (module-level state, the Redis client and the
HTTP client are reused across invocations, as in Lambda) and calls their Mangum handlers
one at a time with API Gateway payload-v2 events. Every invocation is written to a JSONL
file as two lines: ``start`` before the handler runs and ``end`` after it answered, each
flushed at once, so a process killed mid-request leaves its in-flight request on record.

Client retries across environments: a request with an ``Idempotency-Key`` answered 503
(``limiter_unavailable`` during a Redis fault, or ``provider_busy``) is put on a queue
shared by every process, and another process (another environment) sends it again, with
the same key, once its Retry-After has passed, as a client does; up to ``MAX_RETRIES``
times while it keeps getting 503. Its record names the process that got the 503
(``retry_of``). Half the time the process that got the 503 then stays idle for
``IDLE_AFTER_503_S``, as a Lambda environment often does between invocations: its
refunds kept during the fault stay pending while the client's retry is served elsewhere.

A heavy process (``heavy`` > 0) sends only as one user (the fleet's heavy user), only the
routes that call the LLM provider, with no pause and no key, and keeps ``heavy`` of them
in flight at once: each is one invocation of the real handler's ASGI app through Mangum's
own event and response handling, as ``heavy`` environments each serving one would, but
on one event loop, so that a request waiting for its slot costs no CPU of a process of
its own. Together they keep more requests of that user waiting for the LLM provider's
slots than its rate serves: the provider stays saturated by one user.

Each ``end`` record carries ``wait_ms``: per provider, the milliseconds the invocation
waited for its throttle slots (what the functions report as the ``ProviderWaitMs``
metric), and, for a 503 ``provider_busy``, the ``provider`` the body names.

When the run ends, a process makes the refunds it still keeps (``drain``), as an
environment would before its next invocation: the checks then see money at rest.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import json
import os
import queue
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: route name -> (module, method, path, declared cost in tokens)
ROUTES: dict[str, tuple[str, str, str, int]] = {
    "structured": ("functions.structured.app", "POST", "/v1/structured", 8),
    "embeddings": ("functions.embeddings.app", "POST", "/v1/embeddings", 1),
    "salary": ("functions.salary.app", "GET", "/v1/salary", 2),
    "job_extraction": ("functions.job_extraction.app", "POST", "/v1/job-extraction", 10),
    "company_research": ("functions.company_research.app", "POST", "/v1/company-research", 20),
    "market_context": ("functions.market_context.app", "POST", "/v1/market-context", 30),
    "usage": ("functions.usage.app", "GET", "/v1/usage", 0),
}
#: Mix of routes, by weight: mostly the cheap ones.
WEIGHTS = {"structured": 30, "embeddings": 25, "salary": 18, "job_extraction": 8,
           "company_research": 5, "market_context": 6, "usage": 8}
#: The heavy user's mix: the routes whose only provider is the LLM.
HEAVY_WEIGHTS = {"structured": 30, "embeddings": 25, "job_extraction": 8}
#: How many times a client sends a keyed request again after a 503 (each time elsewhere).
MAX_RETRIES = 3
#: How long an environment that answered a keyed 503 may then stay idle (half the time), s.
IDLE_AFTER_503_S = 2.5
#: What company_research / market_context settle to when they found nothing.
SEARCH_ONLY_COST = 5
NO_DATA_COST = 2

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                           "skills": {"type": "array",
                                                      "items": {"type": "string"}}},
          "required": ["title", "skills"], "additionalProperties": False}
HTML = ("<html><head><title>Data Engineer - Acme Ltd</title></head><body><h1>Data Engineer"
        "</h1><p>Acme Ltd, Berlin (hybrid). EUR 70,000 - 85,000.</p><ul><li>Python and SQL"
        "</li><li>Airflow</li><li>AWS</li></ul></body></html>")
TITLES = ["data engineer", "python developer", "nurse", "product manager", "nojobs tester"]


def request_for(route: str, rng: random.Random) -> dict[str, Any]:
    """The body / query of one request of ``route`` (market_context sometimes finds no data)."""
    if route == "structured":
        return {"body": {"prompt": f"Senior {rng.choice(TITLES)} in Berlin", "schema": SCHEMA}}
    if route == "embeddings":
        return {"body": {"input": [f"text {rng.randrange(1000)}", "another text"]}}
    if route == "salary":
        return {"query": {"title": rng.choice(TITLES[:4]), "location": "London"}}
    if route == "job_extraction":
        return {"body": {"html": HTML}}
    if route == "company_research":
        return {"body": {"company": rng.choice(["Acme Ltd", "Globex", "Initech"])}}
    if route == "market_context":
        return {"body": {"role": rng.choice(TITLES)}}
    return {}


def expected_charge(route: str, status: int, body: Any) -> int:
    """Tokens a successful first answer leaves in the ledger (after any settle)."""
    cost = ROUTES[route][3]
    if not 200 <= status < 300 or not isinstance(body, dict):
        return 0
    if route == "company_research" and body.get("model") is None:
        return SEARCH_ONLY_COST
    if route == "market_context" and len(body.get("sources") or []) < 2:
        return NO_DATA_COST
    return cost


def _setup(env: dict[str, str], lease_s: float | None,
           log_path: str | None = None) -> dict[str, Any]:
    os.environ.update(env)
    os.environ.pop("ATTO_ENV", None)  # identity only from the JWT claims
    for path in (ROOT, ROOT / "layers" / "usage_limits", ROOT / "layers" / "providers"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if lease_s is not None:
        # The deployment's lease length for capped providers (ProviderClient keeps the
        # library default of 30 s); shorter here so a leaked lease comes back within a run.
        from usage_limits.throttle import ProviderThrottle

        ProviderThrottle.from_env.__func__.__kwdefaults__["lease_s"] = lease_s  # type: ignore[attr-defined]
    import logging

    logging.disable(logging.INFO)  # per-request logs would flood the run; errors are kept
    if log_path is not None:
        # The functions log and emit metrics (EMF) on stdout, as in Lambda: into a file;
        # the library's own warnings (stderr: a draw unresolved, a copy dropped) with them.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    handlers = {name: importlib.import_module(spec[0]).handler for name, spec in ROUTES.items()}
    _record_waits()
    return handlers


#: Per provider, ms waited for throttle slots by the invocation under way (its own dict:
#: a heavy process has several under way).
WAITS: contextvars.ContextVar[dict[str, float]] = contextvars.ContextVar("fleet_waits")


def _record_waits() -> None:
    """Add every ``ProviderWaitMs`` the functions report to ``WAITS`` (the metric goes on
    to the log as before)."""
    from usage_limits.web import observability as obs

    report = obs.provider_count

    def provider_count(provider: str, name: str, value: float = 1,
                       unit: str = "Count") -> None:
        if name == obs.PROVIDER_WAIT_MS:
            waits = WAITS.get(None)
            if waits is not None:
                waits[provider] = waits.get(provider, 0.0) + value
        report(provider, name, value, unit)

    obs.provider_count = provider_count  # type: ignore[assignment]


def _until(stop_at: Any) -> float:
    """The stop time: a plain number, or the current value of a shared one."""
    return float(stop_at.value if hasattr(stop_at, "value") else stop_at)


def main(wid: str, env: dict[str, str], out_path: str, stop_at: Any, seed: int,
         users: list[str], timeout_s: float, idem_fraction: float = 0.2,
         repeat_fraction: float = 0.35, only: str | None = None,
         lease_s: float | None = None, think_s: float = 0.01,
         start_at: float = 0.0, retries: Any = None, heavy: int = 0) -> None:
    """Invoke handlers until ``stop_at`` (epoch seconds, or a shared ``multiprocessing.Value``
    holding them, which the harness may push back); ``only`` pins one route, once.

    ``retries`` is the multiprocessing queue of keyed requests that got a 503 somewhere:
    this process sends those of other processes again (see the module docstring).
    ``heavy``: send only as ``users[0]``, only ``HEAVY_WEIGHTS``' routes, this many at once.
    """
    # The emulator and Redis stand in for servers with CPUs of their own. On a small host
    # the Lambda processes yield to them, so arrivals are stamped when they arrive rather
    # than when a starved emulator gets around to them.
    os.nice(10)
    handlers = _setup(env, lease_s, out_path.replace("records-", "log-").replace(".jsonl", ".txt"))
    from local.lambda_events import FakeContext, http_event, invoke, lambda_loop

    time.sleep(max(0.0, start_at - time.time()))  # every environment starts together
    rng = random.Random(seed)
    names, weights = list(WEIGHTS), list(WEIGHTS.values())
    used_keys: list[tuple[str, str, str, dict[str, Any]]] = []  # (user, key, route, request)
    if heavy:
        with open(out_path, "a", buffering=1) as out, lambda_loop() as loop:
            loop.run_until_complete(asyncio.gather(*(
                _heavy(wid, f"{wid}.{i}", out, stop_at, random.Random(seed * 100 + i),
                       users[0], timeout_s) for i in range(heavy))))
            left = drain(loop)
            out.write(json.dumps({"kind": "drain", "w": wid, "left": left}) + "\n")
        return
    with open(out_path, "a", buffering=1) as out, lambda_loop() as loop:
        n = 0
        while time.time() < _until(stop_at):
            n += 1
            key: str | None = None
            retry_of = _take_retry(retries, wid)
            if retry_of is not None:
                user, key, route, req, origin, _, attempt = retry_of  # another's 503
            elif only is not None:
                route, user, req = only, users[0], request_for(only, rng)
            elif used_keys and rng.random() < idem_fraction * repeat_fraction:
                user, key, route, req = rng.choice(used_keys)  # a deliberate repeat
            else:
                user = users[min(int(rng.expovariate(3.0 / len(users))), len(users) - 1)]
                route = rng.choices(names, weights)[0]
                req = request_for(route, rng)
                if route != "usage" and rng.random() < idem_fraction:
                    key = f"{wid}-{n}-{uuid.uuid4().hex[:6]}"
                    used_keys.append((user, key, route, req))
            _, method, path, cost = ROUTES[route]
            gateway_id = uuid.uuid4().hex[:16]
            rid = f"k:{key}" if key else f"r:{gateway_id}"
            headers = {"idempotency-key": key} if key else None
            event = http_event(method, path, body=req.get("body"), query=req.get("query"),
                               headers=headers, user=user, request_id=gateway_id)
            record: dict[str, Any] = {"w": wid, "pid": os.getpid(), "user": user, "route": route,
                                      "rid": rid, "cost": cost, "timeout": timeout_s,
                                      "retry_of": origin if retry_of is not None else None}
            WAITS.set({})
            t0 = time.time()
            out.write(json.dumps({"kind": "start", "t0": t0, **record}) + "\n")
            try:
                result = invoke(handlers[route], event, FakeContext(timeout_s=timeout_s))
                status, body, hdrs = result.status, result.body, result.headers
            except Exception as exc:  # noqa: BLE001 - Lambda would report an error: record it
                status, body, hdrs = 0, {"error": {"code": f"crash:{type(exc).__name__}"}}, {}
            t1 = time.time()
            replayed = hdrs.get("idempotent-replayed") == "true"
            code = None
            if status >= 400 or status == 0:
                code = ((body or {}).get("error") or {}).get("code") \
                    if isinstance(body, dict) else "unparsable"
            out.write(json.dumps({
                "kind": "end", "t0": t0, "t1": t1, "status": status, "code": code,
                "replayed": replayed,
                "charged": 0 if replayed else expected_charge(route, status, body),
                "wait_ms": {p: round(ms, 1) for p, ms in WAITS.get().items()},
                "provider": ((body or {}).get("error") or {}).get("provider")
                if code == "provider_busy" and isinstance(body, dict) else None,
                **record}) + "\n")
            tries = 0 if retry_of is None else attempt
            if retries is not None and key is not None and status == 503 \
                    and tries < MAX_RETRIES:
                # the client will send it again after Retry-After, and another environment
                # will serve it
                wait_s = float(hdrs.get("retry-after", "1") or 1)
                retries.put((user, key, route, req, wid, t1 + wait_s, tries + 1))
                if rng.random() < 0.5:  # no invocation for a while: kept refunds wait
                    time.sleep(max(0.0, min(IDLE_AFTER_503_S, _until(stop_at) - time.time())))
            if only is not None:
                return
            if think_s:
                time.sleep(rng.uniform(0, think_s))
        left = drain(loop)
        out.write(json.dumps({"kind": "drain", "w": wid, "left": left}) + "\n")


async def _heavy(wid: str, slot: str, out: Any, stop_at: Any, rng: random.Random, user: str,
                 timeout_s: float) -> None:
    """One of a heavy process's requests in flight: invoke, record, again until ``stop_at``."""
    from mangum import Mangum
    from mangum.protocols.http import HTTPCycle

    from local.lambda_events import FakeContext, http_event, invoke

    names, weights = list(HEAVY_WEIGHTS), list(HEAVY_WEIGHTS.values())
    apps = {name: Mangum(importlib.import_module(ROUTES[name][0]).app, lifespan="off")
            for name in names}
    while time.time() < _until(stop_at):
        route = rng.choices(names, weights)[0]
        req = request_for(route, rng)
        _, method, path, cost = ROUTES[route]
        gateway_id = uuid.uuid4().hex[:16]
        event = http_event(method, path, body=req.get("body"), query=req.get("query"),
                           user=user, request_id=gateway_id)
        record = {"w": wid, "slot": slot, "pid": os.getpid(), "user": user, "route": route,
                  "rid": f"r:{gateway_id}", "cost": cost, "timeout": timeout_s,
                  "retry_of": None}
        WAITS.set({})
        t0 = time.time()
        out.write(json.dumps({"kind": "start", "t0": t0, **record}) + "\n")
        mangum = apps[route]
        gateway = mangum.infer(event, FakeContext(timeout_s=timeout_s))
        cycle = HTTPCycle(gateway.scope, gateway.body)
        await cycle.run(mangum.app)
        answer = gateway({"status": cycle.status, "headers": cycle.headers, "body": cycle.body})
        result = invoke(lambda _e, _c, a=answer: a, event)
        status, body = result.status, result.body
        code = ((body or {}).get("error") or {}).get("code") \
            if status >= 400 and isinstance(body, dict) else None
        out.write(json.dumps({
            "kind": "end", "t0": t0, "t1": time.time(), "status": status, "code": code,
            "replayed": False, "charged": expected_charge(route, status, body),
            "wait_ms": {p: round(ms, 1) for p, ms in WAITS.get().items()},
            "provider": (body["error"].get("provider") if code == "provider_busy" else None),
            **record}) + "\n")


#: How long a process at the end of the run keeps trying the refunds it kept, s.
DRAIN_S = 15.0


def drain(loop: Any, timeout_s: float = DRAIN_S) -> int:
    """Make the refunds this environment still keeps, trying again until none is left or
    ``timeout_s`` passed; how many are left."""
    from usage_limits.web import refunds

    deadline = time.time() + timeout_s
    while refunds.pending() and time.time() < deadline:
        loop.run_until_complete(refunds.retry())
        if refunds.pending():
            time.sleep(0.2)
    return refunds.pending()


def _take_retry(retries: Any, wid: str) -> tuple[Any, ...] | None:
    """A keyed request that got a 503 in another process, to send again here, or None."""
    if retries is None:
        return None
    try:
        item = retries.get_nowait()
    except queue.Empty:
        return None
    if item[4] == wid or time.time() < item[5]:  # ours, or its Retry-After not yet over
        retries.put(item)
        return None
    return tuple(item)
