"""What the entitlements store holds, as frozen records.

Times are integers in ms since the epoch (UTC); ``iso`` turns one into RFC 3339.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from ..exceptions import InvalidArgument

GrantKind = Literal["paid", "promo"]
GRANT_KINDS: tuple[GrantKind, ...] = ("paid", "promo")

#: Longest reason accepted, characters.
MAX_REASON = 500
#: Largest grant, tokens (Lua numbers are exact integers far beyond this).
MAX_GRANT_TOKENS = 10**12
_REFERENCE = re.compile(r"[A-Za-z0-9_.:@/+=-]{1,128}")
#: The latest instant ``iso`` can write, 9999-12-31T23:59:59.999Z, ms since the epoch.
LATEST_MS = 253_402_300_799_999
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def iso(ms: int | None) -> str | None:
    """``ms`` since the epoch as RFC 3339 in UTC with a ``Z`` (None stays None)."""
    if ms is None:
        return None
    # exact: a float of seconds rounds the last millisecond away near the year 9999
    text = (_EPOCH + timedelta(milliseconds=ms)).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


def parse_time(text: str, *, name: str) -> int:
    """An RFC 3339 time with a zone (``2027-01-31T00:00:00Z``) as ms since the epoch.

    Raises:
        InvalidArgument: the text is not a time with a zone, or it is later than
            ``LATEST_MS`` in UTC.
    """
    try:
        moment = datetime.fromisoformat(text.strip().replace("z", "Z"))
    except (ValueError, AttributeError):
        raise InvalidArgument(f"{name} must be an RFC 3339 time such as "
                              f"2027-01-31T00:00:00Z, got {text!r}") from None
    if moment.tzinfo is None:
        raise InvalidArgument(f"{name} must name its time zone (e.g. a trailing Z)")
    # exact integer ms (a float timestamp rounds near the year 9999); the result may still
    # be past what ``iso`` can write once a zone's offset is taken off
    at_ms = (moment - _EPOCH) // timedelta(milliseconds=1)
    if at_ms > LATEST_MS:
        raise InvalidArgument(f"{name} must be at most 9999-12-31T23:59:59.999Z in UTC, "
                              f"got {text!r}")
    return at_ms


def check_reason(reason: object) -> str:
    """A reason for a change: 1 to ``MAX_REASON`` printable characters, trimmed.

    Raises:
        InvalidArgument: missing, blank, too long or not printable.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidArgument("a reason is required for every change")
    text = reason.strip()
    if len(text) > MAX_REASON or not text.isprintable():
        raise InvalidArgument(f"reason must be at most {MAX_REASON} printable characters")
    return text


def check_reference(reference: object) -> str:
    """A grant reference: 1 to 128 of ``A-Z a-z 0-9 _ . : @ / + = -``.

    Raises:
        InvalidArgument: anything else.
    """
    if not isinstance(reference, str) or not _REFERENCE.fullmatch(reference):
        raise InvalidArgument("reference must be 1 to 128 characters of letters, digits and "
                              "_ . : @ / + = -")
    return reference


@dataclass(frozen=True)
class Change:
    """Who made a change and why.

    Attributes:
        actor: the IAM principal (ARN) of the operator, or ``local`` in local mode.
        reason: why, as the operator wrote it.
        at_ms: when, ms since the epoch.
    """

    actor: str
    reason: str
    at_ms: int


@dataclass(frozen=True)
class PlanOverride:
    """An operator's choice of plan for one user.

    Attributes:
        plan: the plan's name.
        change: who set it, why and when.
    """

    plan: str
    change: Change


@dataclass(frozen=True)
class Suspension:
    """A suspended account.

    Attributes:
        reason: why (shown to operators, never to the user).
        until_ms: when it ends by itself (None: until lifted).
        change: who suspended it and when.
    """

    reason: str
    until_ms: int | None
    change: Change

    def active(self, now_ms: int) -> bool:
        """True while the suspension is in force at ``now_ms``."""
        return self.until_ms is None or now_ms < self.until_ms


@dataclass(frozen=True)
class Grant:
    """Extra tokens given to one user.

    Attributes:
        reference: the idempotency reference (an invoice id, a campaign code).
        tokens: the amount granted.
        consumed: how much of it has been drawn (durably recorded).
        kind: ``paid`` or ``promo``.
        expires_at_ms: when it stops covering requests (None: never).
        created: who created it, why and when.
        voided: who voided it, why and when (None: not voided).
        reported: the once-only credit reports a draw from it has made: ``l`` (low),
            ``x`` (exhausted), kept with the grant so that a reload of the cache does not
            make them again (``cache.reported_flags`` decides whether one is re-armed).
        expired_at_ms: when a load or read first saw it expired with tokens unused (and
            reported so, once); None until then.
        forfeited: the unused tokens it ended with at expiry (set with ``expired_at_ms``).
    """

    reference: str
    tokens: int
    consumed: int
    kind: GrantKind
    expires_at_ms: int | None
    created: Change
    voided: Change | None = None
    reported: str = ""
    expired_at_ms: int | None = None
    forfeited: int | None = None

    @property
    def remaining(self) -> int:
        """Tokens left to draw (0 once voided)."""
        return 0 if self.voided is not None else max(0, self.tokens - self.consumed)

    def live(self, now_ms: int) -> bool:
        """True when the grant can still cover requests at ``now_ms``."""
        return (self.voided is None and self.remaining > 0
                and (self.expires_at_ms is None or now_ms < self.expires_at_ms))


@dataclass(frozen=True)
class SupportRefund:
    """An operator's refund of one charge (made at most once).

    Attributes:
        request_id: the ledger's id of the charge.
        claimed: the charge's cost when the refund was asked for, tokens.
        tokens: tokens given back (None while the refund is being made).
        change: who asked for it, why and when.
        nonce: the nonce of the very charge refunded: the refund removes that charge and
            never a later one of the same id ("" on a record that predates it).
        credit: (grant reference, tokens) the refund gave back to grants.
        forfeited: (grant reference, tokens) it could not give back (the grant had
            expired or been voided): still consumed.
    """

    request_id: str
    claimed: int
    tokens: int | None
    change: Change
    nonce: str = ""
    credit: tuple[tuple[str, int], ...] = ()
    forfeited: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class AuditEntry:
    """One operator action, as recorded.

    Attributes:
        user_id: whose entitlements it changed.
        action: ``plan.set``, ``plan.clear``, ``grant.create``, ``grant.void``,
            ``suspension.set``, ``suspension.lift`` or ``refund``.
        change: who, why and when.
        details: what exactly (the plan, the grant's amount, the tokens refunded, ...).
    """

    user_id: str
    action: str
    change: Change
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class UserEntitlements:
    """Everything the store holds for one user (audit log aside).

    Attributes:
        user_id: the user.
        override: the operator's plan override, if any.
        suspension: the suspension, if any (it may have ended: see ``Suspension.active``).
        grants: every grant, voided and spent ones included, oldest first.
    """

    user_id: str
    override: PlanOverride | None = None
    suspension: Suspension | None = None
    grants: tuple[Grant, ...] = ()
