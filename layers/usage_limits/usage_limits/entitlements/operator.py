"""What an operator can do to one user: the work behind the ``/admin/v1/`` routes.

Durable state (overrides, grants, suspensions, support refunds, the audit log) is written
to the ``EntitlementStore``; the ledger (Redis) is read for the windows and spend events,
and changed only by a support refund. Every change, once committed, takes a new load epoch
and invalidates the user's cached copy (``EntitlementCache.refresh``), so the user's next
request loads it; a change whose refresh failed answers 503 and is safe to repeat (every
change is idempotent, and a repeat refreshes again). Store calls are blocking boto3 calls,
run in a thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..exceptions import InvalidArgument, LimiterUnavailable
from .exceptions import NotFound, NotRefreshed, StoreUnavailable
from .models import AuditEntry, Grant, PlanOverride, SupportRefund, Suspension, UserEntitlements
from .plans import Plan, Plans, PlanSource

if TYPE_CHECKING:
    from ..budget import SpendEvent, TokenBudget, WindowUsage
    from .cache import EntitlementCache
    from .charges import ChargeRecord
    from .store import EntitlementStore
    from .usage import GrantEvent
    from .usage_store import UsageStore

#: Spend events shown in a user's picture.
PICTURE_EVENTS = 50
#: The prefixes the request path gives request ids (Idempotency-Key, API Gateway, generated).
REQUEST_ID_PREFIXES = ("k:", "r:", "g:")


@dataclass(frozen=True)
class Picture:
    """One user's whole picture.

    Attributes:
        user_id: the user.
        plan: the plan the user is measured against: the override, else the plan of the
            last charge that stands (``last_charge``), else the default.
        plan_source: ``override``, ``claim`` (the plan of the last charge, chosen by the
            user's JWT claim, or ``X-Atto-Plan`` in local mode) or ``default``.
        entitlements: the durable record (override, suspension, grants).
        windows: the plan's windows and what each holds now.
        events: the most recent charges, most recent first.
        now_ms: the time the picture was taken, ms since the epoch.
        last_charge: (ms, plan name) of the user's last charge that stands (not refunded:
            a failed request's charge is not one), the plan it was really charged under;
            None when unknown (no charge yet, or the cache lost it).
    """

    user_id: str
    plan: Plan
    plan_source: PlanSource
    entitlements: UserEntitlements
    windows: tuple[WindowUsage, ...]
    events: tuple[SpendEvent, ...]
    now_ms: int
    last_charge: tuple[int, str] | None = None


class Operator:
    """Operator actions on users, each with a reason and recorded with its actor.

    Args:
        store: the durable store.
        plans: the deployment's plans.
        budget: the ledger (for windows, spend events and support refunds).
        cache: the entitlements cache the request path reads (None: the request path reads
            no entitlements, and changes need no refresh).
        usage: the usage records (None: none are kept; a support refund lowers none).
    """

    def __init__(self, store: EntitlementStore, plans: Plans, budget: TokenBudget,
                 cache: EntitlementCache | None = None, *,
                 usage: UsageStore | None = None) -> None:
        self.store = store
        self.plans = plans
        self.budget = budget
        self.cache = cache
        self.usage = usage

    async def _refresh(self, user_id: str) -> None:
        """Make the user's next request load what the store now holds.

        Raises:
            NotRefreshed: DynamoDB or Redis failed (the change itself is committed).
        """
        if self.cache is None:
            return
        try:
            await self.cache.refresh(self.budget, user_id)
        except (StoreUnavailable, LimiterUnavailable) as exc:
            raise NotRefreshed("the change is recorded, but the user's cached entitlements "
                               "could not be refreshed; repeat the call (it is idempotent)"
                               ) from exc

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def picture(self, user_id: str) -> Picture:
        """The user's plan, windows, grants, suspension and recent spend (empty when never
        seen).

        Raises:
            StoreUnavailable, LimiterUnavailable: a backend failed.
        """
        from ..budget import Window

        def windows(plan: Plan) -> list[Window]:
            return [Window(limit=limit, seconds=seconds) for limit, seconds in plan.windows]

        record: UserEntitlements = await self._run(self.store.load, user_id)
        resolved = self.plans.resolve(override=record.override.plan if record.override
                                      else None)
        plan, source = resolved.plan, resolved.source
        usage = await self.budget.usage(user_id, windows=windows(plan),
                                        plan_name=plan.name, events=PICTURE_EVENTS)
        last = await self._standing_charge(user_id, usage.events, usage.last_charge)
        charged = self.plans.get(last[1]) if last is not None else None
        if source != "override" and charged is not None and charged.name != plan.name:
            # the user's own requests chose this plan (a claim): they are measured by it
            plan, source = charged, "claim"
            usage = await self.budget.usage(user_id, windows=windows(plan),
                                            plan_name=plan.name, events=PICTURE_EVENTS)
        return Picture(user_id, plan, source, record, usage.windows, usage.events,
                       usage.now_ms, last)

    async def _standing_charge(self, user_id: str, events: tuple[SpendEvent, ...],
                               last: tuple[int, str] | None) -> tuple[int, str] | None:
        """(ms, plan name) of the user's last charge that stands, or None when unknown.

        The ledger keeps the plan of its last charge (``last``), but a refund takes a
        charge out of the log and leaves ``last`` naming it: a failed request's plan is no
        plan the user is measured by. So ``last`` counts only when it is the newest
        charge in the log; else the newest charge's usage record names its plan.
        """
        if not events:
            return None
        newest = events[0]
        if last is not None and last[0] == newest.at_ms:
            return last
        if self.usage is None or not newest.nonce:
            return None
        try:
            found = await self._run(self.usage.get, user_id, newest.request_id, newest.nonce)
        except StoreUnavailable:
            return None  # the picture is still worth showing; the plan is then unknown
        return (newest.at_ms, found.plan) if found is not None and found.plan else None

    async def set_plan(self, user_id: str, plan: str, *, actor: str,
                       reason: str) -> PlanOverride:
        """Override the user's plan.

        Raises:
            InvalidArgument: ``plan`` names no plan of this deployment, or no reason.
        """
        if self.plans.get(plan) is None:
            raise InvalidArgument(f"unknown plan {plan!r}; the plans are "
                                  f"{', '.join(self.plans.by_name)}")
        result: PlanOverride = await self._run(self.store.set_override, user_id, plan,
                                               actor=actor, reason=reason)
        await self._refresh(user_id)
        return result

    async def clear_plan(self, user_id: str, *, actor: str,
                         reason: str) -> PlanOverride | None:
        """Remove the user's override; the one removed, or None when there was none."""
        result: PlanOverride | None = await self._run(self.store.clear_override, user_id,
                                                      actor=actor, reason=reason)
        await self._refresh(user_id)
        return result

    async def create_grant(self, user_id: str, *, tokens: int, kind: str, reference: str,
                           expires_at_ms: int | None, actor: str,
                           reason: str) -> tuple[Grant, bool]:
        """Create a grant once per reference; (grant, created)."""
        result: tuple[Grant, bool] = await self._run(
            self.store.create_grant, user_id, tokens=tokens, kind=kind, reference=reference,
            expires_at_ms=expires_at_ms, actor=actor, reason=reason)
        await self._refresh(user_id)
        return result

    async def void_grant(self, user_id: str, reference: str, *, actor: str,
                         reason: str) -> tuple[Grant, bool]:
        """Void a grant; (grant, voided by this call).

        Raises:
            NotFound: no grant with this reference.
        """
        result: tuple[Grant, bool] = await self._run(self.store.void_grant, user_id,
                                                     reference, actor=actor, reason=reason)
        await self._refresh(user_id)
        return result

    async def suspend(self, user_id: str, *, reason: str, until_ms: int | None,
                      actor: str) -> Suspension:
        """Suspend the user until ``until_ms`` (None: until lifted)."""
        result: Suspension = await self._run(self.store.suspend, user_id, reason=reason,
                                             until_ms=until_ms, actor=actor)
        await self._refresh(user_id)
        return result

    async def lift_suspension(self, user_id: str, *, actor: str,
                              reason: str) -> Suspension | None:
        """Lift the suspension; the one lifted, or None when there was none."""
        result: Suspension | None = await self._run(self.store.lift_suspension, user_id,
                                                    actor=actor, reason=reason)
        await self._refresh(user_id)
        return result

    async def audit(self, user_id: str | None, *, limit: int) -> list[AuditEntry]:
        """Operator actions, newest first: one user's, or everyone's when None."""
        result: list[AuditEntry] = await self._run(self.store.audit, user_id, limit=limit)
        return result

    async def refund(self, user_id: str, request_id: str, *, actor: str,
                     reason: str) -> tuple[SupportRefund, bool]:
        """Refund one charge, at most once, however long ago it was made.

        ``request_id`` is the ledger's id, or the id ``GET /v1/usage`` shows (without its
        prefix). The charge is found by its id: in the ledger while a window counts it,
        and through its credit record in DynamoDB while it holds credit (after a cache
        loss too). The refund is one DynamoDB transaction (the charge's credit back to the
        grants it drew from, unless expired or voided; the refund's record; its audit
        entry), then the ledger gives the windows their tokens back and the copy its
        credit. A call repeated after a failure finishes what the first one left.

        Returns:
            The refund and True when this call made it; the earlier refund and False.

        Raises:
            NotFound: no such charge stands (never charged, already refunded by the request
                path, or out of every window and holding no credit).
            NotRefreshed: the refund is recorded with its audit entry, but the ledger
                could not be reached to give the windows back: repeat the call.
        """
        rid, ledger, record = await self._find_charge(user_id, request_id)
        earlier: SupportRefund | None = await self._run(self.store.support_refund, user_id,
                                                        rid)
        drew = ledger is not None and bool(ledger.draws)
        if earlier is not None:
            await self._finish_ledger(user_id, earlier, first=False, drew=drew)
            await self._lower_record(user_id, earlier)
            return earlier, False
        if ledger is None and record is None:
            raise NotFound(f"no charge {request_id!r} in the user's ledger")
        nonce = ledger.nonce if ledger is not None else record.nonce  # type: ignore[union-attr]
        done, created = await self._run(self.store.refund_charge, user_id, rid, nonce,
                                        tokens=ledger.cost if ledger is not None else 0,
                                        actor=actor, reason=reason)
        await self._finish_ledger(user_id, done, first=created, drew=drew)
        await self._lower_record(user_id, done)
        return done, created

    async def _lower_record(self, user_id: str, refund: SupportRefund) -> None:
        """Mark the refunded charge's usage record ``support-refunded`` (idempotent: a
        repeated call, or a refund the request path made first, changes nothing).

        Raises:
            NotRefreshed: DynamoDB failed; the refund itself is recorded.
        """
        if self.usage is None or not refund.nonce:
            return
        try:
            await self._run(self.usage.lower, user_id, refund.request_id, refund.nonce, 0,
                            "support-refunded", refund.change.at_ms)
        except StoreUnavailable as exc:
            raise NotRefreshed("the refund is recorded, but the charge's usage record could "
                               "not be updated; repeat the call (it is idempotent)") from exc

    async def grant_history(self, user_id: str, reference: str) -> list[GrantEvent]:
        """A grant's history: created, each draw and return, void and expiry, oldest
        first (from the grant's item and the user's charge records).

        Raises:
            NotFound: the user has no grant with this reference.
        """
        from .models import check_reference
        from .usage import grant_history

        item = await self._run(self.store._get, user_id, "E#G#" + check_reference(reference))
        if item is None:
            raise NotFound(f"the user has no grant with reference {reference!r}")
        charges: list[ChargeRecord] = await self._run(self.store.charge_records, user_id)
        return grant_history(item, charges)

    async def _finish_ledger(self, user_id: str, refund: SupportRefund, *, first: bool,
                             drew: bool = False) -> None:
        """Give the refunded charge's tokens back in the ledger, and its credit to the copy.

        The copy gets exactly the credit the record of truth gave back, or is dropped (it
        reloads): never more, and nothing lost. A repeat (``first`` False) gives it too: the
        ledger takes it only with a lowering it makes now, so the copy gets it once,
        whether or not the first call's answer was lost before the ledger's part. A charge
        that drew credit (``drew``) the record of truth gave none back for (its draw never
        recorded: its environment was killed in between) drops the copy too: the ledger
        removes the draw without returning it, and the copy reloads exact.

        Raises:
            NotRefreshed: Redis failed; the refund itself is recorded.
        """
        try:
            if self.cache is None:
                await self.budget.refund(user_id, refund.request_id, nonce=refund.nonce)
                return
            credit = refund.credit
            lowered = await self.budget.lower(user_id, refund.request_id, 0,
                                              nonce=refund.nonce, credit=credit)
            if (lowered.stale or lowered.returned != credit) if credit else (
                    drew and lowered.changed):
                await self.cache.forget(self.budget, user_id, lowered.epoch)
        except LimiterUnavailable as exc:
            raise NotRefreshed("the refund is recorded, with the credit given back to its "
                               "grants, but the ledger could not be reached to give the "
                               "windows their tokens back; repeat the call (it is "
                               "idempotent)") from exc

    async def _find_charge(self, user_id: str, request_id: str,
                           ) -> tuple[str, SpendEvent | None, ChargeRecord | None]:
        """The ledger id of ``request_id`` (as given, or with the prefix the request path
        adds: ``GET /v1/usage`` shows ids without it), the ledger's charge of it (None when
        no window counts it) and its credit record still holding credit (None when none).

        Raises:
            NotFound: no id of these is known to the ledger or the store.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument("request_id is required")
        candidates = (request_id, *(p + request_id for p in REQUEST_ID_PREFIXES))
        for rid in candidates:
            ledger = await self.budget.charge(user_id, rid)
            records: list[ChargeRecord] = await self._run(self.store.charge_records, user_id,
                                                          rid)
            standing = [r for r in records if r.state != "void" and r.kept > 0
                        and (ledger is None or r.nonce == ledger.nonce)]
            record = standing[-1] if standing else None
            if ledger is not None or record is not None:
                return rid, ledger, record
            if await self._run(self.store.support_refund, user_id, rid) is not None:
                return rid, None, None
        raise NotFound(f"no charge {request_id!r} in the user's ledger")

    def now_ms(self) -> int:
        """The operator's clock, ms since the epoch."""
        return int(time.time() * 1000)
