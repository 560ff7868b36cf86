"""Paid credit in the fleet: grant users, operator changes mid-run, and the credit check.

A share of the users (``GRANT_SHARE``, the busiest) is put on the plan
``credit`` (the default plan's shorter window, a quota small enough that credit pays) and
given a small paid grant before traffic starts, through the operator's own code path
(``entitlements.operator.Operator``, what the admin function runs). While traffic runs, a
thread makes operator changes at fixed points of the run (``CHANGES``): a second grant, a
plan change to ``credit2`` (the same windows under another name: every change reloads the
user's copy) and back, a suspension lifted a second later, a void, support refunds of
recent charges. Each is repeated until it answers, as an operator repeats an idempotent
call that got a 503 (DynamoDB faults land on the operator's calls too).

The check (``check_credit``), after the in-flight requests ended and every kept refund was
drained: for every grant, ``0 <= consumed <= tokens`` (``tokens = remaining + consumed``)
and ``consumed`` = the sum of the standing draws of its ``C#`` charge records (what they
drew less what came back); the credit DynamoDB holds consumed equals the credit the
successful requests (from the invocation records, not replays, not support-refunded) still
hold, plus what was forfeited to a void; no failed request holds credit; each successful
charge's draws in DynamoDB equal the ledger's (Redis) draws of it; and what the Redis copy
lets each user spend equals what DynamoDB says (remaining of the live grants), less the
draws of requests killed mid-flight that no charge record holds: the copy draws before
DynamoDB records, and a dead Lambda's draw stays on the copy until its hold ends and the
user's next request claims it (the auditor's "draws on their way").
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from typing import Any

#: This share of the users gets a grant: the first ones, the busiest.
GRANT_SHARE = 1 / 3
#: The operator's actor name in the audit log.
ACTOR = "fleet-operator"
#: Operator changes: (fraction of the run, action, index into the grant users).
CHANGES: list[tuple[float, str, int]] = [
    (0.12, "grant", 0), (0.22, "plan", 1), (0.3, "refund", 0), (0.38, "suspend", 2),
    (0.5, "void", 1), (0.58, "refund", 0), (0.68, "plan-back", 1), (0.78, "grant", 1),
    (0.86, "refund", 3),
]
#: How many times an operator repeats a change that got a 503 (it is idempotent).
OPERATOR_TRIES = 20
#: How long a suspension lasts before it is lifted, s.
SUSPEND_S = 1.0


def grant_users(users: list[str]) -> list[str]:
    """The users that get credit."""
    return users[:max(1, round(len(users) * GRANT_SHARE))]


def plans_env(budget: str, quota: int) -> dict[str, str]:
    """``ATTO_PLANS``: ``base`` (the budget), ``credit`` and ``credit2`` (its shorter window,
    a quota of ``quota`` tokens in its longest window), and ``heavy`` (the budget's windows
    with room for ten thousand times their tokens: the heavy user's budget never binds, so
    what holds it back is the provider's rate)."""
    windows = budget.split(",")
    long_s = windows[-1].split("/")[1]
    credit = ",".join([*windows[:-1], f"{quota}/{long_s}"])
    heavy = ",".join(f"{int(w.split('/')[0]) * 10_000}/{w.split('/')[1]}" for w in windows)
    return {"ATTO_PLANS": f"base={budget};credit={credit};credit2={credit};heavy={heavy}",
            "ATTO_DEFAULT_PLAN": "base"}


#: How long the settle after the run may take per user, s (the local DynamoDB, busy).
SETTLE_S = 10.0


class CreditOperator:
    """The operator of the run: grants before traffic, changes during it, in a thread with
    its own event loop, through ``Operator`` against the fleet's Redis and DynamoDB."""

    def __init__(self, env: dict[str, str], users: list[str], grant_tokens: int) -> None:
        self.env = env
        self.users = grant_users(users)
        self.grant_tokens = grant_tokens
        self.log: list[dict[str, Any]] = []  # every change: what, when, outcome
        self.refunded: dict[str, set[str]] = defaultdict(set)  # user -> ledger rids
        self.suspensions: list[tuple[str, float, float]] = []  # user, answered, lift began
        self._thread: threading.Thread | None = None
        self._loop = asyncio.new_event_loop()
        self._operator: Any = None
        self._redis: Any = None

    # -- plumbing ------------------------------------------------------------------------
    def _make(self) -> Any:
        import os

        from usage_limits.budget import TokenBudget, Window
        from usage_limits.connection import redis_from_env
        from usage_limits.entitlements.cache import EntitlementCache
        from usage_limits.entitlements.config import StoreSettings
        from usage_limits.entitlements.operator import Operator
        from usage_limits.entitlements.store import EntitlementStore
        from usage_limits.entitlements.usage_store import UsageSettings, UsageStore
        from usage_limits.web.settings import parse_plans

        plans = parse_plans(self.env)
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            os.environ.setdefault(key, self.env[key])
        self._redis = redis_from_env(self.env)
        windows = [Window(limit, s) for limit, s in plans.default_plan.windows]
        budget = TokenBudget(self._redis, windows, entitlements=True, catalog={
            p.name: [Window(limit, s) for limit, s in p.windows]
            for p in plans.by_name.values()})
        store = EntitlementStore(StoreSettings.from_env(self.env))
        # as the admin function: a support refund marks the charge's usage record too
        usage = UsageStore(UsageSettings.from_env(self.env)) \
            if self.env.get("ATTO_USAGE_TABLE") else None
        return Operator(store, plans, budget, EntitlementCache(store), usage=usage)

    @property
    def store(self) -> Any:
        """The operator's ``EntitlementStore`` (after ``setup``)."""
        return self._operator.store

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the operator's loop (from the thread that owns it)."""
        return self._loop.run_until_complete(coro)

    async def _repeat(self, what: str, user: str, fn: Any, *args: Any,
                      **kwargs: Any) -> Any:
        """Call ``fn`` until it answers (up to OPERATOR_TRIES): a 503 (StoreUnavailable,
        NotRefreshed, LimiterUnavailable) is repeated, as the CLI's user would."""
        from usage_limits.entitlements import NotFound
        from usage_limits.entitlements.exceptions import NotRefreshed, StoreUnavailable
        from usage_limits.exceptions import LimiterUnavailable

        entry: dict[str, Any] = {"change": what, "user": user, "start": time.time(),
                                 "tries": 0, "errors": []}
        self.log.append(entry)
        for _ in range(OPERATOR_TRIES):
            entry["tries"] += 1
            try:
                result = await fn(*args, **kwargs)
            except (StoreUnavailable, NotRefreshed, LimiterUnavailable) as exc:
                entry["errors"].append(type(exc).__name__)
                await asyncio.sleep(0.3)
                continue
            except NotFound:
                entry.update(outcome="not_found", end=time.time())
                return None
            entry.update(outcome="done", end=time.time())
            return result
        entry.update(outcome="gave_up", end=time.time())
        return None

    # -- before traffic ------------------------------------------------------------------
    def setup(self) -> None:
        """Put every grant user on ``credit`` and give each a paid grant."""
        self._operator = self._make()
        op = self._operator
        for user in self.users:
            self.run(self._repeat("setup plan", user, op.set_plan, user, "credit",
                                  actor=ACTOR, reason="fleet: small quota"))
            self.run(self._repeat("setup grant", user, op.create_grant, user,
                                  tokens=self.grant_tokens, kind="paid",
                                  reference=f"inv-{user}-0", expires_at_ms=None,
                                  actor=ACTOR, reason="fleet: top-up"))

    def set_plan(self, user: str, plan: str) -> None:
        """Put ``user`` on ``plan`` before traffic (the heavy user on ``heavy``)."""
        self.run(self._repeat("setup plan", user, self._operator.set_plan, user, plan,
                              actor=ACTOR, reason=f"fleet: plan {plan}"))

    # -- during traffic ------------------------------------------------------------------
    def start(self, t_start: float, duration: float) -> None:
        """Make the changes of ``CHANGES`` at their points of the run, in a thread."""
        self._thread = threading.Thread(target=self._changes, args=(t_start, duration),
                                        name="fleet-operator", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _changes(self, t_start: float, duration: float) -> None:
        asyncio.set_event_loop(self._loop)
        for n, (at, action, index) in enumerate(CHANGES):
            time.sleep(max(0.0, t_start + at * duration - time.time()))
            user = self.users[index % len(self.users)]
            self.run(self._change(n, action, user))

    async def _change(self, n: int, action: str, user: str) -> None:
        op = self._operator
        if action == "grant":
            await self._repeat("grant", user, op.create_grant, user, tokens=self.grant_tokens,
                               kind="paid", reference=f"inv-{user}-c{n}", expires_at_ms=None,
                               actor=ACTOR, reason="fleet: another top-up")
        elif action in ("plan", "plan-back"):
            plan = "credit2" if action == "plan" else "credit"
            await self._repeat("plan", user, op.set_plan, user, plan, actor=ACTOR,
                               reason="fleet: plan change")
        elif action == "void":
            await self._repeat("void", user, op.void_grant, user, f"inv-{user}-0",
                               actor=ACTOR, reason="fleet: chargeback")
        elif action == "suspend":
            await self._repeat("suspend", user, op.suspend, user, reason="fleet: review",
                               until_ms=None, actor=ACTOR)
            answered = time.time()
            await asyncio.sleep(SUSPEND_S)
            lifting = time.time()
            await self._repeat("lift", user, op.lift_suspension, user, actor=ACTOR,
                               reason="fleet: cleared")
            self.suspensions.append((user, answered, lifting))
        elif action == "refund":
            for rid in await self._recent_credit_charges(user, 1):
                done = await self._repeat("refund", user, op.refund, user, rid, actor=ACTOR,
                                          reason="fleet: support refund")
                if done is not None:
                    self.refunded[user].add(done[0].request_id)

    async def _recent_credit_charges(self, user: str, n: int) -> list[str]:
        """The ledger ids of the user's ``n`` latest charges that drew credit (else any)."""
        from usage_limits.keys import user_keys

        log_key, dr_key = user_keys(user, "log", "dr")
        try:
            recent = [m.decode() for m in await self._redis.zrange(log_key, -20, -1)]
            drew = {m.decode() for m in await self._redis.hkeys(dr_key)}
        except Exception:  # noqa: BLE001 - Redis may be under a fault now: no refund then
            return []
        chosen = [rid for rid in reversed(recent) if rid in drew] or list(reversed(recent))
        return chosen[:n]

    def close(self) -> None:
        if self._redis is not None:
            self.run(self._redis.aclose())
        self._loop.close()

    # -- after traffic -------------------------------------------------------------------
    def settle(self, users: list[str]) -> dict[str, int]:
        """Undo every user's provisional charges whose hold has ended, as the user's next
        request would (``web.holds.undo``): what a killed process or a lost refund left for
        that request. Call it once every hold of the run has ended. Returns user -> how many
        charges were undone."""
        from usage_limits.web import holds

        op = self._operator
        undone: dict[str, int] = {}
        for user in users:
            ids = self.run(holds.undo(op.budget, op.cache, user, within_s=SETTLE_S))
            if ids:
                undone[user] = len(ids)
        return undone

    def copy_credit(self, user: str) -> tuple[int, dict[str, str]]:
        """The credit the user's Redis copy lets them spend (loaded from DynamoDB when the
        copy is gone, as the next request would), and the copy's raw fields as found."""
        from usage_limits.keys import user_keys

        op = self._operator
        [ent_key] = user_keys(user, "ent")
        raw = {k.decode(): v.decode() for k, v in self.run(self._redis.hgetall(ent_key)).items()}
        report = self.run(op.cache.usage(op.budget, user, plan_name="credit"))
        return sum(g.remaining for g in report.grants), raw


def check_credit(operator: CreditOperator, ends: list[dict[str, Any]],
                 in_flight: list[dict[str, Any]],
                 ledger: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The credit invariant (module docstring), per grant user, from DynamoDB, the Redis
    ledger and copy, and the invocation records."""
    store = operator.store
    ok_rids: dict[str, set[str]] = defaultdict(set)
    failed_rids: dict[str, set[str]] = defaultdict(set)
    for r in ends:
        if 200 <= r["status"] < 300 and not r["replayed"]:
            ok_rids[r["user"]].add(r["rid"])
        elif r["status"] >= 400 or r["status"] == 0:
            failed_rids[r["user"]].add(r["rid"])
    killed = {(r["user"], r["rid"]) for r in in_flight}
    grants_bad, records_bad, failed_holding, draws_differ = [], [], [], []
    copy_differs, served_suspended = [], []
    totals = {"granted": 0, "consumed": 0, "spent_by_successful": 0, "forfeited": 0,
              "returned": 0, "records": 0, "drawn_requests": 0, "remaining": 0,
              "charges_that_drew": 0, "drawn": 0, "killed_draws_on_the_way": 0,
              "support_refunds": sum(len(v) for v in operator.refunded.values()),
              "voided_grants": 0}
    for user in operator.users:
        record = store.load(user)
        charges = store.charge_records(user)
        held: dict[str, int] = defaultdict(int)
        spent = forfeited = 0
        recorded = {c.request_id for c in charges if c.draws}
        on_the_way = sum(n for (u, rid) in killed if u == user and rid not in recorded
                         for n in [ledger.get(user, {}).get("draws", {}).get(rid, 0)])
        totals["killed_draws_on_the_way"] += on_the_way
        for c in charges:
            totals["records"] += 1
            totals["charges_that_drew"] += bool(c.draws)
            totals["drawn"] += sum(n for _, n in c.draws)
            for ref, n in c.consumed.items():
                held[ref] += n
            standing = sum(n for _, n in c.standing)
            lost = sum(n for _, n in c.forfeited)
            forfeited += lost
            totals["returned"] += sum(n for _, n in c.returned)
            rid = c.request_id
            served = rid in ok_rids[user] and rid not in operator.refunded[user]
            if standing and served:
                spent += standing
                totals["drawn_requests"] += 1
                redis_draws = ledger.get(user, {}).get("draws", {}).get(rid)
                if redis_draws is not None and redis_draws != standing + lost:
                    draws_differ.append({"user": user, "rid": rid, "dynamodb": standing,
                                         "forfeited": lost, "redis": redis_draws})
            elif standing and (user, rid) not in killed:
                failed_holding.append({"user": user, "rid": rid, "standing": standing,
                                       "failed": rid in failed_rids[user],
                                       "support_refunded": rid in operator.refunded[user],
                                       "state": c.state})
        consumed = 0
        spendable = 0
        for g in record.grants:
            totals["granted"] += g.tokens
            consumed += g.consumed
            if g.voided is not None:
                totals["voided_grants"] += 1
            else:
                spendable += g.tokens - g.consumed
            if not 0 <= g.consumed <= g.tokens or g.consumed != held.get(g.reference, 0):
                grants_bad.append({"user": user, "grant": g.reference, "tokens": g.tokens,
                                   "consumed": g.consumed,
                                   "records_hold": held.get(g.reference, 0)})
        if consumed != spent + forfeited + sum(
                sum(n for _, n in c.standing) for c in charges
                if (user, c.request_id) in killed):
            records_bad.append({"user": user, "dynamodb_consumed": consumed,
                                "spent_by_successful": spent, "forfeited": forfeited})
        totals["consumed"] += consumed
        totals["spent_by_successful"] += spent
        totals["forfeited"] += forfeited
        totals["remaining"] += spendable
        seen, raw = operator.copy_credit(user)
        if seen != spendable - on_the_way:
            copy_differs.append({"user": user, "copy": seen, "dynamodb": spendable,
                                 "killed_draws_on_the_way": on_the_way,
                                 "copy_fields": raw, "grants": [
                                     (g.reference, g.tokens, g.consumed, g.voided is not None)
                                     for g in record.grants]})
    for user, answered, lifting in operator.suspensions:
        served_suspended += [{"user": user, "rid": r["rid"], "t0": r["t0"]} for r in ends
                             if r["user"] == user and 200 <= r["status"] < 300
                             and r["t0"] > answered and r["t1"] < lifting]
    return {"grants_wrong": grants_bad, "consumed_not_spent": records_bad,
            "failed_holding_credit": failed_holding, "draws_differ": draws_differ,
            "copy_differs": copy_differs, "served_while_suspended": served_suspended,
            "operator": [{k: v for k, v in e.items() if k not in ("start", "end")}
                         | {"took_s": round(e.get("end", e["start"]) - e["start"], 3)}
                         for e in operator.log],
            **totals}


def credit_ok(c: dict[str, Any]) -> bool:
    """True when the credit invariant holds."""
    return not (c["grants_wrong"] or c["consumed_not_spent"] or c["failed_holding_credit"]
                or c["draws_differ"] or c["copy_differs"] or c["served_while_suspended"]
                or any(e["outcome"] == "gave_up" for e in c["operator"]))
