"""Book writes left for later: the voids DynamoDB did not answer, retried before the
execution environment's next request.

Each write is idempotent in the book (a void of a voided transfer answers ``exists``; of
nothing, writes the stub that keeps a late reservation out), so retrying is always safe.
A void that finds the transfer posted (``already_posted``: the post whose answer was lost
had landed, and the request's answer was withheld) reverses it when asked to.

Bounds: at most ``MAX_KEPT`` writes are kept (the oldest is dropped, and logged: the
sweep still voids its transfer once its hold ends, so a dropped void costs time, never
money); before one request at most ``RETRY_BATCH`` are tried, all at once, each within
``RETRY_EACH_S``. An environment that never serves again leaves them to the sweep.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..entitlements.exceptions import StoreUnavailable
from .transfers import Result

if TYPE_CHECKING:
    from .book import TransferBook

log = logging.getLogger("usage_limits.credit")

#: Writes kept per execution environment, at most.
MAX_KEPT = 1000
#: Writes tried before one request, at most, and the time each may take, s.
RETRY_BATCH = 32
RETRY_EACH_S = 0.5


@dataclass(eq=False)
class Write:
    """A void of one transfer, left for later.

    Attributes:
        book: the book to write it to.
        user_id, request_id, nonce: the transfer.
        reverse_posted: reverse it when the void finds it posted (its answer was withheld).
        tries: attempts so far.
    """

    book: TransferBook = field(repr=False)
    user_id: str
    request_id: str
    nonce: str
    reverse_posted: bool = False
    tries: int = 0

    def apply(self) -> Result:
        """Send the void (and the reversal when due); the book's result."""
        answer = self.book.void(self.user_id, self.request_id, self.nonce)
        if answer.result is Result.ALREADY_POSTED and self.reverse_posted:
            return self.book.reverse(self.user_id, self.request_id, self.nonce).result
        return answer.result


_kept: list[Write] = []


def keep(write: Write) -> None:
    """Keep ``write`` to retry before the next request (the oldest goes beyond MAX_KEPT)."""
    _kept.append(write)
    if len(_kept) > MAX_KEPT:
        dropped = _kept.pop(0)
        log.error("a kept void was dropped (too many); the sweep voids its transfer",
                  extra={"request_id": dropped.request_id})


def kept() -> int:
    """How many writes wait."""
    return len(_kept)


async def retry(each_s: float = RETRY_EACH_S, batch: int = RETRY_BATCH) -> int:
    """Try up to ``batch`` kept writes at once, each within ``each_s``; one that fails
    again goes to the back. Returns how many landed."""
    taken, _kept[:batch] = _kept[:batch], []
    results = await asyncio.gather(*(_try(w, each_s) for w in taken))
    return sum(results)


async def _try(write: Write, each_s: float) -> int:
    write.tries += 1
    try:
        async with asyncio.timeout(each_s):
            await asyncio.to_thread(write.apply)
    except (StoreUnavailable, TimeoutError):
        _kept.append(write)
        return 0
    return 1


def clear() -> None:
    """Forget every kept write (tests)."""
    _kept.clear()


__all__ = ["MAX_KEPT", "RETRY_BATCH", "RETRY_EACH_S", "Write", "clear", "keep", "kept", "retry"]
