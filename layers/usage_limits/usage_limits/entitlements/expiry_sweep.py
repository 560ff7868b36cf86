"""The expiry sweep: every grant that expired with tokens unused is recorded and reported
within about an hour, whether or not its user comes back.

A load of the cache or a ``GET /v1/usage`` records an expired grant when it sees one
(``EntitlementCache.forfeit_expired``); a user who never returns would leave it unrecorded
and unreported. So each scheduled audit run first sweeps the grants that expired since the
previous sweep: it reads the expiry index (``store.expiring``: grants by the UTC hour of
their expiry, keys only) from its mark (pk ``AUDITOR``, sk ``EXPIRY``; less
``OVERLAP_MS``, for the index's lag) up to now, reads each grant (GetItem, strongly
consistent), and for one expired with tokens left, not voided and not yet recorded, records
it with the same conditional write as the load path (``store.mark_expired``) and hands it
to ``on_forfeit`` (which publishes ``Atto Credit Expired``). That write succeeds for exactly
one of the sweep and the loads racing it, and a re-send after a lost answer still knows it
was its own (``expired_by``), so each grant is reported at most once in all.

Nothing is dropped from Redis: the cached copy already ignores a grant from its expiry on
(``G.is_live`` in ``_budget_grants.lua``, used by every script that reads or draws credit).

Bounds: the sweep stops before the next grant once ``time_left_s()`` is <= 0, or at the
first DynamoDB failure, and leaves its mark at the first grant it did not handle, so the
next run continues there. Grants created before the index existed carry no index key and
are never swept (the load path still records them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .exceptions import StoreUnavailable

if TYPE_CHECKING:
    from .models import Grant
    from .store import EntitlementStore

log = logging.getLogger("usage_limits.audit")

#: The sweep's mark in the entitlements table (beside the auditor's ``AUDITOR``/``LAST``).
MARK_PK, MARK_SK = "AUDITOR", "EXPIRY"
#: How far before its mark a sweep starts again, ms: the expiry index is eventually
#: consistent, so a grant created moments before its expiry may reach it late (recording
#: is idempotent: a grant read twice is reported once).
OVERLAP_MS = 300_000
_HOUR_MS = 3_600_000


@dataclass(frozen=True)
class SweepResult:
    """What one sweep did.

    Attributes:
        swept: grants this sweep recorded as expired unused (and handed to ``on_forfeit``).
        checked: grants of the index it read.
        from_ms: the start of the span it swept.
        until_ms: how far it got: its new mark (the run's clock when it finished); None
            when it could not read its mark (it swept nothing).
        complete: it reached the run's clock (False: out of time, or DynamoDB failed).
    """

    swept: int
    checked: int
    from_ms: int
    until_ms: int | None
    complete: bool


def due(grant: Grant, now_ms: int) -> bool:
    """Whether ``grant`` is one to record: expired by ``now_ms`` with tokens left, not
    voided, not recorded yet (as ``EntitlementCache.forfeit_expired`` decides)."""
    return (grant.expired_at_ms is None and grant.voided is None
            and grant.remaining > 0 and grant.expires_at_ms is not None
            and grant.expires_at_ms <= now_ms)


class ExpirySweep:
    """Records and reports the grants that expired unused since the previous sweep.

    Args:
        store: the entitlements store (its expiry index, the grants, the mark).
        on_forfeit: called with (user id, [grant]) for each grant this sweep recorded
            (as read: ``remaining`` = tokens forfeited); None: nobody is told.
    """

    def __init__(self, store: EntitlementStore,
                 on_forfeit: Callable[[str, list[Grant]], Any] | None = None) -> None:
        self.store = store
        self.on_forfeit = on_forfeit
        self._time_left_s: Callable[[], float] | None = None

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    def last_mark(self) -> int | None:
        """How far the previous sweep got, ms (None: no sweep yet)."""
        s = self.store
        reply = s._call(s.client.get_item, TableName=s.table, ConsistentRead=True,
                        Key=s._ser({"pk": MARK_PK, "sk": MARK_SK}))
        item = reply.get("Item")
        return None if not item else int(s._de(item)["until"])

    def set_mark(self, until_ms: int) -> None:
        """Record how far this sweep got: the next starts there (less ``OVERLAP_MS``)."""
        s = self.store
        s._call(s.client.put_item, TableName=s.table, Item=s._ser({
            "pk": MARK_PK, "sk": MARK_SK, "until": until_ms}))

    async def _one(self, user_id: str, reference: str, now_ms: int) -> bool:
        """Read one grant and record it if due; True when this call recorded it."""
        grant = await self._run(self.store.grant, user_id, reference)
        if grant is None or not due(grant, now_ms):
            return False
        if not await self._run(self.store.mark_expired, user_id, grant, now_ms=now_ms):
            return False  # a load recorded it first, or it changed since the read
        if self.on_forfeit is not None:
            self.on_forfeit(user_id, [grant])
        return True

    def _out_of_time(self) -> bool:
        return self._time_left_s is not None and self._time_left_s() <= 0

    async def _hour(self, hour_ms: int, start: int, now: int, counts: list[int]) -> int | None:
        """Sweep the grants of one hour of the index in [start, now]; None when done, else
        where it stopped (out of time, or DynamoDB failed): the expiry of the grant it was
        at, so the next sweep starts there (less the overlap)."""
        from .store import expiry_hour

        pos: int = max(start, hour_ms)
        page: Any = None
        while True:
            if self._out_of_time():
                return pos
            try:
                rows, page = await self._run(self.store.expiring, expiry_hour(hour_ms),
                                             start, now, page)
            except StoreUnavailable as exc:
                log.warning("the expiry sweep could not read the index: %s", exc)
                return pos
            for user_id, reference, expires_ms in rows:
                pos = int(expires_ms)
                if self._out_of_time():
                    return pos
                try:
                    counts[0] += await self._one(user_id, reference, now)
                except StoreUnavailable as exc:
                    log.warning("the expiry sweep could not record a grant: %s", exc)
                    return pos
                counts[1] += 1
            if page is None:
                return None

    async def run(self, *, now_ms: int | None = None, first_span_ms: int = _HOUR_MS,
                  time_left_s: Callable[[], float] | None = None) -> SweepResult:
        """One sweep from the mark (no mark: ``first_span_ms`` back) up to ``now_ms``,
        hour by hour of the expiry index, earliest first; then the mark is moved (never
        back).

        Args:
            now_ms: the sweep's clock (tests).
            first_span_ms: how far back a first sweep (no mark yet) starts.
            time_left_s: the seconds the run may still take; the sweep stops before a grant
                when it is <= 0.

        Never raises for DynamoDB: a failure is logged, and the sweep stops there with its
        mark at the grant it was at (``complete`` False).
        """
        now = int(time.time() * 1000) if now_ms is None else now_ms
        self._time_left_s = time_left_s
        try:
            last = await self._run(self.last_mark)
        except StoreUnavailable as exc:
            log.warning("the expiry sweep could not read its mark: %s", exc)
            return SweepResult(0, 0, now, None, False)
        start = now - first_span_ms if last is None else min(last, now) - OVERLAP_MS
        counts = [0, 0]  # swept, checked
        stopped_at: int | None = None
        for hour_ms in range(start - start % _HOUR_MS, now + 1, _HOUR_MS):  # bound: the span
            stopped_at = await self._hour(hour_ms, start, now, counts)
            if stopped_at is not None:
                log.warning("the expiry sweep stopped after %d grants; the next run "
                            "continues there", counts[1])
                break
        until = now if stopped_at is None else max(stopped_at, last or stopped_at)
        try:
            await self._run(self.set_mark, until)
        except StoreUnavailable as exc:
            log.warning("the expiry sweep could not move its mark: %s", exc)
        return SweepResult(counts[0], counts[1], start, until, stopped_at is None)
