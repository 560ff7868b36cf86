"""One request's transfer, as the request path drives it: reserve, then post or void.

The windows (Redis) decide whether a request fits the plan and how much of its cost falls
beyond the quota; this module decides the money, in the book only:

    reserve(credit)  the transfer pending, with legs for the credit part (one DynamoDB call;
                     a stale grant hint costs one refused write and one re-read)
    post(kept)       the request succeeded: posted, keeping ``kept`` (one call)
    void()           the request failed, or was refused: voided, every leg back (one call)

So a request that draws credit makes two DynamoDB calls whether it succeeds or fails. A
call whose outcome is unknown (DynamoDB did not answer) is settled so that the answer can
tell the truth: a reservation is voided at once (a void of nothing writes a stub, so the
reservation can never land later); when that cannot be done either, the void goes to the
outbox (``outbox``) and the answer says the request may have been charged. A post that
does not answer is sent once more; still unknown, the request's answer is withheld and the
outbox voids the transfer, or reverses it when the post had landed.

A request killed mid-way leaves its transfer pending: it is abandoned once its hold ends,
and whoever finds it voids it (``abandoned_of``: the user's next load of the cache reads
the user's shard of the ``pending`` index; the sweep reads all shards).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from ..entitlements.exceptions import StoreUnavailable
from ..entitlements.models import Grant
from . import outbox
from .book import Answer, Transfer, TransferBook, shard_of
from .transfers import Result

#: What the request may answer after ``reserve``:
#:   go        the transfer is pending: call the provider
#:   refused   the grants cannot cover the credit part (``credit`` says what they hold):
#:             nothing was charged
#:   undone    the reservation was voided (its outcome was unknown, or a void came
#:             first): nothing was charged
#:   unknown   DynamoDB answered neither the reservation nor its void: the void is kept
#:             in the outbox; the request may have been charged
Opening = Literal["go", "refused", "undone", "unknown"]
#: What the request may answer after ``post``:
#:   posted    serve the answer
#:   voided    the transfer was voided first (its hold ended): withhold the answer,
#:             nothing was charged
#:   unknown   the post did not answer twice: withhold the answer; the outbox voids (or
#:             reverses) it
Closing = Literal["posted", "voided", "unknown"]


@dataclass(frozen=True)
class Opened:
    """The outcome of ``RequestTransfer.reserve``.

    Attributes:
        outcome: ``Opening``.
        credit: the credit the book last read (set for ``refused``), else None.
        grants: the grants the book re-read (a stale hint): the new hint, else ().
        transfer: the pending transfer (``go``), else None.
    """

    outcome: Opening
    credit: int | None = None
    grants: tuple[Grant, ...] = ()
    transfer: Transfer | None = None


class RequestTransfer:
    """The transfer of one request (user, request id, reservation nonce).

    Args:
        book: the book.
        user_id, request_id, nonce: whose request, which id, which reservation of it.
        route, plan, idem: recorded on the transfer.
        hold_ms: until when the request may post, ms since the epoch.
    """

    def __init__(self, book: TransferBook, user_id: str, request_id: str, nonce: str, *,
                 hold_ms: int, route: str = "", plan: str = "",
                 idem: str | None = None) -> None:
        self.book = book
        self.user_id, self.request_id, self.nonce = user_id, request_id, nonce
        self.hold_ms, self.route, self.plan, self.idem = hold_ms, route, plan, idem
        self.transfer: Transfer | None = None

    async def reserve(self, cost: int, credit: int,
                      grants: tuple[Grant, ...] | None = None) -> Opened:
        """Make the transfer pending, drawing ``credit`` of ``cost`` from grants."""
        try:
            answer: Answer = await asyncio.to_thread(
                self.book.reserve, self.user_id, self.request_id, self.nonce, reserved=cost,
                credit=credit, hold_ms=self.hold_ms, route=self.route, plan=self.plan,
                idem=self.idem, grants=grants)
        except StoreUnavailable:
            return Opened(await self._undo())
        if answer.ok:
            self.transfer = answer.transfer
            return Opened("go", grants=answer.grants, transfer=answer.transfer)
        if answer.result is Result.EXCEEDS_CREDIT:
            return Opened("refused", credit=answer.credit, grants=answer.grants)
        return Opened("undone")  # already_voided, expired: a void came first

    async def _undo(self) -> Opening:
        """Void a reservation whose outcome is unknown: ``undone`` once that is known."""
        try:
            voided = await asyncio.to_thread(self.book.void, self.user_id, self.request_id,
                                             self.nonce)
        except StoreUnavailable:
            outbox.keep(outbox.Write(self.book, self.user_id, self.request_id, self.nonce))
            return "unknown"
        return "undone" if voided.ok else "unknown"

    async def post(self, kept: int) -> Closing:
        """Post the transfer keeping ``kept`` tokens (the request succeeded)."""
        if self.transfer is None:
            raise StoreUnavailable("post of a transfer that was never reserved")
        for _ in range(2):  # a re-send after a lost answer is answered ``exists``
            try:
                answer = await asyncio.to_thread(self.book.post, self.transfer, kept)
            except StoreUnavailable:
                continue
            return "posted" if answer.ok else "voided"
        outbox.keep(outbox.Write(self.book, self.user_id, self.request_id, self.nonce,
                                 reverse_posted=True))
        return "unknown"

    async def void(self) -> bool:
        """Void the transfer (the request failed).

        Returns:
            True when it is voided (now or before); False when it is not: DynamoDB did not
            answer (the void is kept in the outbox), or it was posted already.
        """
        try:
            answer = await asyncio.to_thread(self.book.void, self.user_id, self.request_id,
                                             self.nonce, known=self.transfer)
        except StoreUnavailable:
            outbox.keep(outbox.Write(self.book, self.user_id, self.request_id, self.nonce))
            return False
        return answer.ok


def abandoned_of(book: TransferBook, user_id: str, now_ms: int) -> int:
    """Void the user's pending transfers past their hold (the user's shard of the
    ``pending`` index, filtered to the user). Returns how many this call voided.

    Raises:
        StoreUnavailable: DynamoDB failed (nothing is lost: the sweep finds them too).
    """
    voided = 0
    for user, rid, nonce in book.abandoned(shard_of(user_id), now_ms, user_id=user_id):
        voided += book.resolve_abandoned(user, rid, nonce, now_ms=now_ms).result \
            is Result.APPLIED
    return voided


__all__ = ["Closing", "Opened", "Opening", "RequestTransfer", "abandoned_of"]
