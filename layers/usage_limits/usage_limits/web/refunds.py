"""Refunds that could not be made when their request failed, retried later.

A refund needs Redis. When Redis is down or too slow at the moment a request fails, the
response still goes out (fail closed for new work), and the refund is kept here, in the
execution environment, and tried again before the next request this environment serves.
The same happens when a reservation got no answer: Redis may have made the charge and lost
only its reply, and a refund of a charge that was never made removes nothing.
Environments are reused for many invocations, so most such refunds land within seconds
of Redis coming back; one whose environment is never reused is lost (and logged).

A refund is kept only while the charge it removes can still be the same charge: a request
id can be charged again only after its first charge has left the longest window, so
pending refunds older than that are dropped rather than tried.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import observability as obs

if TYPE_CHECKING:
    from .guard import Charge

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


_pending: list[_Pending] = []


def keep(charge: Charge, longest_window_s: float) -> None:
    """Remember a refund that failed, to be tried again before the next request."""
    now = time.monotonic()
    _pending.append(_Pending(charge, charge.cost, now, now + longest_window_s))
    obs.count(obs.REFUNDS_KEPT)
    if len(_pending) > MAX_PENDING:
        dropped = _pending.pop(0)
        obs.count(obs.REFUNDS_LOST)
        obs.logger().error("pending refund dropped (too many)",
                           extra={"request_id": dropped.charge.request_id})


def pending() -> int:
    """How many refunds wait to be retried."""
    return len(_pending)


async def retry() -> int:
    """Try the pending refunds (oldest first, within ``RETRY_BUDGET_S``); how many landed."""
    if not _pending:
        return 0
    started, landed = time.monotonic(), 0
    for item in list(_pending):
        if time.monotonic() - started > RETRY_BUDGET_S:
            break
        if time.monotonic() > item.keep_until:
            _pending.remove(item)
            obs.count(obs.REFUNDS_LOST)
            obs.logger().error("pending refund expired", extra={
                "request_id": item.charge.request_id})
            continue
        try:
            removed = await item.charge.refund()
        except Exception:
            break  # Redis still unavailable: keep them all for the next request
        _pending.remove(item)
        if removed:  # False: the charge was never made (only its reply was lost) or is gone
            landed += 1
            obs.count(obs.TOKENS_REFUNDED, item.cost)
            obs.logger().info("pending refund made", extra={
                "request_id": item.charge.request_id,
                "delay_s": round(time.monotonic() - item.failed_at, 3)})
    return landed


def clear() -> None:
    """Forget every pending refund (tests)."""
    _pending.clear()
