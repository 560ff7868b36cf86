"""The record of truth of one charge's credit: what it drew from grants and what came back.

Every charge that draws credit has one item in the entitlements table,
``C#<request id>#<nonce>`` (the nonce is the reservation's: a retry of the same request id
served elsewhere is another charge, with its own record). It is written by the draw itself
(``EntitlementStore.commit_draw``, one transaction with ``ADD consumed`` on each grant) and
changed only by lowering the charge (``EntitlementStore.return_credit``: a refund, a settle,
a support refund), in one transaction with ``ADD consumed -n`` on the grants that get credit
back. So, for every grant, at every moment::

    tokens = remaining + consumed
    consumed = sum over the grant's charge records of (drawn - returned - forfeited)

A lowering is idempotent by its target: a record already at or below the new cost is left
as it is, whoever lowered it (a re-sent call, a kept refund, a support refund). A lowering
that finds no record writes a **tombstone** (state ``void``): a draw of that charge whose
write is still on its way (its answer was lost) can then never land, so a charge whose
outcome was unknown is settled for good either way.

This module is pure: it builds and reads the items; the store sends them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..exceptions import InvalidArgument
from .models import check_reference

#: Sort-key prefix of a charge record.
CHARGE_PREFIX = "C#"

ChargeState = Literal["drawn", "lowered", "returned", "void"]
#: What ``commit_draw`` found: the draw is recorded (now or by an earlier attempt), the load
#: epoch moved on (nothing written), or a lowering wrote the charge off first (a tombstone:
#: the draw can never be recorded).
DrawOutcome = Literal["recorded", "stale", "void"]

Pairs = tuple[tuple[str, int], ...]


def charge_sk(request_id: str, nonce: str) -> str:
    """The sort key of the charge record of ``request_id`` made by ``nonce``."""
    return f"{CHARGE_PREFIX}{request_id}#{nonce}"


def check_nonce(nonce: object) -> str:
    """A reservation's nonce as records carry it: printable, no space or ``#``.

    Raises:
        InvalidArgument: anything else.
    """
    if not isinstance(nonce, str) or not nonce or len(nonce) > 64 or not nonce.isprintable() \
            or any(c in nonce for c in " #"):
        raise InvalidArgument("nonce must be 1 to 64 printable characters without spaces or #")
    return nonce


def check_pairs(pairs: Iterable[tuple[str, int]], what: str) -> Pairs:
    """(grant reference, tokens) pairs with positive whole tokens, as given.

    Raises:
        InvalidArgument: a malformed reference or amount.
    """
    out = []
    for reference, tokens in pairs:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise InvalidArgument(f"tokens of a {what} must be positive integers")
        out.append((check_reference(reference), tokens))
    return tuple(out)


def encode_pairs(pairs: Iterable[tuple[str, int]]) -> str:
    """``ref=n ref=n``: a reference holds no space, and may hold ``=`` (the last ``=`` of
    each part separates the amount)."""
    return " ".join(f"{reference}={tokens}" for reference, tokens in pairs)


def decode_pairs(text: str | None) -> Pairs:
    """The pairs of ``encode_pairs``; () for none."""
    if not text:
        return ()
    out = []
    for part in text.split(" "):
        reference, _, tokens = part.rpartition("=")
        out.append((reference, int(tokens)))
    return tuple(out)


def totals(pairs: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Tokens per reference, in first-seen order."""
    out: dict[str, int] = {}
    for reference, tokens in pairs:
        out[reference] = out.get(reference, 0) + tokens
    return out


def split_return(standing: Sequence[tuple[str, int]], delta: int) -> Pairs:
    """What lowering a charge by ``delta`` tokens takes back from its draws.

    The drawn part of a charge goes first: ``min(delta, drawn)`` tokens, taken from the
    draws still standing in reverse draw order (the last grant drawn gets its credit back
    first). The ledger's ``budget_refund.lua`` takes the same amounts from its own copy.

    Args:
        standing: (reference, tokens) still drawn, in draw order.
        delta: tokens the charge is lowered by (>= 0).
    """
    left, out = delta, []
    for reference, tokens in reversed(standing):
        if left <= 0:
            break
        n = min(left, tokens)
        if n > 0:
            out.append((reference, n))
            left -= n
    return tuple(out)


def subtract(pairs: Sequence[tuple[str, int]], *taken: Iterable[tuple[str, int]]) -> Pairs:
    """``pairs`` less every amount in ``taken`` per reference, in ``pairs``' order, from the
    last draw of a reference backwards (the order ``split_return`` takes them)."""
    left = totals(p for group in taken for p in group)
    out: list[tuple[str, int]] = []
    for reference, tokens in reversed(pairs):
        n = min(tokens, left.get(reference, 0))
        left[reference] = left.get(reference, 0) - n
        if tokens - n > 0:
            out.append((reference, tokens - n))
    return tuple(reversed(out))


@dataclass(frozen=True)
class ChargeRecord:
    """One charge's credit as the record of truth holds it.

    Attributes:
        request_id: the charge's request id.
        nonce: the nonce of the reservation that made it.
        cost: tokens the reservation charged.
        kept: tokens charged now (after refunds and settles; 0 once refunded).
        draws: (reference, tokens) drawn, in draw order.
        returned: (reference, tokens) given back to grants since, per reference.
        forfeited: (reference, tokens) that would have gone back to a grant that had
            expired or been voided by then: still consumed, never to come back.
        state: ``drawn``, ``lowered`` (settled below its cost), ``returned`` (refunded
            to 0) or ``void`` (a tombstone: no draw was ever recorded for this charge).
        epoch: the load epoch the draw was recorded under.
        route: the route charged.
        at_ms: when the draw was recorded, ms since the epoch.
        changed_ms: when it was last lowered (None: never).
    """

    request_id: str
    nonce: str
    cost: int
    kept: int
    draws: Pairs
    returned: Pairs = ()
    forfeited: Pairs = ()
    state: ChargeState = "drawn"
    epoch: int = 0
    route: str = ""
    at_ms: int = 0
    changed_ms: int | None = None

    def __post_init__(self) -> None:
        # the record's own invariant, checked wherever one is made or read back
        drawn, back = totals(self.draws), totals((*self.returned, *self.forfeited))
        if any(back.get(r, 0) > n for r, n in drawn.items()) or set(back) - set(drawn):
            raise InvalidArgument(f"charge record {self.request_id!r} gives back more than "
                                  "it drew")
        if not 0 <= self.kept <= self.cost:
            raise InvalidArgument(f"charge record {self.request_id!r} keeps {self.kept} of "
                                  f"{self.cost}")

    @property
    def standing(self) -> Pairs:
        """The draws still consumed by this charge, in draw order (forfeited ones aside:
        they stay consumed, and no lowering takes them again)."""
        return subtract(self.draws, self.returned, self.forfeited)

    @property
    def consumed(self) -> dict[str, int]:
        """Tokens this charge holds consumed per grant: drawn less returned."""
        drawn, returned = totals(self.draws), totals(self.returned)
        return {r: n - returned.get(r, 0) for r, n in drawn.items() if n - returned.get(r, 0)}


def record_of(item: Mapping[str, Any]) -> ChargeRecord:
    """A charge record from its (deserialized) item."""
    changed = item.get("changed_at")
    return ChargeRecord(
        request_id=str(item["request_id"]), nonce=str(item["nonce"]),
        cost=int(item.get("cost", 0)), kept=int(item.get("kept", 0)),
        draws=decode_pairs(item.get("draws")), returned=decode_pairs(item.get("ret")),
        forfeited=decode_pairs(item.get("lost")), state=item.get("state", "drawn"),
        epoch=int(item.get("epoch", 0)), route=str(item.get("route", "")),
        at_ms=int(item.get("at", 0)), changed_ms=None if changed is None else int(changed))


def merged(pairs: Iterable[tuple[str, int]]) -> Pairs:
    """One pair per reference (first-seen order), amounts added."""
    return tuple(totals(pairs).items())
