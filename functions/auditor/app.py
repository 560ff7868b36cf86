"""The scheduled conservation audit: do the books of the users active since the last run
balance? (EventBridge Scheduler, hourly by default; ``usage_limits.entitlements.auditor``)

Each run writes its report to the logs (one structured JSON line, ``books audit``, with
every divergence: user, request ids or grant, kind, tokens, the command that fixes it) and
publishes ``LedgerDivergence`` (the count, 0 when the books balance) and
``LedgerDivergenceTokens`` (tokens off) and ``UsersNotAudited`` (users it chose and could
not audit) as EMF metrics; alarms fire on any divergence, on users left unaudited, and on
a run that failed.

A scheduled run first sweeps the grants that expired with tokens unused since the last
sweep (``usage_limits.entitlements.expiry_sweep``): each is recorded and published as
``Atto Credit Expired`` once (the report's ``grants_expired_swept`` counts them), whether
or not its user comes back.

The event may name users to audit (``{"users": ["alice"]}``: the mark of the last run is
then left alone, as for ``atto-admin audit --user``); anything else runs over the active
users. It answers the report's JSON, so ``sam local invoke -e events/auditor_schedule.json``
shows it.
"""

from __future__ import annotations

import usage_limits.coldstart  # noqa: F401  (first: no GC while loading; see its docstring)

# isort: split
import asyncio
from typing import Any

from usage_limits import coldstart
from usage_limits.entitlements.audit import AuditReport
from usage_limits.entitlements.auditor import Auditor
from usage_limits.entitlements.store import default_store
from usage_limits.web import events, runtime
from usage_limits.web import observability as obs

#: Seconds a run keeps in hand before the Lambda's end: it stops before the next user.
MARGIN_S = 30.0
#: The ``route`` dimension of the metrics of a run.
ROUTE = "scheduled audit"

coldstart.resume()


def usage_store() -> Any:
    """The usage-record store of this environment (None: not deployed with it)."""
    from usage_limits.entitlements.usage_store import default_usage_store

    return default_usage_store()


def publish(report: AuditReport) -> None:
    """The report to the logs (one JSON line) and its metrics (one EMF line)."""
    obs.logger().info("books audit", extra=report.to_json())
    obs.count(obs.LEDGER_DIVERGENCE, len(report.divergences))
    obs.count(obs.LEDGER_DIVERGENCE_TOKENS, report.tokens)
    obs.count(obs.USERS_NOT_AUDITED, report.users_not_audited)
    obs.flush(ROUTE)


async def audit(event: dict[str, Any], time_left_s: Any) -> AuditReport:
    """One run over this environment's store, ledger and usage records."""
    auditor = Auditor(default_store(), runtime.get_redis(), usage_store())
    expired = ExpiredEvents()
    auditor.on_forfeit = expired.add
    users = event.get("users") if isinstance(event, dict) else None
    if users is not None and (not isinstance(users, list)
                              or not all(isinstance(u, str) and u for u in users)):
        raise ValueError('"users" must be a list of user ids')
    try:
        return await auditor.run(users=users, time_left_s=time_left_s)
    finally:
        expired.flush()
        await events.drain()  # each publication ends within its bound


class ExpiredEvents:
    """``Atto Credit Expired`` for the grants the expiry sweep recorded, as the load path
    publishes them (the same events, the same bus), in calls of up to
    ``events.MAX_ENTRIES`` (a sweep may record thousands: one publication each would
    queue as many threads)."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def add(self, user_id: str, grants: list[Any]) -> None:
        """Queue the events of ``grants``; publish once a call's worth is queued."""
        self.pending += events.expired_events(user_id, grants)
        if len(self.pending) >= events.MAX_ENTRIES:
            self.flush()

    def flush(self) -> None:
        """Start publishing what is queued (``events.drain`` waits for it)."""
        batch, self.pending = self.pending, []
        events.publish_soon(batch)


def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """The Lambda entry point: one audit run; its report."""
    def time_left_s() -> float:
        if context is None or not hasattr(context, "get_remaining_time_in_millis"):
            return float("inf")
        return float(context.get_remaining_time_in_millis()) / 1000 - MARGIN_S

    # a loop of its own, never made current: asyncio.run would leave the thread without
    # one, and a Mangum app served in the same process (local serving) needs it
    loop = asyncio.new_event_loop()
    try:
        report = loop.run_until_complete(audit(event, time_left_s))
    finally:
        loop.close()
    publish(report)
    return report.to_json()
