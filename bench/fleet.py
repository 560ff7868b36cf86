"""Fleet harness: many Lambda environments at once, faults injected, the promise checked.

    .venv/bin/python bench/fleet.py [--processes 8] [--users 50] [--duration 60] [--cluster]
                                    [--quick] [--faults all|none|a,b,...] [--no-credit]
                                    [--no-heavy-user] [--heavy-processes 2] [--heavy-in-flight 20]
                                    [--out bench/out/fleet]

N spawned processes each act as one Lambda execution environment (``_fleet_worker``): the
real function modules, their Mangum handlers, payload-v2 events with JWT claims, one
request at a time. They share one Redis (standalone, or a 3-master cluster with replicas)
and one provider emulator whose own rate limits equal the throttle's, and one DynamoDB (moto's
server, ``local.dynamodb``) holding the entitlements: a share of the users has a small
paid grant and a small quota, and an operator changes grants, plans and suspensions and
makes support refunds while traffic runs (``_fleet_credit``). Faults fire at fixed points
of the run (``_fleet_faults``), in Redis, the providers and DynamoDB. Afterwards the
invariants (``_fleet_check``) are checked, once every hold of the run has ended and each
user's charges left provisional (a killed process, a refund lost to a fault) were undone as
the user's next request would undo them (``CreditOperator.settle``), from Redis, DynamoDB,
the emulator's counters
and the invocation records, a table is printed and PNG plots are written. Exit status 0
when every invariant holds.

A heavy user (on by default; off with ``--quick`` unless ``--heavy-user``) is served by
processes of its own that send only its LLM requests, each keeping ``--heavy-in-flight`` of
them in flight: together they keep the LLM provider saturated by one user, and
invariant 7 checks that no other user is refused ``provider_busy`` because of it. Its plan
(``heavy``, set through DynamoDB) has room for all it sends, so the provider's rate is what
holds it back; with ``--no-credit`` there is no plan store and no heavy user.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (HERE, ROOT, ROOT / "layers" / "usage_limits", ROOT / "layers" / "providers"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import _fleet_check as check  # noqa: E402
import _fleet_credit as credit  # noqa: E402
import _fleet_faults as faults  # noqa: E402
import _fleet_worker as worker  # noqa: E402
from _fleet_servers import ExternalRedis, FleetRedis  # noqa: E402

from local.emulator import EmulatorProcess  # noqa: E402
from usage_limits.web.settings import parse_plan  # noqa: E402

#: Provider limits: the throttle's (env) and the emulator's own, the same numbers.
PROVIDERS = {"llm": "10/s", "salary": "4/s", "search": "3/s"}
SEARCH_CONCURRENCY = 2
FAILURE_RATE = 0.05
#: Environments start this far apart, as a fleet scaling out does (not all in the same ms):
#: eight first requests at once on two cores hold each other up past any jitter allowance.
STAGGER_S = 0.25
#: Seconds of traffic, at least, after the last fault has ended.
RECOVERY_TAIL_S = 6.0
CHEAP_FAULTS = ["redis-restart", "script-flush", "redis-slow", "upstream-5xx", "upstream-429",
                "kill-lease-holder", "upstream-latency", "ledger-refused"]
DYNAMO_FAULTS = ["dynamo-down", "dynamo-conflict", "dynamo-throttle", "dynamo-lost"]
#: The user the heavy processes send as (not one of ``--users``: the mix never picks it).
HEAVY_USER = "heavy-user"
#: The fleet's entitlements table (in its own DynamoDB server).
TABLE = "fleet-entitlements"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    ap.add_argument("--cluster", action="store_true", help="3 masters + 3 replicas")
    ap.add_argument("--quick", action="store_true",
                    help="4 processes, 10 users, 20 s, every cheap fault")
    ap.add_argument("--faults", default="all", help="all, none or a comma-separated list of: "
                    + ", ".join(faults.FAULTS))
    ap.add_argument("--budget", default=None, help="ATTO_BUDGET (default scales with duration)")
    ap.add_argument("--lambda-timeout", type=float, default=None,
                    help="each invocation's Lambda timeout, s (default 6; quick 5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jitter-ms", type=float, default=100.0,
                    help="each provider's <P>_JITTER_MS: how late a call may leave after its "
                         "slot and still count within the limit. Eight processes on two cores "
                         "are held up by the OS for tens of ms at a time, most at start-up "
                         "(default 100 here; 15 ms on Lambda, where each has its own CPU)")
    ap.add_argument("--redis-url", default=None,
                    help="use this Redis (e.g. a staging cache) instead of starting one; the "
                         "REDIS_* variables of this shell (REDIS_CLUSTER, REDIS_AUTH, ...) are "
                         "passed on; only upstream faults are allowed")
    ap.add_argument("--no-credit", action="store_true",
                    help="no DynamoDB: no grants, operator changes or DynamoDB faults")
    ap.add_argument("--heavy-user", action=argparse.BooleanOptionalAction, default=None,
                    help="processes of their own send one user's LLM requests, many at once "
                         "(default on, off with --quick; needs the run's DynamoDB for its plan)")
    ap.add_argument("--heavy-processes", type=int, default=None,
                    help="how many (default 2; quick 1)")
    ap.add_argument("--heavy-in-flight", type=int, default=20,
                    help="requests each heavy process keeps in flight")
    ap.add_argument("--out", default=str(HERE / "out" / "fleet"))
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.processes, args.users, args.duration = 4, 10, 20.0
    args.lambda_timeout = args.lambda_timeout or (5.0 if args.quick else 6.0)
    if args.heavy_user is None:
        # Off in the quick run: on a busy two-core host its extra load made calls leave
        # later than the jitter allowance after their slots (invariants 3 and 4).
        args.heavy_user = not args.quick
    if args.no_credit:
        args.heavy_user = False  # its plan lives in DynamoDB
    if args.heavy_processes is None:
        args.heavy_processes = 1 if args.quick else 2
    args.heavy_processes = args.heavy_processes if args.heavy_user else 0
    if args.faults == "all":
        chosen = CHEAP_FAULTS + (["failover"] if args.cluster else []) \
            + ([] if args.no_credit else DYNAMO_FAULTS)
    elif args.faults == "none":
        chosen = []
    else:
        chosen = [f.strip() for f in args.faults.split(",") if f.strip()]
        unknown = set(chosen) - set(faults.FAULTS)
        if unknown:
            ap.error(f"unknown fault(s): {', '.join(sorted(unknown))}")
    if args.redis_url:
        own_redis = {"redis-restart", "script-flush", "redis-slow", "failover",
                     "ledger-refused"}
        if args.faults == "all":
            chosen = [f for f in chosen if f not in own_redis]
        elif own_redis & set(chosen):
            ap.error("Redis faults need a Redis this harness runs: "
                     + ", ".join(sorted(own_redis & set(chosen))))
    args.fault_list = chosen
    if args.budget is None:
        short = max(4, round(args.duration / 3))
        long_ = max(30, round(2 * args.duration))
        # The quick run's traffic is a fraction of the full one's and varies with the
        # machine's load (a busy 2-core machine: about 110 invocations in 20 s, the busiest
        # user at 63% of 60 tokens in the short window): its short window is half as large,
        # so users are still refused, and still get tokens back within seconds.
        args.budget = f"{30 if args.quick else 60}/{short}s,200/{long_}s"
    if set(chosen) & set(DYNAMO_FAULTS) and args.no_credit:
        ap.error("DynamoDB faults need the run's DynamoDB (drop --no-credit)")
    # The grant users' quota (their plan's longest window): small, so credit pays. The
    # quick run's traffic is small and, on a busy machine, mostly faults: a quota of 10
    # makes sure its grants are drawn (their 20- and 30-token routes get 422
    # cost_exceeds_plan), and grants that outlast the run keep them served, so recovery
    # after each fault is still seen. The full run's grants run out.
    args.quota = 10 if args.quick else 40
    args.grant_tokens = 100 if args.quick else 60
    return args


def provider_limits() -> dict[str, tuple[float, float]]:
    from usage_limits.throttle import parse_rate

    return {family: parse_rate(rate) for family, rate in PROVIDERS.items()}


def function_env(redis: FleetRedis, emu: EmulatorProcess,
                 args: argparse.Namespace) -> dict[str, str]:
    env = {**redis.env(), "ATTO_BUDGET": args.budget, "IDEMPOTENCY_TTL_S": "600",
           "LLM_BASE_URL": emu.openai_base_url, "LLM_API_KEY": "fleet-llm-key",
           "SALARY_BASE_URL": emu.adzuna_base_url, "SALARY_APP_ID": "fleet",
           "SALARY_APP_KEY": "fleet-key",
           "SEARCH_BASE_URL": emu.tavily_base_url, "SEARCH_API_KEY": "fleet-search-key",
           "SEARCH_CONCURRENCY": str(SEARCH_CONCURRENCY),
           # the emulator holds one limit for the whole llm family (its rate below), and the
           # check counts its calls together: one throttle for the provider, not per model
           "LLM_THROTTLE_BY": "provider"}
    for family, rate in PROVIDERS.items():
        env[f"{family.upper()}_RATE"] = rate
        env[f"{family.upper()}_BURST"] = "1"  # then no window of per_s holds more than rate
        env[f"{family.upper()}_JITTER_MS"] = f"{args.jitter_ms:g}"
    return env


def answers_env(dynamo: Any) -> dict[str, str]:
    """What the functions need to store keyed answers in the run's DynamoDB (every run)."""
    return {"ATTO_IDEMPOTENCY_TABLE": dynamo.idempotency_table,
            "ATTO_DYNAMODB_ENDPOINT": dynamo.url,
            "AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}


def credit_env(dynamo: Any, args: argparse.Namespace) -> dict[str, str]:
    """What the functions need to read entitlements from the run's DynamoDB."""
    return {"ATTO_ENTITLEMENTS_TABLE": TABLE, "ATTO_USAGE_TABLE": dynamo.usage_table,
            **answers_env(dynamo), **credit.plans_env(args.budget, args.quota)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("records-*.jsonl"):
        old.unlink()
    plan = parse_plan(args.budget)
    limits = provider_limits()
    lease_s = args.lambda_timeout + 1.0
    # Against a shared Redis, this run's users are its own: the checks read all their keys.
    prefix = f"fleet-{int(time.time())}-" if args.redis_url else ""
    users = [f"{prefix}user-{i}" for i in range(args.users)]
    emu_families = {f: {"rate": r, "latency_ms": 20, "jitter_ms": 40} for f, r in PROVIDERS.items()}
    redis_cm = (ExternalRedis(args.redis_url) if args.redis_url
                else FleetRedis(cluster=args.cluster))
    from local.dynamodb import DynamoServer

    # every run has the local DynamoDB: keyed answers are stored there (--no-credit leaves
    # out the entitlements, not the stored answers)
    with redis_cm as redis, \
            EmulatorProcess(seed=args.seed, failure_rate=FAILURE_RATE,
                            families=emu_families) as emu, DynamoServer(table=TABLE) as store:
        env = function_env(redis, emu, args)
        env.update(answers_env(store))
        dynamo = None if args.no_credit else store
        operator = None
        if dynamo is not None:
            env.update(credit_env(dynamo, args))
            operator = credit.CreditOperator(env, users, args.grant_tokens)
            operator.setup()
            if args.heavy_user:
                operator.set_plan(HEAVY_USER, "heavy")
        ctx = faults.Context(redis=redis, emulator=emu, env=env, out_dir=str(out),
                             timeout_s=args.lambda_timeout, lease_s=lease_s, dynamo=dynamo)
        spawn = multiprocessing.get_context("spawn")
        retries = spawn.Queue()  # keyed requests answered 503, retried by another process
        n_procs = args.processes + args.heavy_processes
        warmup_s = 4.0 + 1.0 * n_procs  # imports of every function, on 2 cores
        t_start = time.time() + warmup_s
        stop_at = t_start + args.duration
        ctx.stop_at = stop_at
        # Traffic goes on at least RECOVERY_TAIL_S after the last fault has ended (a fault
        # waits for its effect to drain, which can run late), so recovery is always seen.
        stop = spawn.Value("d", stop_at)
        procs = [spawn.Process(target=worker.main, name=f"fleet-{i}", args=(
            f"w{i}", env, str(out / f"records-w{i}.jsonl"), stop, args.seed * 1000 + i,
            users, args.lambda_timeout), kwargs={"lease_s": lease_s,
                                                 "start_at": t_start + i * STAGGER_S,
                                                 "retries": retries})
            for i in range(args.processes)]
        # The heavy user's processes take no other process's retries: they send only as it.
        procs += [spawn.Process(target=worker.main, name=f"fleet-h{i}", args=(
            f"h{i}", env, str(out / f"records-h{i}.jsonl"), stop, args.seed * 1000 + 100 + i,
            [HEAVY_USER], args.lambda_timeout), kwargs={
                "lease_s": lease_s, "start_at": t_start + (args.processes + i) * STAGGER_S,
                "heavy": args.heavy_in_flight}) for i in range(args.heavy_processes)]
        for p in procs:
            p.start()
        time.sleep(max(0.0, t_start - time.time()))
        if operator is not None:
            operator.start(t_start, args.duration)
        done: list[dict[str, Any]] = []

        def fire(names: list[str]) -> None:
            for name in sorted(names, key=lambda f: faults.SCHEDULE[f]):
                at = t_start + faults.SCHEDULE[name] * args.duration
                time.sleep(max(0.0, at - time.time()))
                print(f"[{time.time() - t_start:6.1f}s] fault {name}", flush=True)
                result = faults.FAULTS[name](ctx)
                done.append(result)
                # traffic goes on past every fault as soon as it ends: a fault that ran late
                # (an upstream storm lasts until its answers are used up) is still seen to
                # recover, and the ones after it still meet traffic
                with stop.get_lock():
                    stop.value = max(stop.value, result["end"] + RECOVERY_TAIL_S)

        # DynamoDB's faults keep their own points of the run, whatever the others took
        # (an upstream storm lasts until its forced answers are used up).
        dynamo_thread = threading.Thread(target=fire, name="fleet-dynamo-faults", args=(
            [f for f in args.fault_list if f in DYNAMO_FAULTS],))
        dynamo_thread.start()
        fire([f for f in args.fault_list if f not in DYNAMO_FAULTS])
        dynamo_thread.join()
        done.sort(key=lambda f: f["start"])
        for p in procs:
            p.join(max(1.0, stop.value - time.time() + args.lambda_timeout + 10
                       + worker.DRAIN_S))
            if p.is_alive():
                p.kill()
        if operator is not None:
            operator.join(30.0)
        # The run's last holds end; then every user's charges left provisional (a killed
        # process, a refund lost to a fault) are undone, as the user's next request would.
        settled: dict[str, int] = {}
        if operator is not None:
            from usage_limits.web.holds import HOLD_MARGIN_S

            time.sleep(max(0.0, stop.value + args.lambda_timeout + HOLD_MARGIN_S + 0.5
                           - time.time()))
            settled = operator.settle(users + ([HEAVY_USER] if args.heavy_user else []))
        # A leaked lease must come back by itself: wait for it (bounded) before measuring.
        for fault in done:
            back = fault.get("slot_back_after_kill_s")
            if back is not None:
                time.sleep(max(0.0, fault["end"] + back + 0.2 - time.time()))
        later: dict[str, Any] = {"undone_at_settle": settled}
        for fn in ctx.later:
            later.update(fn())
        try:
            result = evaluate(out, redis, emu, plan, limits, ctx, done, users, later, args,
                              t_start, operator)
        finally:
            if operator is not None:
                operator.close()
    return result


def evaluate(out: Path, redis: FleetRedis, emu: EmulatorProcess, plan: Any,
             limits: dict[str, tuple[float, float]], ctx: faults.Context,
             done: list[dict[str, Any]], users: list[str], later: dict[str, Any],
             args: argparse.Namespace, t_start: float,
             operator: credit.CreditOperator | None = None) -> dict[str, Any]:
    lines: list[str] = []
    for path in sorted(out.glob("records-*.jsonl")):
        lines += path.read_text().splitlines()
    ends, in_flight = check.load_records(lines)
    drains = [json.loads(line) for line in lines if '"kind": "drain"' in line]
    undrained = sum(d.get("left", 0) for d in drains)
    # every environment but the one killed on purpose ends its run by draining its kept
    # refunds: one that did not (it crashed, or was killed at the end) lost them
    no_drain = sorted({p.stem.removeprefix("records-") for p in out.glob("records-*.jsonl")}
                      - {"victim"} - {d["w"] for d in drains})
    refunded = operator.refunded if operator is not None else {}
    credit_plans = {}
    if operator is not None:
        from usage_limits.web.settings import parse_plans

        credit_plan = parse_plans(ctx.env).get("credit").windows  # type: ignore[union-attr]
        credit_plans = dict.fromkeys(operator.users, credit_plan)
        if args.heavy_user:
            credit_plans[HEAVY_USER] = parse_plans(ctx.env).get("heavy").windows  # type: ignore[union-attr]
    client = redis.client()
    everyone = users + ([HEAVY_USER] if args.heavy_user else [])
    ledger = check.read_ledger(client, sorted({r["user"] for r in ends} | {"victim-user"}
                                              | set(everyone)))
    stats = emu.stats(window_s=1.0, times=True)
    result = {
        "config": {"processes": args.processes, "users": args.users, "duration_s": args.duration,
                   "topology": "cluster (3 masters + 3 replicas)" if args.cluster
                   else "standalone", "budget": args.budget, "providers": PROVIDERS,
                   "search_concurrency": SEARCH_CONCURRENCY, "lambda_timeout_s":
                   args.lambda_timeout, "lease_s": ctx.lease_s, "failure_rate": FAILURE_RATE,
                   "faults": args.fault_list, "heavy_processes": args.heavy_processes,
                   "heavy_in_flight": args.heavy_in_flight},
        "invocations": len(ends),
        "status": _count(str(r["status"]) for r in ends),
        "overspend": check.check_overspend(ledger, plan, credit_plans),
        "ledger": check.check_ledger(ledger, ends, in_flight, [
            (f["start"], f["end"]) for f in done
            if f["fault"] in ("redis-restart", "redis-slow", "failover", "ledger-refused")],
            refunded) | {"ended_without_drain": no_drain},
        "credit": None if operator is None else check_credit(operator, ends, in_flight,
                                                             ledger, undrained),
        "providers": check.check_providers(stats, limits, ctx.injected_429),
        "deadlines": check.check_deadlines(ends),
        "faults": check.fault_costs(done, ends),
        "routes": check.summary_by_route(ends),
        "client_retries": _count(str(r["status"]) for r in ends if r.get("retry_of")),
        "heavy": None if not args.heavy_user else {
            **check.check_heavy_user(ends, HEAVY_USER, done),
            **check.saturation(stats["families"]["llm"].get("arrival_times") or [],
                               limits["llm"])},
        "after_run": later,
        "in_flight_at_end": len(in_flight),
    }
    led = result["ledger"]
    result["invariants"] = {
        "no_overspend": not result["overspend"]["violations"]
        and not result["overspend"]["running_totals_wrong"],
        "ledger_equals_work": not (led["charged_for_failed"] or led["missing_charges"]
                                   or led["wrong_cost"] or led["charged_twice"]
                                   or led["ended_without_drain"]),
        "providers_within_limit": not any(p["over"] or p["emulator_own_429"] > 0
                                          for p in result["providers"].values()),
        "deadlines_kept": result["deadlines"]["late"] == 0,
    }
    if result["heavy"] is not None:
        result["invariants"]["heavy_user_starves_no_one"] = not result["heavy"]["starved"]
    if result["credit"] is not None:
        result["invariants"]["credit_conserved"] = credit.credit_ok(result["credit"])
        result["books"] = audit_books(redis, ctx.dynamo, args, everyone)
        result["invariants"]["books_balance"] = result["books"]["balanced"]
    result["ok"] = all(result["invariants"].values())
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    if not args.no_plots:
        import _fleet_plots

        # the budget plot is of users on the base plan: not the heavy user's own
        _fleet_plots.write(out, stats, limits,
                           {u: d for u, d in ledger.items() if u != HEAVY_USER}, plan, ends,
                           t_start)
    return result


def check_credit(operator: credit.CreditOperator, ends: list[dict[str, Any]],
                 in_flight: list[dict[str, Any]], ledger: dict[str, dict[str, Any]],
                 undrained: int) -> dict[str, Any]:
    """Invariant 5, with how many kept refunds the processes could not drain."""
    return {**credit.check_credit(operator, ends, in_flight, ledger), "undrained": undrained}


def audit_books(redis: FleetRedis, dynamo: Any, args: argparse.Namespace,
                users: list[str]) -> dict[str, Any]:
    """Invariant 6: the conservation auditor, as production runs it, finds the books of
    every user balanced (grants against their charge records, the cached credit against
    DynamoDB's, the ledger's charges against the usage records), every user audited."""
    from _fleet_audit import run_audit

    report = run_audit(redis.url, dynamo.url, entitlements_table=TABLE,
                       usage_table=dynamo.usage_table, users=users, cluster=args.cluster)
    body = report.to_json()
    return {"balanced": report.balanced and report.users_not_audited == 0,
            "users": report.users_audited, "not_audited": report.users_not_audited,
            "divergences": body.get("divergences", []), "notes": body.get("notes", [])}


def _count(items: Any) -> dict[str, int]:
    from collections import Counter

    return dict(Counter(items).most_common())



def table(result: dict[str, Any]) -> str:
    cfg, inv = result["config"], result["invariants"]
    ov, led, dl = result["overspend"], result["ledger"], result["deadlines"]
    rows = [f"Fleet: {cfg['processes']} processes, {cfg['users']} users, {cfg['duration_s']:g} s,"
            f" {cfg['topology']}, budget {cfg['budget']}, providers "
            + ", ".join(f"{k} {v}" for k, v in cfg["providers"].items())
            + f", search concurrency {cfg['search_concurrency']}, Lambda timeout "
            f"{cfg['lambda_timeout_s']:g} s, upstream failure rate {cfg['failure_rate']:.0%}",
            f"Invocations: {result['invocations']}  by status: {result['status']}",
            "Keyed requests answered 503 and retried from another environment, by status of "
            f"the retry: {result['client_retries'] or 'none'}", "",
            "| invariant | result | detail |", "|---|---|---|"]

    def mark(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    rows.append(f"| 1. no user over budget in any window | {mark(inv['no_overspend'])} | "
                f"violations {len(ov['violations'])}, running totals wrong "
                f"{len(ov['running_totals_wrong'])}, peak {ov['peak_fraction_of_limit']:.0%} "
                f"of a limit |")
    rows.append(f"| 2. ledger = cost of successful work | {mark(inv['ledger_equals_work'])} | "
                f"{led['ledger_events']} charges / {led['ledger_tokens']} tokens vs expected "
                f"{led['expected_events']} / {led['expected_tokens']}; charged for failed "
                f"{len(led['charged_for_failed'])}, missing {len(led['missing_charges'])}, "
                f"wrong cost {len(led['wrong_cost'])}, twice {len(led['charged_twice'])}, "
                f"killed in flight kept {led['killed_in_flight_kept']}; environments "
                f"ended without draining {led['ended_without_drain'] or 'none'}; refunds lost to a "
                f"Redis fault {len(led['refund_lost_to_redis_fault'])} "
                f"({sum(x['cost'] for x in led['refund_lost_to_redis_fault'])} tokens) |")
    prov = "; ".join(f"{f} max {p['max_in_window']}/{p['limit']:g} per {p['per_s']:g}s, "
                     f"{p['arrivals']} calls, emulator 429 {p['emulator_429']} "
                     f"(own {p['emulator_own_429']})" for f, p in result["providers"].items())
    rows.append(f"| 3. no provider over its limit | {mark(inv['providers_within_limit'])} | "
                f"{prov} |")
    rows.append(f"| 4. no invocation past its deadline | {mark(inv['deadlines_kept'])} | "
                f"late {dl['late']}, smallest margin {dl['worst_margin_s']:.3f} s |")
    cr = result.get("credit")
    if cr is not None:
        ops = _count(f"{e['change']} {e['outcome']}" for e in cr["operator"])
        retried = sum(e["tries"] - 1 for e in cr["operator"])
        rows.append(
            f"| 5. credit conserved exactly | {mark(inv['credit_conserved'])} | "
            f"{cr['granted']} granted, {cr['drawn']} drawn by {cr['charges_that_drew']} "
            f"charges, {cr['returned']} returned, {cr['consumed']} consumed = "
            f"{cr['spent_by_successful']} held by {cr['drawn_requests']} successful requests "
            f"+ {cr['forfeited']} forfeited to a void; {cr['remaining']} spendable "
            f"({cr['killed_draws_on_the_way']} drawn by killed requests still on their way), "
            f"copy differs for {len(cr['copy_differs'])} users; grants off their records "
            f"{len(cr['grants_wrong'])}, users consumed != spent "
            f"{len(cr['consumed_not_spent'])}, failed requests holding credit "
            f"{len(cr['failed_holding_credit'])}, draws Redis != DynamoDB "
            f"{len(cr['draws_differ'])}; {cr['records']} charge records, "
            f"{cr['support_refunds']} support refunds, {cr['voided_grants']} voids; served "
            f"while suspended {len(cr['served_while_suspended'])}; kept refunds undrained "
            f"{cr['undrained']}; operator changes: "
            + ", ".join(f"{k} {v}" for k, v in ops.items())
            + f" ({retried} repeats after a 503) |")
    books = result.get("books")
    if books is not None:
        kinds = _count(d.get("kind", "?") for d in books["divergences"])
        rows.append(f"| 6. the auditor finds the books balanced | "
                    f"{mark(inv['books_balance'])} | {books['users']} users audited, "
                    f"{books['not_audited']} not; "
                    f"divergences {len(books['divergences'])}"
                    + (" (" + ", ".join(f"{k} {v}" for k, v in kinds.items()) + ")"
                       if kinds else "")
                    + f"; notes {len(books['notes'])} |")
    hv = result.get("heavy")
    if hv is not None:
        busy = "; ".join(f"{u} " + ", ".join(f"{p} {n}" for p, n in c.items())
                         for u, c in hv["provider_busy_by_user"].items()) or "none"
        excused = ", ".join(f"{k} {v}" for k, v in hv["excused_by_fault"].items()) or "none"
        rows.append(
            f"| 7. a heavy user refuses no one else {hv['provider']} slots | "
            f"{mark(inv['heavy_user_starves_no_one'])} | {cfg['heavy_processes']} processes x "
            f"{cfg['heavy_in_flight']} requests in flight of {hv['heavy_user']}; the "
            f"provider at {hv['used_share']:.0%} of its limit "
            f"over the run, saturated (90% or more of its limit) {hv['saturated_s']} of "
            f"{hv['seconds']} s; {hv['heavy_calls']} {hv['provider']} calls, wait p50 "
            f"{hv['heavy_wait_p50_ms']} / p95 {hv['heavy_wait_p95_ms']} ms; the other users' "
            f"{hv['light_calls']} calls: wait p50 {hv['light_wait_p50_ms']} / p95 "
            f"{hv['light_wait_p95_ms']} ms ({hv['light_calls_clear']} outside the 429 pause "
            f"and Redis fault windows: p95 {hv['light_wait_p95_clear_ms']} ms); other users "
            f"refused provider_busy by "
            f"{hv['provider']} outside the 429 pause and Redis fault windows: "
            f"{len(hv['starved'])} (inside them, not counted: {excused}); provider_busy by "
            f"user: {busy} |")
    if result["faults"]:
        rows += ["", "| fault | at (s) | lasted (s) | invocations | errors returned | "
                 "recovered after (s) | note |", "|---|---|---|---|---|---|---|"]
        t0 = min(f["start"] for f in result["faults"])
        for f in result["faults"]:
            errors = ", ".join(f"{k} {v}" for k, v in f["errors"].items()) or "none"
            note = f.get("note", "")
            if f.get("slot_back_after_kill_s") is not None:
                note += (f"; leaked slot back {f['slot_back_after_kill_s']:.2f} s after the "
                         f"kill (lease_s {f['lease_s']:g})")
            rec = "-" if f["recover_s"] is None else f"{f['recover_s']:.3f}"
            rows.append(f"| {f['fault']} | {f['start'] - t0:.1f} | {f['end'] - f['start']:.2f} "
                        f"| {f['invocations']} | {errors} | {rec} | {note} |")
    rows += ["", "| route | n | 2xx | replayed | p50 ms | p90 ms | p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for route, r in result["routes"].items():
        errors = ", ".join(f"{k} {v}" for k, v in r["codes"].items()) or "-"
        rows.append(f"| {route} | {r['n']} | {r['ok']} | {r['replayed']} | {r['p50_ms']} | "
                    f"{r['p90_ms']} | {r['p99_ms']} | {errors} |")
    total = result["invocations"] or 1
    rows.insert(2, f"503 share: {result['status'].get('503', 0) / total:.1%}")
    rows += ["", f"ALL INVARIANTS {'HOLD' if result['ok'] else 'BROKEN'}"]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = table(result)
    Path(args.out, "table.md").write_text(text + "\n")
    print(text)
    if not result["ok"]:
        print(json.dumps({k: result[k] for k in ("overspend", "ledger", "providers",
                                                 "deadlines", "credit")},
                         indent=1, default=str)[:8000])
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
