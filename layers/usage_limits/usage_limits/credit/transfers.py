"""A transfer's life as data: its states, the events that move it, and one pure ``apply``.

A transfer is one charge in the book (``book.TransferBook``): created ``pending`` by a
reservation (with its credit legs), then ``posted`` with what it kept or ``voided``; a
posted transfer may be ``reversed`` by support. These four words are the only names of a
transfer's state anywhere in the code.

A ``pending`` transfer whose hold has ended is **abandoned**: that is derived from
``hold_ms`` and the clock when it is read, never written (as Powertools' idempotency derives
EXPIRED). Any reader treats it as voided; whoever finds it writes the void.

``TRANSITIONS`` is the whole table; ``apply`` looks an event up in it and nothing else. The
book generates every conditional write from the row it gets: the condition is the row's
source state (and its hold), so each transition lands at most once whatever is re-sent.
Re-applying what already happened answers ``exists`` (a success); a refused event is named
for why, as TigerBeetle's ``already_posted`` / ``already_voided``.

    from \\ event   reserve          post             void             reverse
    none           pending          not_found        voided (a stub)  not_found
    pending        exists           posted (hold)    voided           not_posted
    abandoned      expired: void    expired: void    voided           expired: void
    posted         exists           exists           already_posted   reversed
    voided         already_voided   already_voided   exists           already_voided
    reversed       exists           exists           already_reversed exists

A void of a transfer that does not exist writes a voided stub: a reservation of it whose
answer was lost can then never land (its create is conditioned on the item being absent).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class State(StrEnum):
    """Where a transfer stands, as its item's ``state`` holds it."""

    PENDING = "pending"
    POSTED = "posted"
    VOIDED = "voided"
    REVERSED = "reversed"


class Event(StrEnum):
    """What may happen to a transfer."""

    RESERVE = "reserve"
    POST = "post"
    VOID = "void"
    REVERSE = "reverse"


class Result(StrEnum):
    """The answer to an event: ``applied`` and ``exists`` are successes, the rest refusals.

    ``exceeds_credit`` is the book's answer to a reservation whose legs the grants cannot
    cover; every other result comes from ``TRANSITIONS``.
    """

    APPLIED = "applied"
    EXISTS = "exists"
    NOT_FOUND = "not_found"
    NOT_POSTED = "not_posted"
    EXPIRED = "expired"
    ALREADY_POSTED = "already_posted"
    ALREADY_VOIDED = "already_voided"
    ALREADY_REVERSED = "already_reversed"
    EXCEEDS_CREDIT = "exceeds_credit"

    @property
    def ok(self) -> bool:
        """True for ``applied`` and ``exists``: what was asked for has happened."""
        return self in (Result.APPLIED, Result.EXISTS)


#: The hold a write is conditioned on: ``live`` (``hold_ms > now``: a post must land while
#: its request may still post), ``past`` (``hold_ms <= now``: the void of an abandoned
#: transfer never voids one whose request is still running) or ``any``.
Hold = Literal["live", "past", "any"]


@dataclass(frozen=True)
class Transition:
    """One row of the table.

    Attributes:
        source: the state the transfer is in (None: no item).
        abandoned: the row is for a pending transfer past its hold (derived).
        event: what happens.
        target: the state written (None, or equal to ``source``: nothing is written).
        result: the answer.
        hold: the hold the write is conditioned on, besides the source state.
    """

    source: State | None
    abandoned: bool
    event: Event
    target: State | None
    result: Result
    hold: Hold = "any"

    @property
    def writes(self) -> bool:
        """True when the transition writes the item (its target differs from its source)."""
        return self.target is not None and self.target != self.source


_P, _O, _V, _R = State.PENDING, State.POSTED, State.VOIDED, State.REVERSED
_RES, _POST, _VOID, _REV = Event.RESERVE, Event.POST, Event.VOID, Event.REVERSE
_A, _X = Result.APPLIED, Result.EXISTS

#: Every transition, as data (the module docstring draws the same table).
TRANSITIONS: tuple[Transition, ...] = (
    Transition(None, False, _RES, _P, _A),
    Transition(None, False, _POST, None, Result.NOT_FOUND),
    Transition(None, False, _VOID, _V, _A),
    Transition(None, False, _REV, None, Result.NOT_FOUND),
    Transition(_P, False, _RES, _P, _X),
    Transition(_P, False, _POST, _O, _A, hold="live"),
    Transition(_P, False, _VOID, _V, _A),
    Transition(_P, False, _REV, _P, Result.NOT_POSTED),
    Transition(_P, True, _RES, _V, Result.EXPIRED, hold="past"),
    Transition(_P, True, _POST, _V, Result.EXPIRED, hold="past"),
    Transition(_P, True, _VOID, _V, _A),
    Transition(_P, True, _REV, _V, Result.EXPIRED, hold="past"),
    Transition(_O, False, _RES, _O, _X),
    Transition(_O, False, _POST, _O, _X),
    Transition(_O, False, _VOID, _O, Result.ALREADY_POSTED),
    Transition(_O, False, _REV, _R, _A),
    Transition(_V, False, _RES, _V, Result.ALREADY_VOIDED),
    Transition(_V, False, _POST, _V, Result.ALREADY_VOIDED),
    Transition(_V, False, _VOID, _V, _X),
    Transition(_V, False, _REV, _V, Result.ALREADY_VOIDED),
    Transition(_R, False, _RES, _R, _X),
    Transition(_R, False, _POST, _R, _X),
    Transition(_R, False, _VOID, _R, Result.ALREADY_REVERSED),
    Transition(_R, False, _REV, _R, _X),
)

_BY_KEY = {(t.source, t.abandoned, t.event): t for t in TRANSITIONS}


def apply(state: State | None, event: Event, *, abandoned: bool = False) -> Transition:
    """The transition ``event`` makes from ``state`` (None: no item), pure.

    Args:
        state: the transfer's state as read.
        event: what happens.
        abandoned: the transfer is pending and its hold has ended (ignored otherwise).

    Returns:
        The row of ``TRANSITIONS``: its ``result`` is the answer, and ``writes`` says
        whether the item must be written (to ``target``, conditioned on ``source``).
    """
    return _BY_KEY[(state, abandoned and state is State.PENDING, event)]


__all__ = ["TRANSITIONS", "Event", "Hold", "Result", "State", "Transition", "apply"]
