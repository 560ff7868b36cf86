"""The cache's copy of a user's entitlements, derived from the durable store.

Redis holds what the reservation script needs about a user (the plan override, the
suspension, the live grants and what is left of them) in the user's own hash tag; DynamoDB
(``EntitlementStore``) is the record of truth, and every movement of credit is a record
there (``charges``). This module is the only place that moves entitlements between the two:

- **Load.** A reservation or usage read that finds no copy (``not_loaded``: never loaded,
  expired, invalidated, or the cache lost its data) marks the user's copy, takes a new load
  epoch in DynamoDB (``ADD epoch 1``), reads the user's ``E#`` items in one consistent Query
  and writes the copy under that epoch. The ledger refuses a copy older than the newest
  invalidation (an operator change that raced the load), and a copy whose mark is gone
  (the cache lost its data while the load ran, and any invalidation with it): the caller
  then loads again, a bounded number of times (``MAX_LOADS``).
- **Draws.** A charge that drew credit is recorded in DynamoDB before its provider is
  called (``commit_draw``), conditional on the epoch the reservation saw. When a load took
  a new epoch in between (it could not see the draw), the draw is taken from the new copy
  too (``rebase_draw``) and recorded under that epoch: an operator change costs in-flight
  requests a retry, not an error. An answer lost on the way is resolved by reading the
  record, or by writing the charge off (a tombstone) so that it can never land later.
- **Credit given back** (``lower``). A refund or settle of a charge whose draw is (or may
  be) recorded returns the credit in DynamoDB first, conditioned on the charge's record,
  never on the epoch; then the ledger lowers the charge and gives the copy exactly what
  DynamoDB returned. When the copy cannot take it (it is not the one the charge drew from,
  or Redis and DynamoDB disagree on what happened), the copy is dropped and reloads. So the
  copy never holds more credit than DynamoDB, and what DynamoDB returned is never lost.
- **Operator changes** commit in DynamoDB, then take a new epoch and invalidate the copy
  (``refresh``): the user's next request loads the change.

Store calls are blocking boto3 calls, run in a thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..deadline import remaining_s
from ..exceptions import LimiterUnavailable
from .exceptions import StoreUnavailable
from .models import Grant, SupportRefund, UserEntitlements

if TYPE_CHECKING:
    from ..budget import Crossing, LiveGrant, Lowered, Reservation, TokenBudget, Usage
    from .store import CreditReturn, EntitlementStore

log = logging.getLogger("usage_limits.entitlements")

#: Loads of one user's copy a single request may make before it gives up (503): one
#: normally; more only while operator changes, or the other processes' loads after one,
#: keep overtaking the copy it loads (3 let about 1 in 65 requests through 0.8 changes/s
#: with 8 processes answer 503).
MAX_LOADS = 6
#: How far back ``history`` (GET /v1/usage) lists ended grants and support refunds, s.
RECENT_S = 30 * 86400.0
#: Times one draw is moved onto a newer copy before the request gives up (503): each
#: needs a load or an operator change to land between the draw and its record. After one
#: operator change every process that finds no copy loads one, and each of those loads
#: makes the draws made on the copy before it stale once more: with 8 processes, 6 moves
#: were used up by about one request per change.
MAX_REBASES = 12
#: Pauses while a draw waits for the loader that took a newer epoch to write its copy,
#: seconds, before it loads one itself (each load takes an epoch: loading at once would
#: overtake the other loaders' copies in turn). They add up to more than a load takes
#: (an epoch, then a consistent Query): with shorter waits, the processes drawing while
#: an operator change lands each load in turn, and each load makes every other draw
#: stale again, until one runs out of rebases (bench/operator_changes.py).
REBASE_WAITS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32)
#: A draw is moved onto a newer copy only while the request has this long left, s: the
#: waits above and a load take up to about a second, and the provider call still has to
#: fit before the deadline (no call starts that cannot finish).
REBASE_MIN_LEFT_S = 1.5

#: Where a charge's credit stands in the record of truth.
#:   none      it drew nothing
#:   recorded  its draw is recorded: lowering it returns credit there first
#:   unknown   its draw may be recorded (an answer was lost): lowering settles it there
#:   undone    no draw of it is, or ever will be, recorded: the copy gets its draw back
#:   drawn     the reservation's answer was lost: whatever it drew is on the ledger's own
#:             draw record only (never recorded, since no record was attempted)
CreditState = Literal["none", "recorded", "unknown", "undone", "drawn"]


def reported_flags(grant: Grant, low_percent: int, margin: int) -> str:
    """The credit reports a loaded copy keeps for ``grant``: those the record of truth says
    were made, unless the grant's remaining has since come back above the re-arming level
    (``low + margin`` percent of its tokens), as the ledger re-arms them."""
    remaining = max(0, grant.tokens - grant.consumed)
    if remaining * 100 > (low_percent + margin) * grant.tokens:
        return ""
    return grant.reported


def live_grants(record: UserEntitlements, now_ms: int, *, low_percent: int = 0,
                margin: int = 0) -> list[LiveGrant]:
    """The grants the cache should hold: not voided and not expired at ``now_ms``.

    Grants with nothing left are kept too: a refund of a charge drawn from one gives its
    credit back to it.
    """
    from ..budget import LiveGrant

    return [LiveGrant(reference=g.reference, remaining=max(0, g.tokens - g.consumed),
                      tokens=g.tokens, expires_at_ms=g.expires_at_ms, kind=g.kind,
                      created_ms=g.created.at_ms,
                      reported=reported_flags(g, low_percent, margin))
            for g in record.grants
            if g.voided is None and (g.expires_at_ms is None or now_ms < g.expires_at_ms)]


def suspended_until(record: UserEntitlements, now_ms: int) -> int | None:
    """The suspension as the cache holds it: None (none in force), 0 (until lifted) or
    its end in ms since the epoch."""
    suspension = record.suspension
    if suspension is None or not suspension.active(now_ms):
        return None
    return 0 if suspension.until_ms is None else suspension.until_ms


@dataclass(frozen=True)
class CreditLowered:
    """What ``EntitlementCache.lower`` did.

    Attributes:
        lowered: the ledger's answer.
        settled: the record of truth holds the lowering (or never held a draw); False when
            DynamoDB could not be reached: the caller keeps the lowering and tries again.
        returned: the credit the record of truth gave back (to the copy too, unless it was
            dropped).
    """

    lowered: Lowered
    settled: bool
    returned: tuple[tuple[str, int], ...] = ()


class EntitlementCache:
    """Moves one deployment's entitlements between DynamoDB and the ledger's cache.

    Args:
        store: the durable store.
        ttl_s: how long a loaded copy lives without requests, seconds (each reservation
            renews it like the ledger's other keys); None: the ledger's default, as long as
            its other keys.
        max_loads: loads one call may make (``MAX_LOADS``).

    Attributes:
        on_forfeit: called with (user id, grants) for the grants a load or read recorded
            as expired with tokens unused (``forfeit_expired``); None: nobody is told.
    """

    def __init__(self, store: EntitlementStore, *, ttl_s: float | None = None,
                 max_loads: int = MAX_LOADS) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_loads = max_loads
        self.on_forfeit: Callable[[str, list[Grant]], None] | None = None

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def load(self, budget: TokenBudget, user_id: str, *,
                   now_ms: int | None = None) -> bool:
        """Load the user's copy from DynamoDB under a new epoch.

        The copy is marked first, then the epoch taken, then the record read: a copy
        lost with the cache in between (and any invalidation with it) refuses this load.

        Returns:
            True when this load's copy was written; False when the ledger refused it (an
            invalidation newer than its epoch, a newer copy already there, or the mark
            lost with the cache).

        Raises:
            StoreUnavailable: DynamoDB failed (nothing was written to the cache).
            LimiterUnavailable: Redis failed.
        """
        await budget.mark_entitlements(user_id, ttl_s=self.ttl_s)
        epoch: int = await self._run(self.store.bump_epoch, user_id)
        record: UserEntitlements = await self._run(self.store.load, user_id)
        now = int(time.time() * 1000) if now_ms is None else now_ms
        await self.forfeit_expired(user_id, record, now)
        low, margin = budget.credit_levels
        written: bool = await budget.load_entitlements(
            user_id, epoch=epoch, plan=record.override.plan if record.override else None,
            suspended_until_ms=suspended_until(record, now),
            grants=live_grants(record, now, low_percent=low, margin=margin),
            ttl_s=self.ttl_s, marked=True)
        return written

    async def forfeit_expired(self, user_id: str, record: UserEntitlements,
                              now_ms: int) -> list[Grant]:
        """Record each grant of ``record`` that has expired with tokens unused (once per
        grant: ``store.mark_expired``) and hand the ones this call recorded to
        ``on_forfeit`` (the web layer publishes ``Atto Credit Expired``).

        A failure to record is logged and left for the next load or read: it never fails
        the load or the request.

        Returns:
            The grants this call recorded, as read (``remaining`` = tokens forfeited).
        """
        due = [g for g in record.grants
               if g.expired_at_ms is None and g.voided is None and g.remaining > 0
               and g.expires_at_ms is not None and g.expires_at_ms <= now_ms]
        marked: list[Grant] = []
        for grant in due:
            try:
                if await self._run(self.store.mark_expired, user_id, grant, now_ms=now_ms):
                    marked.append(grant)
            except StoreUnavailable:
                logging.getLogger(__name__).warning(
                    "could not record an expired grant; the next load or read will")
        if marked and self.on_forfeit is not None:
            self.on_forfeit(user_id, marked)
        return marked

    async def history(self, user_id: str, *, now_ms: int | None = None,
                      recent_s: float = RECENT_S) -> tuple[list[Grant], list[SupportRefund]]:
        """The user's grants that ended (expired or voided) and support refunds made
        within ``recent_s``, from DynamoDB (two strongly consistent queries); a grant seen
        expired with tokens unused is recorded on the way (``forfeit_expired``).

        Returns:
            The ended grants, as recorded (``forfeited`` set on an expired one recorded
            now or before), most recently ended first; the refunds, most recent first.

        Raises:
            StoreUnavailable: DynamoDB failed.
        """
        now = int(time.time() * 1000) if now_ms is None else now_ms
        since = now - int(recent_s * 1000)
        record: UserEntitlements = await self._run(self.store.load, user_id)
        marked = {g.reference for g in await self.forfeit_expired(user_id, record, now)}
        ended: list[tuple[int, Grant]] = []
        for g in record.grants:
            if g.voided is not None:
                at = g.voided.at_ms
            elif g.expires_at_ms is not None and g.expires_at_ms <= now:
                at = g.expires_at_ms
                if g.reference in marked:  # as the store now holds it
                    g = dataclasses.replace(g, expired_at_ms=now, forfeited=g.remaining)
            else:
                continue
            if at >= since:
                ended.append((at, g))
        refunds = [r for r in await self._run(self.store.support_refunds, user_id)
                   if r.change.at_ms >= since]
        return ([g for _, g in sorted(ended, key=lambda e: e[0], reverse=True)],
                sorted(refunds, key=lambda r: r.change.at_ms, reverse=True))

    async def reserve(self, budget: TokenBudget, user_id: str, request_id: str, cost: int,
                      **kwargs: Any) -> Reservation:
        """``budget.reserve``, loading the user's copy first when the ledger has none.

        Returns:
            The reservation; its status is ``not_loaded`` only when ``max_loads`` loads in
            a row were overtaken by operator changes.

        Raises:
            StoreUnavailable: a load was needed and DynamoDB failed (nothing charged).
            Whatever ``budget.reserve`` raises.
        """
        reservation = await budget.reserve(user_id, request_id, cost, **kwargs)
        for _ in range(self.max_loads):
            if reservation.status != "not_loaded":
                break
            await self.load(budget, user_id)
            reservation = await budget.reserve(user_id, request_id, cost, **kwargs)
        return reservation

    async def usage(self, budget: TokenBudget, user_id: str, **kwargs: Any) -> Usage:
        """``budget.usage``, loading the user's copy first when the ledger has none.

        Raises:
            StoreUnavailable: a load was needed and DynamoDB failed.
        """
        report = await budget.usage(user_id, **kwargs)
        for _ in range(self.max_loads):
            if report.loaded:
                break
            await self.load(budget, user_id)
            report = await budget.usage(user_id, **kwargs)
        return report

    async def commit_draw(self, budget: TokenBudget, user_id: str, request_id: str,
                          nonce: str, reservation: Reservation, *,
                          route: str = "") -> CreditState:
        """Record a reservation's draws in DynamoDB (before its provider is called).

        A draw refused for a newer epoch is moved onto the newer copy and recorded under
        its epoch (at most ``MAX_REBASES`` times, and only while the request has
        ``REBASE_MIN_LEFT_S`` left before its deadline). An answer lost on the way is resolved:
        the record is read, or the charge written off so that it can never land.

        Returns:
            ``recorded`` (serve the request), ``undone`` (not recorded and never will be:
            refund it, the copy gets the credit back) or ``unknown`` (DynamoDB did not
            answer: refund it through ``lower``, which settles the record when it can).
        """
        reported: dict[str, str] = {}
        for c in reservation.credit_crossings:  # a draw may cross both of one grant's
            reported[c.reference] = reported.get(c.reference, "") + (
                "l" if c.kind == "low" else "x")
        epoch = reservation.epoch
        for _ in range(MAX_REBASES + 1):
            try:
                outcome = await self._run(self.store.commit_draw, user_id, request_id, nonce,
                                          reservation.draws, epoch, cost=reservation.cost,
                                          route=route, reported=reported)
            except StoreUnavailable:
                log.warning("a draw's record did not answer; resolving it", exc_info=True)
                return await self._resolve(user_id, request_id, nonce)
            if outcome != "stale":
                return "recorded" if outcome == "recorded" else "undone"
            if remaining_s() < REBASE_MIN_LEFT_S:  # the deadline bounds the retries too
                log.warning("the request's deadline is too near to move its draw")
                return "undone"
            try:  # a load since the draw: take the draw from the new copy as well
                status, moved_to = await self._rebase(budget, user_id, request_id, nonce,
                                                      reported, epoch)
            except (LimiterUnavailable, StoreUnavailable):
                log.warning("could not move a draw onto the user's new copy", exc_info=True)
                return "undone"
            if status < 0:
                log.warning("a draw could not be moved onto the user's new copy (%s)",
                            "no such charge" if status == -1 else "the copy lacks the credit")
                return "undone"
            if status == 1:
                epoch = moved_to
        log.warning("a draw kept being overtaken by loads of the user's copy")
        return "undone"

    async def _rebase(self, budget: TokenBudget, user_id: str, request_id: str, nonce: str,
                      reported: dict[str, str], epoch: int) -> tuple[int, int]:
        """Move the draw onto a copy newer than ``epoch``: the one another loader is
        writing (waited for briefly), else one this call loads.

        Returns:
            ``budget.rebase_draw``'s (status, epoch); status 0 when no newer copy could be
            had this time (the caller tries again, within its bound).
        """
        for pause_s in REBASE_WAITS_S:
            status, moved_to = await budget.rebase_draw(user_id, request_id, nonce=nonce,
                                                        reported=reported)
            if status < 0 or (status == 1 and moved_to > epoch):
                return status, moved_to
            await asyncio.sleep(pause_s)  # the loader that took the new epoch writes soon
        await self.load(budget, user_id)
        status, moved_to = await budget.rebase_draw(user_id, request_id, nonce=nonce,
                                                    reported=reported)
        return (0, moved_to) if status == 1 and moved_to <= epoch else (status, moved_to)

    async def _resolve(self, user_id: str, request_id: str, nonce: str) -> CreditState:
        """After a draw's write went unanswered: is it recorded? If not, make sure it never
        will be (a tombstone), so that the answer can say nothing was charged."""
        try:
            found = await self._run(self.store.charge_record, user_id, request_id, nonce)
            if found is not None:
                return "undone" if found.state == "void" else "recorded"
            await self._run(self.store.return_credit, user_id, request_id, nonce, 0)
        except StoreUnavailable:
            log.warning("a draw's record is unknown; it is settled when refunded",
                        exc_info=True)
            return "unknown"
        # written off: a tombstone, or (the draw landed in between) its credit returned
        return "undone"

    async def lower(self, budget: TokenBudget, user_id: str, request_id: str, nonce: str,
                    new_cost: int, *, state: CreditState,
                    uncross: Sequence[Crossing] = ()) -> CreditLowered:
        """Lower a charge to ``new_cost``: its credit in DynamoDB first, then the ledger.

        A charge whose draw the record of truth never holds (``none``, ``undone``,
        ``drawn``, or a tombstone written now) is the ledger's alone: the copy gets back
        what the lowering takes off the charge's own draw record. One whose draw is (or may
        be) recorded gets back in DynamoDB what ``EntitlementStore.return_credit`` decides,
        and the copy gets exactly that, or is dropped.

        Args:
            state: where the charge's credit stands in the record of truth.
            uncross: usage-threshold crossings to undo with it (``budget.lower``).

        Returns:
            A ``CreditLowered``; ``settled`` False asks the caller to keep the lowering and
            call again (DynamoDB did not answer; the ledger's part is done).

        Raises:
            LimiterUnavailable: Redis failed (the record of truth's part, if any, is done:
                calling again is safe).
        """
        if state in ("none", "undone", "drawn"):
            lowered = await budget.lower(user_id, request_id, new_cost, nonce=nonce,
                                         credit="drawn" if state != "none" else (),
                                         uncross=uncross)
            return CreditLowered(lowered, settled=True)
        ret: CreditReturn | None
        try:
            ret = await self._run(self.store.return_credit, user_id, request_id, nonce,
                                  new_cost)
        except StoreUnavailable:
            log.warning("could not return credit in the record of truth; kept",
                        exc_info=True)
            ret = None
        credit: Any = () if ret is None else ret.returned if ret.existed else "drawn"
        lowered = await budget.lower(user_id, request_id, new_cost, nonce=nonce,
                                     credit=credit, uncross=uncross)
        if ret is not None and (lowered.stale or ret.changed != lowered.changed
                                or (ret.existed and ret.returned != lowered.returned)
                                or (ret.existed and not ret.changed
                                    and ret.record is not None and ret.record.returned)):
            # the copy did not take exactly what DynamoDB did: drop it, it reloads. A
            # lowering DynamoDB finds made already, with credit returned, is one whose
            # answer was lost (the copy got none of it then) or a repeat: either way the
            # copy cannot know it holds that credit.
            await self.forget(budget, user_id, lowered.epoch)
        return CreditLowered(lowered, settled=ret is not None,
                             returned=ret.returned if ret is not None else ())

    async def forget(self, budget: TokenBudget, user_id: str, floor_epoch: int) -> None:
        """Drop the user's copy so the next request reloads it from DynamoDB.

        A new epoch is taken when DynamoDB answers; else the copy is invalidated just past
        ``floor_epoch`` (every later load's epoch is larger). Failures are logged only: a
        copy that cannot be dropped holds less credit than DynamoDB, never more.
        """
        try:
            epoch: int = await self._run(self.store.bump_epoch, user_id)
        except StoreUnavailable:
            epoch = floor_epoch + 1
        try:
            await budget.invalidate_entitlements(user_id, epoch=epoch)
        except Exception:
            log.exception("could not drop a user's cached entitlements")

    async def refresh(self, budget: TokenBudget, user_id: str) -> int:
        """After an operator change committed: a new epoch, and the copy invalidated.

        Returns:
            The new epoch.

        Raises:
            StoreUnavailable: DynamoDB failed (the change is committed; call again).
            LimiterUnavailable: Redis failed (the change is committed; call again).
        """
        epoch: int = await self._run(self.store.bump_epoch, user_id)
        await budget.invalidate_entitlements(user_id, epoch=epoch)
        return epoch
