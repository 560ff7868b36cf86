"""The fleet's invariants, checked from Redis, the emulator's own counters and the records.

1. overspend: for every user and every window (W s, L tokens) of the plan, the charges in
   the ledger (``ul:{u:<user>}:log`` scores, costs from ``:ev``) never sum to more than L
   within any half-open interval (t - W, t]. It suffices to test t = each charge's time.
   The ledger's running totals (``:meta`` t:W) must also equal the log's events after the
   window's cursor (lo:W): a double-counted retry would show there. A user with credit is
   checked against their own plan, and the plan's longest window (the included quota)
   counts only what the quota covered: cost less the credit the charge drew (``:dr``);
   the running total of drawn credit (d:W) must equal the log's too.
2. ledger == work: the ledger holds exactly the request ids that got a 2xx answer that was
   not a replay, each at its settled cost (company_research 5 without sources,
   market_context 2 without data, else the route's price), less those an operator
   refunded through support. Nothing else: no charge for a 4xx/5xx, none for a replay. A
   request id answered 2xx twice without a replay would be a double charge. Requests of a
   process killed mid-flight (no answer recorded) may keep their charge: a dead Lambda runs
   no refund (DESIGN: anything left expires on its own).
3. provider limit: the emulator's arrival times per family: at most ``rate`` arrivals in
   any half-open window of ``per_s`` seconds; also the emulator's own 429s not injected.
4. deadline: every answered invocation took at most its Lambda timeout.
5. credit conserved exactly (runs with DynamoDB): see ``_fleet_credit``.
7. heavy user (runs with one): while one user keeps the LLM provider saturated, no request
   of another user is refused 503 ``provider_busy`` by the LLM provider, outside the
   windows of the faults that refuse for reasons of their own (``NOT_THE_HEAVY_USER``):
   an upstream 429's shared pause, and Redis down, slow or refusing writes. A request
   counts as in such a window when it overlaps [fault start, fault end +
   ``FAULT_AFTER_S``].
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from usage_limits.budget import meta_fields
from usage_limits.keys import user_keys


def load_records(lines: Iterable[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(answered invocations, invocations started but never answered)."""
    import json

    starts: dict[tuple[str, str, float], dict[str, Any]] = {}
    ends: list[dict[str, Any]] = []
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec["kind"] not in ("start", "end"):
            continue  # a process's own note (what it left undrained)
        ident = (rec["w"], rec["rid"], rec["t0"])
        if rec["kind"] == "start":
            starts[ident] = rec
        else:
            starts.pop(ident, None)
            ends.append(rec)
    return ends, list(starts.values())


def read_ledger(client: Any, users: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Per user: ``events`` {rid: (ms, cost)}, ``meta`` {field: int} and ``draws``
    {rid: credit drawn} (entitlements only)."""
    out = {}
    for user in users:
        log_key, ev_key, meta_key, dr_key = user_keys(user, "log", "ev", "meta", "dr")
        scores = client.zrange(log_key, 0, -1, withscores=True)
        ev = client.hgetall(ev_key)
        meta, odd = {}, {}
        packed = client.hget(meta_key, "m")
        if packed is not None:
            try:
                meta = meta_fields(packed)
            except ValueError:
                odd["m"] = packed.decode(errors="replace")  # reported as malformed
        events = {}
        for member, score in scores:
            rec = ev.get(member)
            cost = int(rec.split(b" ", 1)[0]) if rec else 0
            events[member.decode()] = (int(score), cost)
        draws = {rid.decode(): sum(int(part.rsplit(b"=", 1)[1])
                                   for part in rec.split(b" ")[1:] if b"=" in part)
                 for rid, rec in client.hgetall(dr_key).items()}
        out[user] = {"events": events, "meta": meta, "malformed_meta": odd, "draws": draws}
    return out


def max_window_sum(points: list[tuple[int, int]], window_ms: int) -> int:
    """Largest sum of costs within any (t - W, t] over (ms, cost) points."""
    points = sorted(points)
    best = total = lo = 0
    for hi, (t, cost) in enumerate(points):
        total += cost
        while points[lo][0] <= t - window_ms:
            total -= points[lo][1]
            lo += 1
        best = max(best, total)
        del hi
    return best


def check_overspend(ledger: dict[str, dict[str, Any]], plan: tuple[tuple[int, int], ...],
                    plans: dict[str, tuple[tuple[int, int], ...]] | None = None,
                    ) -> dict[str, Any]:
    """Invariant 1; ``plans`` gives the users whose plan is not ``plan`` theirs."""
    violations, totals_bad, peak = [], [], 0.0
    for user, data in ledger.items():
        drawn = data.get("draws", {})
        user_plan = (plans or {}).get(user, plan)
        quota_s = max(s for _, s in user_plan)
        for limit, seconds in user_plan:
            if seconds == quota_s:  # the quota counts what credit did not pay
                points = [(ms, cost - drawn.get(rid, 0))
                          for rid, (ms, cost) in data["events"].items()]
            else:
                points = list(data["events"].values())
            worst = max_window_sum(points, seconds * 1000) if points else 0
            peak = max(peak, worst / limit)
            if worst > limit:
                violations.append({"user": user, "window_s": seconds, "limit": limit,
                                   "max_sum": worst})
            meta = data["meta"]
            if data.get("malformed_meta"):
                totals_bad.append({"user": user, "malformed_meta": data["malformed_meta"]})
            w = seconds * 1000
            if f"t:{w}" in meta and f"lo:{w}" in meta:
                lo = meta[f"lo:{w}"]
                counted = sum(c for ms, c in data["events"].values() if ms > lo)
                if counted != meta[f"t:{w}"]:
                    totals_bad.append({"user": user, "window_s": seconds,
                                       "running_total": meta[f"t:{w}"], "log_sum": counted})
                credit = sum(drawn.get(rid, 0) for rid, (ms, _) in data["events"].items()
                             if ms > lo)
                if drawn and meta.get(f"d:{w}", 0) != credit:
                    totals_bad.append({"user": user, "window_s": seconds,
                                       "running_drawn": meta.get(f"d:{w}"),
                                       "log_drawn": credit})
    return {"violations": violations, "running_totals_wrong": totals_bad,
            "peak_fraction_of_limit": round(peak, 3)}


def check_ledger(ledger: dict[str, dict[str, Any]], ends: list[dict[str, Any]],
                 in_flight: list[dict[str, Any]],
                 redis_down: list[tuple[float, float]] = (),
                 refunded: dict[str, set[str]] | None = None) -> dict[str, Any]:
    """Invariant 2. A failed request whose refund fell into a Redis fault window (``redis_down``:
    the refund needs Redis) is listed apart, as ``refund_lost_to_redis_fault``; a charge an
    operator refunded (``refunded``: user -> ledger ids) is expected gone."""
    expected: dict[tuple[str, str], int] = {}
    twice: list[tuple[str, str]] = []
    for rec in ends:
        if rec["rid"] in (refunded or {}).get(rec["user"], ()):
            continue
        if rec["charged"] > 0:
            ident = (rec["user"], rec["rid"])
            if ident in expected:
                twice.append(ident)
            expected[ident] = rec["charged"]
    killed = {(r["user"], r["rid"]) for r in in_flight}
    failed_by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in ends:
        if r["status"] >= 400 or r["status"] == 0:
            failed_by[(r["user"], r["rid"])].append(r)
    found = {(u, rid): cost for u, d in ledger.items() for rid, (_, cost) in d["events"].items()}
    extra, missing, wrong, lost, kept_killed = [], [], [], [], 0
    for ident, cost in found.items():
        if ident in expected:
            if cost != expected[ident]:
                wrong.append({"user": ident[0], "rid": ident[1], "ledger": cost,
                              "expected": expected[ident]})
        elif ident in killed:
            kept_killed += 1
        else:
            recs = failed_by.get(ident, [])
            hit = [r for r in recs if any(a - 0.1 <= r["t1"] and r["t0"] <= b + 0.6
                                          for a, b in redis_down)]
            rec = hit[0] if hit else (recs[-1] if recs else None)
            if hit:
                lost.append({"user": ident[0], "rid": ident[1], "cost": cost,
                             "status": rec["status"], "code": rec["code"]})
                continue
            extra.append({"user": ident[0], "rid": ident[1], "cost": cost,
                          "status": rec and rec["status"], "code": rec and rec["code"],
                          "t0": rec and rec["t0"]})
    for ident, cost in expected.items():
        if ident not in found:
            missing.append({"user": ident[0], "rid": ident[1], "expected": cost})
    return {"charged_for_failed": extra, "refund_lost_to_redis_fault": lost,
            "missing_charges": missing, "wrong_cost": wrong,
            "charged_twice": [list(t) for t in twice], "killed_in_flight_kept": kept_killed,
            "ledger_events": len(found), "expected_events": len(expected),
            "ledger_tokens": sum(found.values()), "expected_tokens": sum(expected.values())}


def max_in_window(times: list[float], window_s: float) -> int:
    """Most timestamps in any half-open window [t, t + window_s)."""
    ordered = sorted(times)
    best = lo = 0
    for hi, t in enumerate(ordered):
        while ordered[lo] <= t - window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def check_providers(stats: dict[str, Any], limits: dict[str, tuple[float, float]],
                    injected_429: dict[str, int]) -> dict[str, Any]:
    out = {}
    for family, (rate, per_s) in limits.items():
        fam = stats["families"][family]
        times = fam.get("arrival_times") or []
        worst = max_in_window(times, per_s)
        ordered = sorted(times)
        over_at = [round(t, 3) for i, t in enumerate(ordered)
                   if sum(1 for u in ordered[i:i + int(rate) + 1] if u < t + per_s) > rate][:5]
        own_429 = fam["rate_limited"] - injected_429.get(family, 0)
        out[family] = {"limit": rate, "per_s": per_s, "arrivals": fam["arrivals"],
                       "max_in_window": worst, "over": worst > rate,
                       "emulator_429": fam["rate_limited"], "emulator_own_429": own_429,
                       "max_in_flight": fam["max_in_flight"], "over_at": over_at}
    return out


def check_deadlines(ends: list[dict[str, Any]]) -> dict[str, Any]:
    late = [r for r in ends if r["t1"] - r["t0"] > r["timeout"]]
    worst = max((r["t1"] - r["t0"] - r["timeout"] for r in ends), default=0.0)
    return {"late": len(late), "worst_margin_s": round(-worst, 3),
            "examples": [{k: r[k] for k in ("route", "status", "code")}
                         | {"took_s": round(r["t1"] - r["t0"], 3)} for r in late[:5]]}


def fault_costs(faults: list[dict[str, Any]], ends: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fault: errors by code among invocations that overlapped it, and recovery time
    (first 2xx answer after the fault ended, measured from its end)."""
    out = []
    for fault in faults:
        start, end = fault["start"], fault["end"]
        during = [r for r in ends if r["t1"] >= start and r["t0"] <= end + 0.25]
        codes = Counter(r["code"] or str(r["status"]) for r in during if r["status"] >= 400
                        or r["status"] == 0)
        ok_after = [r["t1"] for r in ends if 200 <= r["status"] < 300 and r["t1"] >= end
                    and r["t0"] >= start and r["route"] != "usage"]
        out.append({**fault, "invocations": len(during), "errors": dict(codes.most_common()),
                    "recover_s": round(min(ok_after) - end, 3) if ok_after else None})
    return out


def summary_by_route(ends: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in ends:
        by[rec["route"]].append(rec)
    out = {}
    for route, recs in sorted(by.items()):
        ok = sorted(r["t1"] - r["t0"] for r in recs if 200 <= r["status"] < 300)
        out[route] = {"n": len(recs), "ok": len(ok),
                      "codes": dict(Counter(r["code"] for r in recs if r["code"]).most_common()),
                      "replayed": sum(r["replayed"] for r in recs),
                      "p50_ms": _pct(ok, 50), "p90_ms": _pct(ok, 90), "p99_ms": _pct(ok, 99)}
    return out


def _pct(sorted_s: list[float], p: int) -> float | None:
    if not sorted_s:
        return None
    if len(sorted_s) == 1:
        return round(sorted_s[0] * 1000, 1)
    return round(statistics.quantiles(sorted_s, n=100, method="inclusive")[p - 1] * 1000, 1)


#: Faults that refuse requests ``provider_busy`` (or hold their slots) for reasons that are not
#: the heavy user: the pause every instance keeps after an upstream 429, and Redis down,
#: stalled or refusing writes (a throttle script that cannot run fails its request).
NOT_THE_HEAVY_USER = ("upstream-429", "redis-restart", "redis-slow", "ledger-refused",
                      "failover")
#: How long after a fault's end its effect may still refuse: the 429 pause (Retry-After 1 s)
#: and the wait of a request that queued behind it.
FAULT_AFTER_S = 2.0


def check_heavy_user(ends: list[dict[str, Any]], heavy: str, faults: list[dict[str, Any]],
                     provider: str = "llm") -> dict[str, Any]:
    """Invariant 7: per user, ``provider_busy`` answers by provider; the other users' refusals
    by ``provider`` outside the excused fault windows (``starved``, must be empty); the
    p50/p95 wait for ``provider``'s slots of the heavy user's and the others' calls, and the
    others' p95 outside the excused windows (``_clear``)."""
    excused = [(f["start"], f["end"] + FAULT_AFTER_S, f["fault"]) for f in faults
               if f["fault"] in NOT_THE_HEAVY_USER]
    busy: dict[str, Counter[str]] = defaultdict(Counter)
    starved, during_faults = [], Counter[str]()
    for r in ends:
        if r["code"] != "provider_busy":
            continue
        busy[r["user"]][r.get("provider") or "?"] += 1
        if r["user"] == heavy or r.get("provider") != provider:
            continue
        hit = [name for a, b, name in excused if r["t0"] <= b and r["t1"] >= a]
        if hit:
            during_faults[hit[0]] += 1
        else:
            starved.append({k: r[k] for k in ("user", "route", "t0", "t1")})

    def waits(mine: bool, clear: bool = False) -> list[float]:
        return sorted(r["wait_ms"][provider] / 1000 for r in ends
                      if (r["user"] == heavy) == mine and provider in r.get("wait_ms", {})
                      and not (clear and any(r["t0"] <= b and r["t1"] >= a
                                             for a, b, _ in excused)))

    heavy_w, light_w, light_clear = waits(True), waits(False), waits(False, clear=True)
    return {"heavy_user": heavy, "provider": provider,
            "provider_busy_by_user": {u: dict(c) for u, c in sorted(busy.items())},
            "starved": starved, "excused_by_fault": dict(during_faults),
            "heavy_calls": len(heavy_w), "light_calls": len(light_w),
            "heavy_wait_p50_ms": _pct(heavy_w, 50), "heavy_wait_p95_ms": _pct(heavy_w, 95),
            "light_wait_p50_ms": _pct(light_w, 50), "light_wait_p95_ms": _pct(light_w, 95),
            "light_calls_clear": len(light_clear),
            "light_wait_p95_clear_ms": _pct(light_clear, 95)}


def saturation(times: list[float], limit: tuple[float, float]) -> dict[str, Any]:
    """How busy a provider was: calls over the limit's capacity from its first call to its
    last (``used_share``), and in how many whole seconds of that it got 90% or more of its
    limit (``saturated_s`` of ``seconds``)."""
    if not times:
        return {"used_share": 0.0, "saturated_s": 0, "seconds": 0}
    rate, per_s = limit
    per_second = rate / per_s
    first, last = min(times), max(times)
    seconds = max(1, int(last - first))
    counts = Counter(int(t - first) for t in times if t - first < seconds)
    return {"used_share": round(len(times) / (per_second * max(last - first, 1.0)), 3),
            "saturated_s": sum(1 for n in counts.values() if n >= 0.9 * per_second),
            "seconds": seconds}
