"""Cold start of every handler: lazy (as written) against an eager variant of the same code.

For each function of template.yaml, the median over fresh interpreters of "import the
handler module, then answer its first event" (``events/<dir>.json``), side by side with
the eager variant (``bench/_eager_variant.py``: FastAPI, Powertools Logger, Metrics and
Tracer, and a boto3 Secrets Manager client created at import, then the same ``app``).
Runs are interleaved (lazy, eager, then eager, lazy, ...) so both see the same machine,
and each handler gets one untimed run per variant first to warm the disk cache (and write
the bytecode the timed runs load, as the deployed layers ship it).

    .venv/bin/python bench/cold_start.py [--repeats 7] [--quick] [--tracing] [--secrets]
    .venv/bin/python bench/cold_start.py --deployed [--repeats 3] [--warm 20]
                                         [--tree NAME=COMMIT ...] [--handlers a,b]

What each run is, and why the comparison is fair:

- One fresh ``python -c`` per run, cwd and ``sys.path[0]`` the function's code directory
  (Lambda's task root), the layers on ``PYTHONPATH``; the clock starts after the event is
  read (Lambda's runtime has read it too) and stops when the handler returns.
- The environment is the function's own from template.yaml, plus what ``make invoke``
  sets: local mode, a private redis-server (standalone) and one emulator process for every
  provider, provider keys in environment variables, ``PAGES_ALLOW_PRIVATE_HOSTS`` for job
  extraction. Metrics are on (``POWERTOOLS_METRICS_DISABLED`` unset) and ``LOG_LEVEL`` is
  the template's INFO, so the EMF and log lines are written as in Lambda.
- Both variants run as in Lambda: ``AWS_LAMBDA_FUNCTION_NAME``, ``LAMBDA_TASK_ROOT``,
  ``AWS_REGION`` and (fake) credentials are set.
- Tracing is OFF in both by default (``POWERTOOLS_TRACE_DISABLED=true``), as deployed:
  template.yaml turns on no X-Ray tracing. The eager variant still constructs its Tracer
  (an eager handler does, whatever the setting); the lazy app then skips it. With
  ``--tracing`` both run with tracing on (``_X_AMZN_TRACE_ID`` set, as Lambda does with
  active tracing): the lazy app then creates its Tracer on the first request, so that
  cost is in its first invocation too.
- ``--secrets``: provider keys come from Secrets Manager, as in the cloud (``*_SECRET_ARN``
  from the template, served by moto's server via ``AWS_ENDPOINT_URL_SECRETS_MANAGER``), so
  the lazy variant pays for boto3 on its first secret read just as it would in Lambda.
- Only what a Lambda environment has is importable: the deps layer's pinned packages, the
  runtime's boto3 and the project's layers. Other venv packages (dev tools) are hidden from
  the child, since some libraries import optional extras when present (httpx imports its
  command line, rich and click, if they are installed).
- Bytecode as deployed: the layer builds ship ``.pyc`` files (Lambda cannot write them,
  ``/opt`` and ``/var/task`` are read-only), so a cold start there never compiles the
  project's source. Children write and read bytecode under one private
  ``PYTHONPYCACHEPREFIX`` (the checkouts are left untouched, whatever
  ``PYTHONDONTWRITEBYTECODE`` says in the parent): the untimed warm-up run of each variant
  compiles, the timed runs load ``.pyc`` files, for both variants and every tree alike.
- The redis-server is flushed before every run: each run sees an empty budget and
  throttle, as a new user would, and never waits for a provider slot.
- Job extraction's event names a page on the internet; the bench points its ``url`` at
  the emulator's job page, so the run fetches a page and calls the model as in the cloud.
- Time spent waiting for a provider slot is not cold start but is part of the first
  invocation; it is read from the request's metrics line (``ProviderWaitMs``) and shown,
  and the last column compares the two variants without it.
- A row shows its statuses when a run answered anything but 200.

Needs ``aws-xray-sdk`` in the venv (the eager Tracer imports it).

``--deployed`` measures the configuration the functions are deployed in instead, and no
eager variant (``bench/_deployed_stack.py`` starts what it reaches): provider keys from
Secrets Manager (moto), ``REDIS_AUTH=iam`` over TLS with a token signed by botocore,
entitlements on against the local DynamoDB table, metrics on, ``LOG_LEVEL=INFO``. Two
variants of each handler, interleaved as above:

- ``cold``: import + first request, then ``--warm`` more requests in the same process, each
  timed alone (a warm request's p50 is over all of them);
- ``restore``: the import is done first and not timed, then the after-restore hooks
  (``snapshot_restore_py``, as the runtime runs them) and the first request are: with
  SnapStart the snapshot is taken after the import, so an import made then is free at
  restore, while whatever the first request imports is not. Lambda's own restore (loading
  the snapshot) is not in it.

Every request has a request id of its own (and an Idempotency-Key of its own, when the
event has one), so that none replays another. Redis is not flushed between runs: a cold
environment usually serves a user whose entitlements and budget the shared cache already
holds (the untimed first round loads them once). Rates and the budget are set high enough
that no request waits for a slot or runs out (``DEPLOYED_SETTINGS``; the same code path).
``--tree NAME=COMMIT`` runs that commit's layers and functions beside this tree's, in the
same interleaved rounds. ``ATTO_ENV`` stays ``local``, so that job extraction may fetch the
emulator's page on loopback; for these events it changes nothing else (they carry the
authorizer's claims and no ``X-Atto-User`` header).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
LAYERS = [ROOT / "layers" / "usage_limits", ROOT / "layers" / "providers"]
sys.path[:0] = [str(ROOT)]

#: Set in a child's environment: top-level modules to hide from it (comma-separated).
HIDE_ENV = "BENCH_HIDE_MODULES"
#: Distributions a Lambda environment has besides the deps layer: the runtime's boto3 and its
#: dependencies, its snapshot-restore-py, this project's layers, and the eager variant's
#: X-Ray SDK.
RUNTIME_DISTRIBUTIONS = {"boto3", "botocore", "s3transfer", "jmespath", "python-dateutil", "six",
                         "urllib3", "snapshot-restore-py", "atto-cloud-usage-limits",
                         "aws-xray-sdk", "wrapt", "pip", "setuptools"}

#: The child: read the event, then time import + first invocation (printed as one line).
#: argv: event file, module, function name, timeout s, handler attribute, mode (``cold``:
#: import + first request; ``restore``: import untimed, then the after-restore hooks +
#: first request, as after a SnapStart restore), warm requests to time after the first,
#: and "1" to give every request its own request id (and Idempotency-Key, if it has one).
CHILD = r"""
import importlib, json, os, statistics, sys, time, uuid

for name in filter(None, os.environ.get("BENCH_HIDE_MODULES", "").split(",")):
    sys.modules[name] = None  # not in a Lambda environment: importing it fails there too

class Context:
    function_name, memory_limit_in_mb = sys.argv[3], 512
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:" + sys.argv[3]

    def __init__(self, timeout_s, request_id):
        self.deadline, self.aws_request_id = time.monotonic() + timeout_s, request_id

    def get_remaining_time_in_millis(self):
        return max(0, int((self.deadline - time.monotonic()) * 1000))

with open(sys.argv[1], encoding="utf-8") as f:
    text = f.read()
mode, warm, fresh = sys.argv[6], int(sys.argv[7]), sys.argv[8] == "1"

def request():
    event = json.loads(text)
    if not fresh:
        return event, Context(float(sys.argv[4]), "cold-start")
    rid = str(uuid.uuid4())
    event["requestContext"]["requestId"] = rid
    if "idempotency-key" in event["headers"]:
        event["headers"]["idempotency-key"] = str(uuid.uuid4())
    return event, Context(float(sys.argv[4]), rid)

event, context = request()
start, cpu = time.perf_counter(), time.process_time()
module = importlib.import_module(sys.argv[2])
import_ms = (time.perf_counter() - start) * 1000
handler = getattr(module, sys.argv[5])
if mode == "restore":  # the snapshot was taken here: what came before is free
    import snapshot_restore_py
    start, cpu = time.perf_counter(), time.process_time()
    for hook, args, kwargs in snapshot_restore_py.get_after_restore():
        hook(*args, **kwargs)
result = handler(event, context)
done, cpu_done = time.perf_counter(), time.process_time()
print("FIRST-DONE", flush=True)
warm_us, warm_cpu_us, statuses = [], [], {result["statusCode"]}
for _ in range(warm):
    event, context = request()
    begin, begin_cpu = time.perf_counter(), time.process_time()
    statuses.add(handler(event, context)["statusCode"])
    warm_us.append((time.perf_counter() - begin) * 1e6)
    warm_cpu_us.append((time.process_time() - begin_cpu) * 1e6)
print("COLD-START " + json.dumps({"import_ms": import_ms,
                                  "total_ms": (done - start) * 1000,
                                  "cpu_ms": (cpu_done - cpu) * 1000,
                                  "status": result["statusCode"], "warm_us": warm_us,
                                  "warm_cpu_us": warm_cpu_us,
                                  "warm_status": sorted(statuses)}), flush=True)
"""

#: The parent's bytecode settings, never passed on: a child's are set by ``child_env``.
BYTECODE_VARIABLES = ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")
#: Environment prefixes of the parent that never reach a child (the child's are set here).
OWN_PREFIXES = ("ATTO_", "LLM_", "SALARY_", "SEARCH_", "PAGES_", "REDIS_", "POWERTOOLS_",
                "AWS_", "LAMBDA_", "_X_AMZN", "ELASTICACHE_", "LOG_LEVEL", "IDEMPOTENCY_")


def lambda_hidden_modules() -> list[str]:
    """Top-level modules of the venv that a Lambda environment does not have.

    The venv holds dev tools too, and some packages import optional extras when present:
    httpx imports its command line (rich, click, pygments) when they are installed, which
    costs a cold start in the venv what it never costs in Lambda. Children hide every
    module whose distributions are neither in ``layers/deps/requirements.txt`` nor
    ``RUNTIME_DISTRIBUTIONS``.
    """
    import importlib.metadata as metadata
    import re

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    pinned = [line.split("==")[0] for line in
              (ROOT / "layers" / "deps" / "requirements.txt").read_text().splitlines()
              if "==" in line and not line.lstrip().startswith("#")]
    allowed = {norm(name) for name in [*pinned, *RUNTIME_DISTRIBUTIONS]}
    return sorted(module for module, dists in metadata.packages_distributions().items()
                  if module.isidentifier() and not module.startswith("_")
                  and not any(norm(d) in allowed for d in dists))


def secret_variables(logical_id: str) -> list[str]:
    """The ``*_SECRET_ARN`` variables template.yaml gives this function."""
    from local.template import load_template

    props = load_template()["Resources"][logical_id]["Properties"]
    variables = (props.get("Environment") or {}).get("Variables") or {}
    return sorted(name for name in variables if name.endswith("_SECRET_ARN"))


#: ``--deployed``: rates no run reaches, so that no request waits for a provider slot (the
#: code path is the same at any rate), and a budget of the template's two windows that no
#: run uses up.
DEPLOYED_SETTINGS = {"LLM_RATE": "1000/s", "SALARY_RATE": "1000/s", "SEARCH_RATE": "1000/s",
                     "PAGES_RATE": "1000/s", "ATTO_BUDGET": "100000000/1h,1000000000/30d"}
#: The variants of each handler a run times: name -> (module, child mode); the module None is
#: the handler's own (template.yaml).
CLASSIC_VARIANTS: dict[str, tuple[str | None, str]] = {
    "lazy": (None, "cold"), "eager": ("_eager_variant", "cold")}
DEPLOYED_VARIANTS: dict[str, tuple[str | None, str]] = {
    "cold": (None, "cold"), "restore": (None, "restore")}


def child_env(spec: Any, redis_url: str, emulator: Any, *, tracing: bool,
              stack: Any = None, deployed: bool = False,
              pycache: Path | None = None) -> dict[str, str]:
    """The function's template environment with the local stack's settings on top.

    Args:
        spec: the function (``local.template.FunctionSpec``).
        redis_url: the Redis to use unless ``stack`` gives one.
        emulator: the running provider emulator.
        tracing: see the module's docstring.
        stack: a ``_deployed_stack.DeployedStack``: provider keys from its Secrets Manager,
            and (a full stack) its Redis, IAM user and entitlements table; None: keys in
            environment variables.
        deployed: ``DEPLOYED_SETTINGS`` on top.
        pycache: where children keep their bytecode (see the module's docstring).
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(OWN_PREFIXES) and k not in BYTECODE_VARIABLES}
    if pycache is not None:
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    env.update(spec.env)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(BENCH), *map(str, LAYERS)]),
        "ATTO_ENV": "local", "REDIS_URL": redis_url, "REDIS_CLUSTER": "false",
        "REDIS_AUTH": "none",
        "LLM_BASE_URL": emulator.openai_base_url, "SALARY_BASE_URL": emulator.adzuna_base_url,
        "SEARCH_BASE_URL": emulator.tavily_base_url, "PAGES_ALLOW_PRIVATE_HOSTS": "127.0.0.1",
        "AWS_LAMBDA_FUNCTION_NAME": spec.logical_id, "LAMBDA_TASK_ROOT": str(ROOT / spec.code_dir),
        "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": "512", "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "cold-start",
        "AWS_SECRET_ACCESS_KEY": "cold-start", "AWS_SESSION_TOKEN": "cold-start",
        "AWS_EC2_METADATA_DISABLED": "true", HIDE_ENV: ",".join(lambda_hidden_modules()),
    })
    if tracing:
        env["_X_AMZN_TRACE_ID"] = ("Root=1-5759e988-bd862e3fe1be46a994272793;"
                                   "Parent=53995c3f42cd8ad8;Sampled=1")
    else:
        env["POWERTOOLS_TRACE_DISABLED"] = "true"
    if stack is None:
        env.update({"LLM_API_KEY": "local-key", "SALARY_APP_ID": "local-id",
                    "SALARY_APP_KEY": "local-key", "SEARCH_API_KEY": "local-key"})
    else:
        env.update(stack.env)
        for name in secret_variables(spec.logical_id):
            env[name] = stack.secret_arns[name]
    if deployed:
        env.update(DEPLOYED_SETTINGS)
    return env


def event_file(spec: Any, emulator: Any, folder: Path) -> Path:
    """The function's event, with job extraction's page moved to the emulator."""
    name = Path(spec.code_dir).name
    event = json.loads((ROOT / "events" / f"{name}.json").read_text(encoding="utf-8"))
    if name == "job_extraction":
        body = json.loads(event["body"])
        body["url"] = emulator.job_page_url()
        event["body"] = json.dumps(body)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(event), encoding="utf-8")
    return path


def run_once(spec: Any, module: str, event: Path, env: dict[str, str],
             tree: Path = ROOT, *, mode: str = "cold", warm: int = 0,
             fresh: bool = False) -> dict[str, Any]:
    """One fresh interpreter: import ``module`` and answer ``event`` with its handler, in the
    function's code directory of the checkout at ``tree``.

    Args:
        mode: ``cold`` (time import + first request) or ``restore`` (time the after-restore
            hooks + first request; the import is the snapshot's).
        warm: requests to time after the first (``warm_us``, one sample each).
        fresh: a request id (and Idempotency-Key, if the event has one) of its own for
            every request, so that none is a replay.
    """
    attribute = spec.handler.rpartition(".")[2]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(event), module, spec.logical_id, str(spec.timeout),
         attribute, mode, str(warm), "1" if fresh else "0"],
        cwd=tree / spec.code_dir, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COLD-START ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{spec.logical_id} ({module}) failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("COLD-START "))
    result["wait_ms"] = provider_wait_ms(proc.stdout.partition("FIRST-DONE")[0])
    return result


def provider_wait_ms(stdout: str) -> float:
    """Time spent waiting for provider slots, from the request's EMF metrics line."""
    waited = 0.0
    for line in stdout.splitlines():
        if line.startswith("{") and '"ProviderWaitMs"' in line:
            waits = json.loads(line)["ProviderWaitMs"]
            waited += sum(waits) if isinstance(waits, list) else float(waits)
    return waited


def bench(repeats: int, *, tracing: bool, secrets: bool, deployed: bool = False,
          warm: int = 0, trees: dict[str, Path] | None = None,
          handlers: list[str] | None = None, server: Any = None) -> dict[str, list[dict[str, Any]]]:
    """Cold starts of every handler, for each tree of code: lazy against eager, or as
    deployed (``deployed``) cold against restored from a SnapStart snapshot.

    Args:
        repeats: timed runs per handler, variant and tree.
        tracing, secrets: see the module's docstring.
        deployed: the deployed configuration (``_deployed_stack``; see the module's
            docstring): variants ``cold`` and ``restore`` instead of ``lazy`` and ``eager``.
        warm: with ``deployed``, requests timed after the first in each ``cold`` run.
        trees: name -> the root of a checkout whose ``layers`` and ``functions`` run (the
            measuring code is always this one); ``{"now": ROOT}`` when None. Runs of every
            tree are interleaved, so all of them see the same machine.
        handlers: the function directories to run (every one when None).
        server: a running ``RedisServer`` to use (flushed before each run); a private one
            when None. Unused with ``deployed``, which runs its own.

    Returns:
        Per tree, one row per handler: for each variant, medians of import_ms, total_ms
        (the timed part: import + first call, or restore hooks + first call), wait_ms and
        cpu_ms (the CPU time of the timed part, every thread of the process); with
        ``deployed``, ``warm_us`` and ``warm_cpu_us``: the p50 of every warm request of the
        tree's runs, in wall and in CPU time; and the statuses answered.
    """
    from _deployed_stack import DeployedStack

    from local.emulator import EmulatorProcess
    from local.redis_servers import RedisServer
    from local.template import functions

    trees = trees or {"now": ROOT}
    variants = DEPLOYED_VARIANTS if deployed else CLASSIC_VARIANTS
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    stack = DeployedStack(full=deployed) if deployed or secrets else None
    own = RedisServer() if server is None and not deployed else None
    try:
        if stack is not None:
            stack.__enter__()
        redis = stack.redis if deployed else (own.start() if own is not None else server)
        with EmulatorProcess() as emulator, tempfile.TemporaryDirectory() as tmp:
            seen: set[str] = set()
            for spec in functions():
                name = Path(spec.code_dir).name
                # one row per function: a function with several routes (admin) counts once
                if name in seen or (handlers is not None and name not in handlers):
                    continue
                seen.add(name)
                if not all((tree / spec.code_dir / "app.py").exists() for tree in trees.values()):
                    continue
                env = child_env(spec, redis.url, emulator, tracing=tracing, stack=stack,
                                deployed=deployed, pycache=Path(tmp) / "pycache")
                event = event_file(spec, emulator, Path(tmp))
                modules = {v: module or spec.handler.rpartition(".")[0]
                           for v, (module, _) in variants.items()}
                runs = [(tree, variant) for tree in trees for variant in variants]
                samples: dict[tuple[str, str], list[dict[str, Any]]] = {r: [] for r in runs}
                for i in range(repeats + 1):
                    for tree, variant in runs[i % len(runs):] + runs[:i % len(runs)]:
                        if not deployed:  # deployed: the user's cached state stays (docstring)
                            redis.cli("FLUSHALL")
                        mode = variants[variant][1]
                        result = run_once(spec, modules[variant], event,
                                          tree_env(env, trees[tree]), trees[tree], mode=mode,
                                          warm=warm if deployed and mode == "cold" else 0,
                                          fresh=deployed)
                        if i:  # the first round only warms the disk cache and compiles
                            samples[(tree, variant)].append(result)
                for tree in trees:
                    rows[tree].append(_row(name, {v: samples[(tree, v)] for v in variants}))
    finally:
        if own is not None:
            own.close()
        if stack is not None:
            stack.__exit__(None, None, None)
    return rows


def _row(handler: str, samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One handler's row of one tree from its samples, by variant (see ``bench``)."""
    row: dict[str, Any] = {"handler": handler, **{
        f"{variant}_{key}": statistics.median(s[key] for s in runs)
        for variant, runs in samples.items()
        for key in ("import_ms", "total_ms", "wait_ms", "cpu_ms")}}
    for key in ("warm_us", "warm_cpu_us"):
        warm = [us for runs in samples.values() for s in runs for us in s[key]]
        if warm:
            row[key] = statistics.median(warm)
    row["status"] = sorted({int(status) for runs in samples.values() for s in runs
                            for status in s["warm_status"]})
    return row


def tree_env(env: dict[str, str], tree: Path) -> dict[str, str]:
    """``env`` with the layers and task root of the checkout at ``tree``."""
    layers = [tree / "layers" / "usage_limits", tree / "layers" / "providers"]
    task_root = Path(env["LAMBDA_TASK_ROOT"])
    return {**env, "PYTHONPATH": os.pathsep.join([str(BENCH), *map(str, layers)]),
            "LAMBDA_TASK_ROOT": str(tree / task_root.relative_to(ROOT))}


def median_ratio(rows: list[dict[str, Any]]) -> tuple[float, float, float]:
    """Median over handlers of lazy and eager import + first call (slot waits left out), ms,
    and their ratio."""
    lazy = statistics.median(r["lazy_total_ms"] - r["lazy_wait_ms"] for r in rows)
    eager = statistics.median(r["eager_total_ms"] - r["eager_wait_ms"] for r in rows)
    return lazy, eager, lazy / eager


def median_cpu_ratio(rows: list[dict[str, Any]]) -> tuple[float, float, float]:
    """Median over handlers of lazy and eager import + first call in CPU time, ms, and their
    ratio (a slot wait uses no CPU; nor does the time other processes hold the CPU, which
    makes this steadier than wall time on a shared machine)."""
    lazy = statistics.median(r["lazy_cpu_ms"] for r in rows)
    eager = statistics.median(r["eager_cpu_ms"] for r in rows)
    return lazy, eager, lazy / eager


def deployed_medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over handlers of a deployed run's rows (one tree): ``cold`` (import + first
    call, slot waits left out), ``restore`` (after-restore hooks + first call, waits left
    out), ``cold_cpu`` and ``restore_cpu`` (their CPU time), ms; ``warm`` and ``warm_cpu``
    (each handler's warm p50, wall and CPU time), µs."""
    return {
        "cold": statistics.median(r["cold_total_ms"] - r["cold_wait_ms"] for r in rows),
        "restore": statistics.median(r["restore_total_ms"] - r["restore_wait_ms"] for r in rows),
        "cold_cpu": statistics.median(r["cold_cpu_ms"] for r in rows),
        "restore_cpu": statistics.median(r["restore_cpu_ms"] for r in rows),
        "warm": statistics.median(r["warm_us"] for r in rows),
        "warm_cpu": statistics.median(r["warm_cpu_us"] for r in rows),
    }


def print_deployed(result: dict[str, list[dict[str, Any]]], repeats: int, warm: int) -> None:
    """The deployed run's table: per handler and tree, then the medians over handlers and
    each tree against the first."""
    names = list(result)
    print(f"\nCold start as deployed (bench/_deployed_stack.py): median of {repeats} fresh "
          f"interpreters per variant; warm p50 over {warm} requests per cold run. Trees: "
          + ", ".join(names) + "\n")
    print("Each cell: wall time (CPU time of the process).\n")
    print("| handler | " + " | ".join(f"{t}: import + 1st call ms | {t}: 1st call after "
                                      f"restore ms | {t}: warm p50 µs" for t in names) + " |")
    print("|---|" + "---:|" * (3 * len(names)))
    for i, row in enumerate(result[names[0]]):
        cells = []
        for t in names:
            r = result[t][i]
            cells += [f"{r['cold_total_ms'] - r['cold_wait_ms']:.0f} ({r['cold_cpu_ms']:.0f})",
                      f"{r['restore_total_ms'] - r['restore_wait_ms']:.0f} "
                      f"({r['restore_cpu_ms']:.0f})",
                      f"{r['warm_us']:.0f} ({r['warm_cpu_us']:.0f})"]
        statuses = sorted({s for t in names for s in result[t][i]["status"]})
        status = "" if statuses == [200] else f" (status {statuses})"
        print(f"| {row['handler']}{status} | " + " | ".join(cells) + " |")
    medians = {t: deployed_medians(result[t]) for t in names}
    print("\nMedian over handlers (slot waits left out):\n")
    print("| tree | import + 1st call ms | 1st call after restore ms | warm p50 µs |")
    print("|---|---:|---:|---:|")
    for t in names:
        m = medians[t]
        print(f"| {t} | {m['cold']:.0f} ({m['cold_cpu']:.0f}) | {m['restore']:.0f} "
              f"({m['restore_cpu']:.0f}) | {m['warm']:.0f} ({m['warm_cpu']:.0f}) |")
    first = medians[names[0]]
    for t in names[1:]:
        m = medians[t]
        print(f"\n{t} against {names[0]}, wall (CPU): " + ", ".join(
            f"{label} {(m[k] - first[k]) / first[k]:+.1%} "
            f"({(m[k + '_cpu'] - first[k + '_cpu']) / first[k + '_cpu']:+.1%})"
            for label, k in (("import + 1st call", "cold"), ("after restore", "restore"),
                             ("warm p50", "warm"))))


def commit_trees(specs: list[str], folder: Path) -> dict[str, Path]:
    """``{"now": ROOT}``, then for each ``NAME=COMMIT`` that commit's layers and functions."""
    from hotpath import baseline_tree

    trees = {"now": ROOT}
    for spec in specs:
        name, _, commit = spec.partition("=")
        if not name or not commit or name in trees:
            raise SystemExit(f"--tree wants NAME=COMMIT with a new NAME, got {spec!r}")
        (folder / name).mkdir()
        trees[name] = baseline_tree(commit, folder / name)
    return trees


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per variant")
    parser.add_argument("--quick", action="store_true", help="3 timed runs per variant")
    parser.add_argument("--tracing", action="store_true",
                        help="tracing on in both variants (default: off in both, as deployed)")
    parser.add_argument("--secrets", action="store_true",
                        help="provider keys from Secrets Manager (moto), as in the cloud")
    parser.add_argument("--deployed", action="store_true",
                        help="the deployed configuration: cold and after a SnapStart restore")
    parser.add_argument("--warm", type=int, default=20,
                        help="--deployed: requests timed after the first (default 20)")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=COMMIT",
                        help="--deployed: also run that commit's layers and functions")
    parser.add_argument("--handlers", help="comma-separated function directories (default all)")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    handlers = args.handlers.split(",") if args.handlers else None
    if args.deployed:
        with tempfile.TemporaryDirectory() as tmp:
            result = bench(repeats, tracing=args.tracing, secrets=True, deployed=True,
                           warm=args.warm, trees=commit_trees(args.tree, Path(tmp)),
                           handlers=handlers)
        print_deployed(result, repeats, args.warm)
        return
    try:
        import aws_xray_sdk  # noqa: F401
    except ImportError:
        sys.exit("the eager variant's Tracer needs aws-xray-sdk: "
                 ".venv/bin/pip install aws-xray-sdk")
    rows = bench(repeats, tracing=args.tracing, secrets=args.secrets, handlers=handlers)["now"]
    mode = (f"tracing {'on' if args.tracing else 'off'} in both, provider keys from "
            f"{'Secrets Manager (moto)' if args.secrets else 'environment variables'}")
    print(f"\nCold start: import + first invocation, median of {repeats} fresh interpreters "
          f"({mode})\n")
    print("| handler | lazy import ms | lazy import + 1st call ms | eager import ms "
          "| eager import + 1st call ms | lazy / eager | of which slot waits, lazy / eager ms "
          "| lazy / eager without waits |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["lazy_total_ms"] / r["eager_total_ms"]
        bare = ((r["lazy_total_ms"] - r["lazy_wait_ms"])
                / (r["eager_total_ms"] - r["eager_wait_ms"]))
        status = "" if r["status"] == [200] else f" (status {r['status']})"
        print(f"| {r['handler']}{status} | {r['lazy_import_ms']:.0f} | {r['lazy_total_ms']:.0f} "
              f"| {r['eager_import_ms']:.0f} | {r['eager_total_ms']:.0f} | {ratio:.2f}x "
              f"| {r['lazy_wait_ms']:.0f} / {r['eager_wait_ms']:.0f} | {bare:.2f}x |")
    lazy, eager, _ = median_ratio(rows)
    print(f"\nMedian over handlers, slot waits left out: lazy {lazy:.0f} ms, eager {eager:.0f} ms, "
          f"{lazy / eager:.2f}x (target <= 0.70x). Slot waits are the provider throttle's "
          "(ProviderWaitMs of the request's metrics line).")
    lazy, eager, _ = median_cpu_ratio(rows)
    print(f"The same in CPU time of the process (steadier on a shared machine): lazy {lazy:.0f} "
          f"ms, eager {eager:.0f} ms, {lazy / eager:.2f}x.")

if __name__ == "__main__":
    main()
