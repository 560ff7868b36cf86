"""A transfer's credit legs: which grants a charge draws from, and what comes back. Pure.

Draw order (kept from the ledger before transfers): earliest expiry first (grants without
expiry last), ``promo`` before ``paid`` at equal expiry, older first, then by reference.
Credit given back comes off the legs in reverse draw order: the last grant drawn is the
first refilled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..entitlements.models import Grant


@dataclass(frozen=True)
class Leg:
    """Tokens one transfer drew from one grant.

    Attributes:
        grant: the grant's reference.
        tokens: how many.
    """

    grant: str
    tokens: int


@dataclass(frozen=True)
class Back:
    """Credit of one grant's leg that left a transfer.

    Attributes:
        grant: the grant's reference.
        returned: tokens given back to the grant (``ADD consumed -n``).
        forfeited: tokens that could not be (the grant was voided or had expired): they
            stay consumed.
    """

    grant: str
    returned: int = 0
    forfeited: int = 0


def live(grant: Grant, now_ms: int) -> bool:
    """True when ``grant`` can be drawn from or given back to at ``now_ms``."""
    return grant.voided is None and (grant.expires_at_ms is None or now_ms < grant.expires_at_ms)


def draw_order(grant: Grant) -> tuple[float, bool, int, str]:
    """The sort key of the draw order."""
    expires = math.inf if grant.expires_at_ms is None else float(grant.expires_at_ms)
    return (expires, grant.kind != "promo", grant.created.at_ms, grant.reference)


def balance(grants: Iterable[Grant], now_ms: int) -> int:
    """The credit spendable at ``now_ms``: the remaining tokens of the live grants."""
    return sum(g.remaining for g in grants if live(g, now_ms))


#: Legs one transfer may have: with its item (and a support reversal's record and audit
#: entry) they must fit one DynamoDB transaction (100 items); a charge needing more grants
#: than this is refused as if the credit were short.
MAX_LEGS = 32


def plan_legs(grants: Iterable[Grant], tokens: int, now_ms: int) -> tuple[Leg, ...]:
    """The legs that draw ``tokens`` from ``grants`` in draw order, at most ``MAX_LEGS``
    (fewer tokens when the live grants hold less: the caller compares ``drawn(legs)``
    with what it needs)."""
    legs: list[Leg] = []
    need = tokens
    for grant in sorted((g for g in grants if live(g, now_ms)), key=draw_order):
        if need <= 0 or len(legs) == MAX_LEGS:
            break
        take = min(need, grant.remaining)
        if take > 0:
            legs.append(Leg(grant.reference, take))
            need -= take
    return tuple(legs)


def drawn(legs: Iterable[Leg]) -> int:
    """The tokens the legs drew."""
    return sum(leg.tokens for leg in legs)


def standing(legs: Sequence[Leg], back: Iterable[Back]) -> tuple[Leg, ...]:
    """What is still drawn on each leg's grant after ``back``, in draw order (merged per
    grant; grants with nothing left dropped)."""
    left: dict[str, int] = {}
    for leg in legs:
        left[leg.grant] = left.get(leg.grant, 0) + leg.tokens
    for b in back:
        left[b.grant] = left.get(b.grant, 0) - b.returned - b.forfeited
    return tuple(Leg(g, n) for g, n in left.items() if n > 0)


def give_back(legs: Sequence[Leg], back: Sequence[Back], tokens: int) -> tuple[Leg, ...]:
    """The parts of ``tokens`` of credit that leave the transfer, taken from what still
    stands on its legs in reverse draw order (at most what stands)."""
    out: list[Leg] = []
    need = tokens
    for leg in reversed(standing(legs, back)):
        if need <= 0:
            break
        take = min(need, leg.tokens)
        out.append(Leg(leg.grant, take))
        need -= take
    return tuple(out)


def consumed_by(transfers: Iterable[tuple[Sequence[Leg], Sequence[Back]]]) -> dict[str, int]:
    """Per grant, its legs less what was returned to it over the given transfers' (legs,
    back): what the grant's ``consumed`` must equal over every transfer that drew on it
    (the auditor's check). Forfeited credit stays consumed."""
    out: dict[str, int] = {}
    for legs, back in transfers:
        for leg in legs:
            out[leg.grant] = out.get(leg.grant, 0) + leg.tokens
        for b in back:
            out[b.grant] = out.get(b.grant, 0) - b.returned
    return out


def merge_back(back: Iterable[Back], more: Iterable[Back]) -> tuple[Back, ...]:
    """``back`` with ``more`` added, one entry per grant, first-seen order."""
    merged: dict[str, Back] = {}
    for b in (*back, *more):
        was = merged.get(b.grant, Back(b.grant))
        merged[b.grant] = Back(b.grant, was.returned + b.returned, was.forfeited + b.forfeited)
    return tuple(merged.values())


__all__ = ["MAX_LEGS", "Back", "Leg", "balance", "consumed_by", "draw_order", "drawn",
           "give_back", "live", "merge_back", "plan_legs", "standing"]
