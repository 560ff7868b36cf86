"""Refunds that could not be made when their request failed, retried later.

A refund needs Redis. When Redis is down or too slow at the moment a request fails, the
response still goes out (fail closed for new work), and the refund is kept here, in the
execution environment, and tried again before the next request this environment serves.
The same happens when a reservation got no answer: Redis may have made the charge and lost
only its reply.
Environments are reused for many invocations, so most such refunds land within seconds
of Redis coming back; one whose environment is never reused is lost (and logged).

A kept refund can run long after its request, when the same request id may have been
charged again: the client retried with the same ``Idempotency-Key`` and another
environment served it. The refund carries the nonce of the reservation that made (or may
have made) its charge, and the ledger lowers a charge only when that nonce matches, so a
kept refund removes its own charge or nothing. A refund of a charge that was never made
removes nothing. A refund is kept at most as long as the longest window: by then its charge
has left every window and there is nothing left to give back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import observability as obs

if TYPE_CHECKING:
    from .charge import Charge

#: Pending refunds kept per execution environment; beyond that the oldest are dropped.
MAX_PENDING = 1000
#: Time spent on pending refunds before a request, at most.
RETRY_BUDGET_S = 0.2


@dataclass
class _Pending:
    charge: Charge
    cost: int
    failed_at: float
    keep_until: float
    #: the cost to lower the charge to: 0 for a refund, the actual cost for a settle
    target: int = 0


_pending: list[_Pending] = []


def keep(charge: Charge, longest_window_s: float, *, target: int = 0) -> None:
    """Remember a refund (or a settle to ``target``) that failed, to be tried again before
    the next request."""
    now = time.monotonic()
    _pending.append(_Pending(charge, charge.cost, now, now + longest_window_s, target))
    obs.count(obs.REFUNDS_KEPT)
    if len(_pending) > MAX_PENDING:
        dropped = _pending.pop(0)
        obs.count(obs.REFUNDS_LOST)
        obs.logger().error("pending refund dropped (too many)",
                           extra={"request_id": dropped.charge.request_id})


def pending() -> int:
    """How many refunds wait to be retried."""
    return len(_pending)


async def retry(budget_s: float = RETRY_BUDGET_S) -> int:
    """Try the pending refunds, oldest first, within ``budget_s`` seconds in all.

    A refund that fails or runs out of time stays pending, and the next one is tried while
    time is left: one refund that keeps failing holds up none of the others. A refund is
    taken out of the list while it is tried, so requests served at once (a local server
    with several workers) never try the same one twice.

    Returns:
        How many refunds removed a charge.
    """
    if not _pending:
        return 0
    end, landed = time.monotonic() + budget_s, 0
    for item in list(_pending):
        left = end - time.monotonic()
        if left <= 0:
            break
        if not _take(item):
            continue  # another request is trying it, or has made it
        if time.monotonic() > item.keep_until:
            obs.count(obs.REFUNDS_LOST)
            obs.logger().error("pending refund expired", extra={
                "request_id": item.charge.request_id})
            continue
        try:
            async with asyncio.timeout(left):
                removed = await item.charge.lower_to(item.target)
        except Exception:  # Redis still unavailable or too slow (TimeoutError): keep it
            obs.logger().warning("pending refund failed again; kept", extra={
                "request_id": item.charge.request_id})
            _put_back(item)
            continue
        if removed:  # False: the charge was never made (only its reply was lost) or is gone
            landed += 1
            obs.count(obs.TOKENS_REFUNDED, item.cost)
            obs.logger().info("pending refund made", extra={
                "request_id": item.charge.request_id,
                "delay_s": round(time.monotonic() - item.failed_at, 3)})
    return landed


def _take(item: _Pending) -> bool:
    """Remove ``item`` itself from the pending list; False when it is no longer there."""
    for i, other in enumerate(_pending):
        if other is item:
            del _pending[i]
            return True
    return False


def _put_back(item: _Pending) -> None:
    """Return a refund that failed again to its place among the pending ones (by age)."""
    at = next((i for i, other in enumerate(_pending) if other.failed_at > item.failed_at),
              len(_pending))
    _pending.insert(at, item)


def clear() -> None:
    """Forget every pending refund (tests)."""
    _pending.clear()
