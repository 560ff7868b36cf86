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

Bounds: before a request, at most ``RETRY_BATCH`` kept refunds are tried, all at once, each
within its own ``RETRY_EACH_S``, so the retry takes at most that long whatever Redis does.
A refund bound for a server that accepts and never answers (a cluster shard down) uses its
own bound and no other's, and goes to the back of the queue: the refunds bound for the other
shards are tried and land meanwhile, and with more than ``RETRY_BATCH`` kept, every one
gets its turn.
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
#: The longest one kept refund may take before a request; they run at once, so this also
#: bounds the whole retry.
RETRY_EACH_S = 0.2
#: Kept refunds tried before one request, at most (the oldest first).
RETRY_BATCH = 32


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
        dropped = min(_pending, key=lambda item: item.failed_at)
        _pending.remove(dropped)
        obs.count(obs.REFUNDS_LOST)
        obs.logger().error("pending refund dropped (too many)",
                           extra={"request_id": dropped.charge.request_id})


def pending() -> int:
    """How many refunds wait to be retried."""
    return len(_pending)


async def retry(each_s: float = RETRY_EACH_S, batch: int = RETRY_BATCH) -> int:
    """Try up to ``batch`` pending refunds, oldest first, at once, each within ``each_s``.

    A refund that fails or runs out of its time goes to the back of the pending list: one
    that keeps failing holds up none of the others, now or at the next request. A refund is
    taken out of the list while it is tried, so requests served at once (a local server
    with several workers) never try the same one twice.

    Returns:
        How many refunds removed a charge.
    """
    if not _pending:
        return 0
    now, tried = time.monotonic(), []
    for item in list(_pending[:batch]):
        if not _take(item):
            continue  # another request is trying it, or has made it
        if now > item.keep_until:
            obs.count(obs.REFUNDS_LOST)
            obs.logger().error("pending refund expired", extra={
                "request_id": item.charge.request_id})
            continue
        tried.append(item)
    return sum(await asyncio.gather(*(_try(item, each_s) for item in tried)))


async def _try(item: _Pending, each_s: float) -> int:
    """Make one kept refund within ``each_s``; 1 when it removed a charge, else 0."""
    try:
        async with asyncio.timeout(each_s):
            removed = await item.charge.lower_to(item.target)
    except Exception:  # Redis still unavailable or too slow (TimeoutError): keep it
        obs.logger().warning("pending refund failed again; kept", extra={
            "request_id": item.charge.request_id})
        _pending.append(item)  # behind the others: they get their turn first
        return 0
    if not removed:  # the charge was never made (only its reply was lost) or is gone
        return 0
    obs.count(obs.TOKENS_REFUNDED, item.cost)
    obs.logger().info("pending refund made", extra={
        "request_id": item.charge.request_id,
        "delay_s": round(time.monotonic() - item.failed_at, 3)})
    return 1


def _take(item: _Pending) -> bool:
    """Remove ``item`` itself from the pending list; False when it is no longer there."""
    for i, other in enumerate(_pending):
        if other is item:
            del _pending[i]
            return True
    return False


def clear() -> None:
    """Forget every pending refund (tests)."""
    _pending.clear()
