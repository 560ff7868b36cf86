"""The cache's copy of a user's entitlements, kept in step with the durable store.

Redis holds what the reservation script needs about a user (the plan override, the
suspension, the live grants and what is left of them) in the user's own hash tag; DynamoDB
(``EntitlementStore``) is the record of truth. This module is the only place that moves
entitlements between the two:

- **Load.** A reservation or usage read that finds no copy (``not_loaded``: never loaded,
  expired, invalidated, or the cache lost its data) takes a new load epoch in DynamoDB
  (``ADD epoch 1``), reads the user's ``E#`` items in one consistent Query and writes the
  copy under that epoch. The ledger refuses a copy older than the newest invalidation
  (an operator change that raced the load): the caller then loads again, a bounded number
  of times (``MAX_LOADS``).
- **Draws.** A charge that drew credit is recorded in DynamoDB before its provider is
  called (``commit_draw``), conditional on the epoch the reservation saw: a draw made before
  a reload (which could not see it) never commits. When the record cannot be written the
  charge is refunded in Redis and the request answered 503.
- **Credit given back.** A refund or settle that gave credit back to its grants in Redis
  is recorded the same way (``give_back``). When that fails, or the draw itself was never
  recorded, the copy is invalidated, so the next request reloads what DynamoDB holds: the
  cache never holds more credit than the record of truth.
- **Operator changes** commit in DynamoDB, then take a new epoch and invalidate the copy
  (``refresh``): the user's next request loads the change.

Store calls are blocking boto3 calls, run in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from .exceptions import StoreUnavailable
from .models import UserEntitlements

if TYPE_CHECKING:
    from ..budget import LiveGrant, Lowered, Reservation, TokenBudget, Usage
    from .store import EntitlementStore

log = logging.getLogger("usage_limits.entitlements")

#: Loads of one user's copy a single request may make before it gives up (503): one
#: normally; more only while operator changes keep invalidating the copy it loads.
MAX_LOADS = 3


def live_grants(record: UserEntitlements, now_ms: int) -> list[LiveGrant]:
    """The grants the cache should hold: not voided and not expired at ``now_ms``.

    Grants with nothing left are kept too: a refund of a charge drawn from one gives its
    credit back to it.
    """
    from ..budget import LiveGrant

    return [LiveGrant(reference=g.reference, remaining=max(0, g.tokens - g.consumed),
                      tokens=g.tokens, expires_at_ms=g.expires_at_ms, kind=g.kind,
                      created_ms=g.created.at_ms)
            for g in record.grants
            if g.voided is None and (g.expires_at_ms is None or now_ms < g.expires_at_ms)]


def suspended_until(record: UserEntitlements, now_ms: int) -> int | None:
    """The suspension as the cache holds it: None (none in force), 0 (until lifted) or
    its end in ms since the epoch."""
    suspension = record.suspension
    if suspension is None or not suspension.active(now_ms):
        return None
    return 0 if suspension.until_ms is None else suspension.until_ms


class EntitlementCache:
    """Moves one deployment's entitlements between DynamoDB and the ledger's cache.

    Args:
        store: the durable store.
        ttl_s: how long a loaded copy lives without requests, seconds (each reservation
            renews it like the ledger's other keys); None: the ledger's default, as long as
            its other keys.
        max_loads: loads one call may make (``MAX_LOADS``).
    """

    def __init__(self, store: EntitlementStore, *, ttl_s: float | None = None,
                 max_loads: int = MAX_LOADS) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_loads = max_loads

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def load(self, budget: TokenBudget, user_id: str, *,
                   now_ms: int | None = None) -> bool:
        """Load the user's copy from DynamoDB under a new epoch.

        Returns:
            True when this load's copy was written; False when the ledger refused it (an
            invalidation newer than its epoch, or a newer copy already there).

        Raises:
            StoreUnavailable: DynamoDB failed (nothing was written to the cache).
            LimiterUnavailable: Redis failed.
        """
        epoch: int = await self._run(self.store.bump_epoch, user_id)
        record: UserEntitlements = await self._run(self.store.load, user_id)
        now = int(time.time() * 1000) if now_ms is None else now_ms
        written: bool = await budget.load_entitlements(
            user_id, epoch=epoch, plan=record.override.plan if record.override else None,
            suspended_until_ms=suspended_until(record, now), grants=live_grants(record, now),
            ttl_s=self.ttl_s)
        return written

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

    async def commit_draw(self, user_id: str, request_id: str, nonce: str,
                          reservation: Reservation) -> bool:
        """Record a reservation's draws in DynamoDB (before its provider is called).

        Returns:
            True when recorded; False when it cannot be (the epoch moved on, or DynamoDB
            failed): the caller refunds the charge and answers 503.
        """
        try:
            done: bool = await self._run(self.store.commit_draw, user_id, request_id, nonce,
                                         reservation.draws, reservation.epoch)
        except StoreUnavailable:
            log.warning("could not record a draw from credit grants", exc_info=True)
            return False
        if not done:
            log.warning("a draw from credit grants was made under a replaced load epoch")
        return done

    async def give_back(self, budget: TokenBudget, user_id: str, request_id: str,
                        nonce: str, new_cost: int, lowered: Lowered, *,
                        recorded: bool) -> None:
        """Make the credit a refund or settle gave back in Redis durable, or drop the copy.

        Args:
            new_cost: the charge's cost after the lowering (0 for a refund).
            lowered: what the ledger's ``lower`` reported.
            recorded: whether the charge's draws were recorded in DynamoDB. Credit of a
                draw that never was must not be given back there: the copy is dropped
                instead, and the next request reloads what DynamoDB holds.

        Never raises: the charge is already lowered in Redis; what cannot be recorded is
        made safe by dropping the copy (the credit is then lost, never doubled).
        """
        if not lowered.returned:
            return
        if recorded:
            try:
                if await self._run(self.store.commit_return, user_id, request_id, nonce,
                                   new_cost, lowered.returned, lowered.epoch):
                    return
            except StoreUnavailable:
                log.warning("could not record credit given back", exc_info=True)
        await self.forget(budget, user_id, lowered.epoch)

    async def forget(self, budget: TokenBudget, user_id: str, floor_epoch: int) -> None:
        """Drop the user's copy so the next request reloads it from DynamoDB.

        A new epoch is taken when DynamoDB answers; else the copy is invalidated just past
        ``floor_epoch`` (every later load's epoch is larger). Failures are logged only.
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

