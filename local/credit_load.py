"""One user's credit-drawing requests and an operator's changes, for the concurrency test
and ``bench/operator_changes.py``.

A request here is the entitlement part of the request path, as the guard makes it:
reserve (loading the user's copy when the ledger has none), record the draw in DynamoDB
before the provider would be called (``commit_draw``), then keep the cost, refund it (a
failed request) or settle it lower. A draw that cannot be recorded is refunded and the
request answers 503 with the guard's message; ``Outcome.cause`` names the step that made
the 503, read from the warning the entitlements cache logged.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.exceptions import NotFound, StoreUnavailable
from usage_limits.entitlements.store import EntitlementStore
from usage_limits.exceptions import LimiterUnavailable

if TYPE_CHECKING:
    from usage_limits.budget import TokenBudget
    from usage_limits.entitlements.cache import EntitlementCache
    from usage_limits.entitlements.operator import Operator

#: (limit, seconds): a quota of 2 tokens (one charge), so nearly every charge draws credit
PLAN = [(1000, 3600.0), (2, 30 * 86400.0)]
#: two names of the same windows, so that operator changes move the user between them
PLANS = ("tiny", "tiny2")
#: ("standalone" | "cluster", [(host, port), ...])
Target = tuple[str, list[tuple[str, int]]]

#: The guard's 503 messages (usage_limits.web.guard).
NOTHING_CHARGED = "the usage limiter is unavailable; nothing was charged"
MAY_BE_CHARGED = ("the usage limiter is unavailable; this request may have been charged, "
                  "and the tokens will be refunded")

#: Words of the cache's warnings -> the step that made a 503.
_CAUSES = (("kept being overtaken", "rebase exhausted"),
           ("the copy lacks the credit", "credit short on the new copy"),
           ("no such charge", "charge gone from the new copy"),
           ("could not move a draw", "backend failed during rebase"),
           ("is unknown", "draw record unknown"),
           ("did not answer", "draw record unanswered"))


def redis_client(target: Target, *, socket_timeout: float = 5.0) -> Any:
    """An asyncio Redis client of ``target``."""
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    kind, nodes = target
    if kind == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                            socket_timeout=socket_timeout)
    return aioredis.Redis(host=nodes[0][0], port=nodes[0][1], socket_timeout=socket_timeout)


def ledger(client: Any) -> TokenBudget:
    """The ledger with entitlements, the plan ``PLAN`` under both names of ``PLANS``."""
    from usage_limits.budget import TokenBudget, Window

    windows = [Window(limit, seconds) for limit, seconds in PLAN]
    return TokenBudget(client, windows, catalog=dict.fromkeys(PLANS, windows),
                       entitlements=True)


def store_for(url: str, table: str) -> EntitlementStore:
    """The entitlements store of a DynamoDB server at ``url``."""
    return EntitlementStore(StoreSettings(table=table, endpoint_url=url, region="us-east-1",
                                          read_timeout_s=10.0))


def operator_for(store: EntitlementStore, budget: TokenBudget,
                 cache: EntitlementCache) -> Operator:
    """The operator actions of ``PLANS`` over this store, ledger and cache."""
    from usage_limits.entitlements.operator import Operator
    from usage_limits.entitlements.plans import Plans

    plans = Plans.parse(";".join(f"{name}={PLAN[0][0]}/1h,{PLAN[1][0]}/30d"
                                 for name in PLANS), default=PLANS[0])
    return Operator(store, plans, budget, cache)


@dataclass(frozen=True)
class Outcome:
    """What one request got.

    Attributes:
        status: ``served``, ``rejected`` (over quota and credit: 429) or ``unavailable``
            (503).
        request_id, nonce: the charge's ids.
        spent: credit the request kept (drawn less what came back).
        cause: for a 503, the step that made it; else "".
        message: for a 503, the answer's message; else "".
    """

    status: str
    request_id: str
    nonce: str
    spent: int = 0
    cause: str = ""
    message: str = ""


class _Warnings(logging.Handler):
    """Collects the entitlements cache's warnings while one request runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def cause(self) -> str:
        for words, cause in _CAUSES:
            if any(words in m for m in self.messages):
                return cause
        return "unexplained"


async def one_request(cache: EntitlementCache, budget: TokenBudget, user: str,
                      request_id: str, cost: int, lower_to: int | None) -> Outcome:
    """One charge of ``cost`` through the entitlements path, as the guard makes it.

    Args:
        lower_to: None keeps the cost; else the charge is lowered to it after it was
            served (0: a failed request's refund).

    Returns:
        The ``Outcome``.

    Raises:
        AssertionError: a refund or settle of a served charge was not settled.
    """
    nonce = uuid.uuid4().hex
    logger = logging.getLogger("usage_limits.entitlements")
    seen = _Warnings()
    logger.addHandler(seen)
    try:
        try:
            r = await cache.reserve(budget, user, request_id, cost, nonce=nonce,
                                    plan_name=PLANS[0])
        except (StoreUnavailable, LimiterUnavailable) as exc:
            return Outcome("unavailable", request_id, nonce, cause=f"load failed "
                           f"({type(exc).__name__})", message=NOTHING_CHARGED)
        if r.status == "not_loaded":
            return Outcome("unavailable", request_id, nonce, cause="load refused",
                           message=NOTHING_CHARGED)
        if r.status != "charged":
            return Outcome("rejected", request_id, nonce)
        state = "none" if r.drawn == 0 else await cache.commit_draw(budget, user,
                                                                    request_id, nonce, r)
        if state not in ("none", "recorded"):  # the guard refunds it and answers 503
            done = await cache.lower(budget, user, request_id, nonce, 0, state=state)
            known = state == "undone" and done.settled
            return Outcome("unavailable", request_id, nonce, cause=seen.cause(),
                           message=NOTHING_CHARGED if known else MAY_BE_CHARGED)
        back = 0
        if lower_to is not None:
            done = await cache.lower(budget, user, request_id, nonce, lower_to, state=state)
            assert done.settled, "a lowering of a served charge was not settled"
            back = sum(n for _, n in done.returned)
        return Outcome("served", request_id, nonce, spent=r.drawn - back)
    finally:
        logger.removeHandler(seen)


#: The operator changes ``operator_change`` cycles through.
CHANGES = ("grant", "plan", "void", "refund")


async def operator_change(operator: Operator, user: str, n: int) -> str:
    """Make the ``n``-th operator change of a run on ``user`` (``CHANGES`` in turn): a small
    extra grant, a plan change, a void of the latest extra grant, a support refund of the
    latest recorded charge.

    Returns:
        The change's name (with ``/skipped`` when there was nothing for it to act on).
    """
    kind = CHANGES[n % len(CHANGES)]
    if kind == "grant":
        await operator.create_grant(user, tokens=4, kind="paid", reference=f"extra-{n}",
                                    expires_at_ms=None, actor="bench", reason="mid-run")
    elif kind == "plan":
        await operator.set_plan(user, PLANS[(n // len(CHANGES)) % 2], actor="bench",
                                reason="mid-run")
    elif kind == "void":
        await operator.void_grant(user, f"extra-{n - 2}", actor="bench", reason="mid-run")
    else:
        records = [c for c in operator.store.charge_records(user)
                   if c.state != "void" and any(c.consumed.values())]
        if not records:
            return kind + "/skipped"
        latest = max(records, key=lambda c: c.at_ms)
        try:
            await operator.refund(user, latest.request_id, actor="bench", reason="mid-run")
        except NotFound:
            return kind + "/skipped"
    return kind
