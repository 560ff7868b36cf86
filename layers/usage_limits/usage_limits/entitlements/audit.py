"""The conservation auditor's checks: do the books of one user balance? (pure)

Three things must hold for every user, at every moment, up to what is still on its way:

1. **Grants.** For every grant, ``tokens = remaining + consumed`` with both >= 0, and
   ``consumed`` is the sum of what its charge records (``C#<rid>#<nonce>``, ``charges``)
   hold consumed: drawn less returned (a forfeited part stays consumed).
2. **The cached credit.** The credit the Redis copy of the user's grants would let them
   spend equals DynamoDB's, less the draws made on that copy whose records have not landed
   yet (a draw is recorded before its provider is called, so a charge younger than the
   write bound may be among them). No copy, or a copy not loaded, is fine: the next request
   loads DynamoDB's.
3. **Usage records.** Every charge the ledger counts has a usage record in state
   ``charged`` or ``settled`` with the same cost, and every such record inside the ledger's
   longest window, older than the write bound, is counted by the ledger. A ledger that holds
   nothing at all (the cache was dropped) has nothing to compare: a note says so.

Each check takes what the reader read and returns ``Divergence`` items: the user, the
request ids or grant reference, the kind, the tokens, and the CLI command that fixes it (for
a person). ``auditor`` reads, re-checks what diverged and writes the report; nothing here
reads or writes anything.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from .charges import ChargeRecord, decode_pairs
from .models import Grant

#: What diverged.
#:   grant_unbalanced     a grant's consumed is below 0 or above its tokens
#:   grant_consumed       a grant's consumed is not the sum its charge records hold
#:   credit_excess        the cached copy lets the user spend more than DynamoDB holds
#:   credit_short         the cached copy holds less credit than DynamoDB (the user lost it)
#:   draw_unrecorded      a charge the ledger counts drew credit that no record holds
#:   record_missing       a charge the ledger counts has no usage record
#:   record_refunded      a charge the ledger counts has a refunded usage record
#:   record_cost          a charge's usage record keeps another cost than the ledger
#:   record_not_counted   a charged or settled usage record the ledger does not count
Kind = Literal["grant_unbalanced", "grant_consumed", "credit_excess", "credit_short",
               "draw_unrecorded", "record_missing", "record_refunded", "record_cost",
               "record_not_counted"]
KINDS: tuple[Kind, ...] = ("grant_unbalanced", "grant_consumed", "credit_excess",
                           "credit_short", "draw_unrecorded", "record_missing",
                           "record_refunded", "record_cost", "record_not_counted")
#: Usage-record states in which a charge still stands.
STANDING_STATES = ("charged", "settled")
#: Usage-record states of a charge given back.
REFUNDED_STATES = ("refunded", "support-refunded")
#: A charge's ledger instant and its record's may differ by this much, ms (the ledger's
#: clock is clamped per user; the record takes the function's).
CLOCK_SLACK_MS = 60_000


@dataclass(frozen=True)
class Divergence:
    """One thing that does not balance.

    Attributes:
        kind: what diverged (``KINDS``).
        user_id: the user.
        tokens: how many tokens are off (> 0).
        request_ids: the charges concerned (may be empty for a grant's sum).
        reference: the grant concerned ('' when none).
        detail: what was found, in words.
        fix: the CLI command (or commands) a person runs to fix it.
        repaired: the auditor fixed it itself (only a provably missing usage record).
        nonce: the reservation's nonce, when it concerns one charge ('' otherwise).
    """

    kind: Kind
    user_id: str
    tokens: int
    request_ids: tuple[str, ...] = ()
    reference: str = ""
    detail: str = ""
    fix: str = ""
    repaired: bool = False
    nonce: str = ""

    def key(self) -> tuple[str, str, str, tuple[str, ...]]:
        """What identifies it across two reads (the tokens may move meanwhile)."""
        return (self.kind, self.user_id, self.reference, self.request_ids)

    def to_json(self) -> dict[str, Any]:
        """As the report's JSON shows it."""
        out = asdict(self)
        out["request_ids"] = list(self.request_ids)
        return out


@dataclass(frozen=True)
class LedgerCharge:
    """One charge the ledger counts (``budget_audit_read.lua``).

    Attributes:
        request_id: its request id.
        nonce: the reservation's nonce.
        cost: tokens it holds now.
        at_ms: its instant on the ledger's clock.
        route: the route charged.
        draws: (reference, tokens) drawn from grants; () none.
        draw_epoch: the copy's epoch the draws were made on (0: none).
    """

    request_id: str
    nonce: str
    cost: int
    at_ms: int
    route: str = ""
    draws: tuple[tuple[str, int], ...] = ()
    draw_epoch: int = 0


@dataclass(frozen=True)
class CachedGrant:
    """A grant as the cached copy holds it.

    Attributes:
        reference: the grant.
        remaining: tokens the copy lets the user draw.
        expires_at_ms: its end (None: never).
    """

    reference: str
    remaining: int
    expires_at_ms: int | None


@dataclass(frozen=True)
class LedgerView:
    """What the ledger (Redis) holds of one user, read in one atomic call.

    Attributes:
        clock_ms: the ledger's clock for the user (0: no keys).
        longest_ms: the longest window the ledger keeps (0: it holds nothing of the user).
        epoch: the cached copy's load epoch (0: not loaded, -1: no copy).
        grants: the copy's grants (empty unless loaded).
        charges: the charges counted, newest first.
        truncated: more charges are counted than were read.
    """

    clock_ms: int
    longest_ms: int
    epoch: int
    grants: tuple[CachedGrant, ...] = ()
    charges: tuple[LedgerCharge, ...] = ()
    truncated: bool = False

    @property
    def empty(self) -> bool:
        """The ledger holds nothing of the user (never seen, expired, or dropped)."""
        return self.longest_ms == 0


class UsageRecordLike(Protocol):
    """What the checks read of a usage record (``usage.UsageRecord``)."""

    @property
    def request_id(self) -> str: ...
    @property
    def nonce(self) -> str: ...
    @property
    def kept(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def at_ms(self) -> int: ...


def _q(text: str) -> str:
    return shlex.quote(text)


def _audit_cmd(user_id: str) -> str:
    return f"atto-admin audit --user {_q(user_id)}"


def charge_holdings(records: Iterable[ChargeRecord]) -> dict[str, int]:
    """Tokens the charge records hold consumed, per grant."""
    held: dict[str, int] = {}
    for record in records:
        for reference, tokens in record.consumed.items():
            held[reference] = held.get(reference, 0) + tokens
    return held


def check_grants(user_id: str, grants: Sequence[Grant], records: Sequence[ChargeRecord], *,
                 records_since_ms: int = 0) -> list[Divergence]:
    """Check 1: every grant's ``tokens = remaining + consumed`` and ``consumed`` = its
    charge records' holdings.

    Args:
        grants: the user's grants (``EntitlementStore.load``).
        records: the user's charge records (``EntitlementStore.charge_records``).
        records_since_ms: charge records older than this may be gone (their TTL): a grant
            created before it is only checked for holding at least what its records hold.
    """
    held = charge_holdings(records)
    out: list[Divergence] = []
    for g in grants:
        remaining = g.tokens - g.consumed
        if g.consumed < 0 or remaining < 0:
            out.append(Divergence(
                "grant_unbalanced", user_id, abs(min(g.consumed, remaining)),
                reference=g.reference,
                detail=f"tokens {g.tokens} = remaining {remaining} + consumed {g.consumed}",
                fix=f"atto-admin show {_q(user_id)}  # then correct the grant by hand"))
        drawn = held.pop(g.reference, 0)
        old = g.created.at_ms < records_since_ms
        if drawn != g.consumed and not (old and drawn < g.consumed):
            ids = tuple(sorted({r.request_id for r in records if g.reference in r.consumed}))
            out.append(Divergence(
                "grant_consumed", user_id, abs(drawn - g.consumed), ids[:20],
                reference=g.reference,
                detail=f"consumed {g.consumed}, its charge records hold {drawn}",
                fix=f"atto-admin show {_q(user_id)}  # compare with "
                    f"atto-admin statement {_q(user_id)}; correct the grant by hand"))
    for reference, drawn in held.items():
        if drawn:
            ids = tuple(sorted({r.request_id for r in records if reference in r.consumed}))
            out.append(Divergence(
                "grant_consumed", user_id, drawn, ids[:20], reference=reference,
                detail=f"charge records hold {drawn} of a grant that does not exist",
                fix=f"atto-admin show {_q(user_id)}"))
    return out


def _live(g: Grant, now_ms: int) -> bool:
    return g.voided is None and (g.expires_at_ms is None or now_ms < g.expires_at_ms)


def pending_draws(view: LedgerView, recorded: Iterable[tuple[str, str]], now_ms: int,
                  write_bound_ms: int) -> tuple[dict[str, int], list[LedgerCharge]]:
    """Draws on the cached copy that no charge record holds.

    Returns:
        (tokens per grant of those younger than the write bound: still on their way;
        the older ones: a divergence of their own).
    """
    have = set(recorded)
    young: dict[str, int] = {}
    old: list[LedgerCharge] = []
    for c in view.charges:
        if not c.draws or (c.request_id, c.nonce) in have:
            continue
        if c.at_ms >= now_ms - write_bound_ms:
            if c.draw_epoch == view.epoch:
                for reference, tokens in c.draws:
                    young[reference] = young.get(reference, 0) + tokens
        else:
            old.append(c)
    return young, old


def check_credit(user_id: str, grants: Sequence[Grant], view: LedgerView,
                 records: Sequence[ChargeRecord], now_ms: int, *,
                 write_bound_ms: int) -> tuple[list[Divergence], list[str]]:
    """Check 2: the credit the cached copy would let the user spend is DynamoDB's, less
    the draws on the copy still on their way to their records.

    Returns:
        (divergences, notes): a copy that is absent or not loaded is a note, not a
        divergence.
    """
    if view.epoch <= 0:
        return [], ["no cached copy of the entitlements: credit not compared (the next "
                    "request loads it from DynamoDB)"]
    young, old = pending_draws(view, ((r.request_id, r.nonce) for r in records), now_ms,
                               write_bound_ms)
    out: list[Divergence] = []
    for c in old:
        out.append(Divergence(
            "draw_unrecorded", user_id, sum(n for _, n in c.draws), (c.request_id,),
            reference=",".join(r for r, _ in c.draws),
            detail="the ledger counts a charge that drew credit no charge record holds",
            fix=f"atto-admin refund {_q(user_id)} {_q(c.request_id)} --reason "
                "'books: a draw without its record'"))
    truth = {g.reference: g.tokens - g.consumed for g in grants if _live(g, now_ms)}
    cached = {g.reference: g.remaining for g in view.grants
              if g.expires_at_ms is None or now_ms < g.expires_at_ms}
    reload = (f"atto-admin reload {_q(user_id)} --reason 'books: the cached credit "
              "differs from DynamoDB'")
    for reference in sorted(set(truth) | set(cached)):
        want = max(0, truth.get(reference, 0) - young.get(reference, 0))
        have = cached.get(reference, 0)
        if have > want:
            out.append(Divergence(
                "credit_excess", user_id, have - want, reference=reference,
                detail=f"the cached copy holds {have}, DynamoDB {truth.get(reference, 0)}"
                       f" less {young.get(reference, 0)} on its way",
                fix=reload))
        elif have < want:
            out.append(Divergence(
                "credit_short", user_id, want - have, reference=reference,
                detail=f"the cached copy holds {have}, DynamoDB {truth.get(reference, 0)}"
                       f" less {young.get(reference, 0)} on its way",
                fix=reload))
    return out, []


def check_records(user_id: str, view: LedgerView, records: Sequence[UsageRecordLike],
                  now_ms: int, *, write_bound_ms: int) -> tuple[list[Divergence], list[str]]:
    """Check 3: the ledger's charges and the usage records match, both ways.

    Args:
        records: the user's usage records from the ledger's longest window on.

    Returns:
        (divergences, notes). A ``record_missing`` older than the write bound is for the
        caller to repair when a charge record proves it.
    """
    if view.empty:
        return [], ["the ledger holds nothing of the user (never seen, expired or dropped): "
                    "usage records not compared"]
    notes = ["the ledger counts more charges than were read: the oldest not compared"] \
        if view.truncated else []
    by_id = {(r.request_id, r.nonce): r for r in records}
    counted = {(c.request_id, c.nonce) for c in view.charges}
    bound = now_ms - write_bound_ms
    out: list[Divergence] = []
    for c in view.charges:
        r = by_id.get((c.request_id, c.nonce))
        if r is None:
            if c.at_ms < bound:
                out.append(Divergence(
                    "record_missing", user_id, c.cost, (c.request_id,),
                    detail=f"the ledger counts {c.cost} tokens ({c.route or 'no route'}) "
                           "with no usage record",
                    fix=_audit_cmd(user_id) + " --repair", nonce=c.nonce))
        elif r.state in REFUNDED_STATES:
            out.append(Divergence(
                "record_refunded", user_id, c.cost, (c.request_id,),
                detail=f"the usage record is {r.state}, the ledger still counts {c.cost}",
                fix=f"atto-admin refund {_q(user_id)} {_q(c.request_id)} --reason "
                    "'books: the ledger counts a refunded charge'"))
        elif r.kept != c.cost:
            out.append(Divergence(
                "record_cost", user_id, abs(r.kept - c.cost), (c.request_id,),
                detail=f"the usage record keeps {r.kept}, the ledger counts {c.cost}",
                fix=f"atto-admin statement {_q(user_id)}  # then refund or correct by hand"))
    oldest = max(view.clock_ms, now_ms) - view.longest_ms + CLOCK_SLACK_MS
    # A ledger dropped and rebuilt since (a failover, a restart without persistence) counts
    # nothing made before it was rebuilt: only records younger than the oldest charge it
    # counts can be expected in it.
    first = min((c.at_ms for c in view.charges), default=None)
    if first is None or first > oldest:
        if any(r.state in STANDING_STATES and r.kept > 0 and oldest < r.at_ms
               and (first is None or r.at_ms <= first)
               and (r.request_id, r.nonce) not in counted for r in records):
            notes.append("usage records older than the oldest charge the ledger counts are "
                         "not compared (the ledger may have been dropped since)")
        oldest = max(oldest, first if first is not None else bound)
    if not view.truncated:
        for r in records:
            if (r.state in STANDING_STATES and r.kept > 0 and oldest < r.at_ms < bound
                    and (r.request_id, r.nonce) not in counted):
                out.append(Divergence(
                    "record_not_counted", user_id, r.kept, (r.request_id,),
                    detail=f"a {r.state} usage record of {r.kept} tokens the ledger does "
                           "not count",
                    fix=f"atto-admin statement {_q(user_id)}  # the user was not charged "
                        "for it: settle with them or refund the record"))
    return out, notes


def check_charge_records(user_id: str, charges: Sequence[ChargeRecord],
                         records: Sequence[UsageRecordLike], from_ms: int, now_ms: int, *,
                         write_bound_ms: int,
                         reported: Iterable[tuple[str, str]] = ()) -> list[Divergence]:
    """Every charge record (a draw of credit, the money's record of truth) made in
    [from_ms, now - write bound) has its usage record: one that is missing is provably so
    (``record_missing``, which the auditor may repair from the charge record).

    Args:
        records: the user's usage records made from ``from_ms`` on.
        reported: (request id, nonce) already reported missing (by ``check_records``).
    """
    have = {(r.request_id, r.nonce) for r in records} | set(reported)
    out = []
    for c in charges:
        if c.state == "void" or not from_ms <= c.at_ms < now_ms - write_bound_ms \
                or (c.request_id, c.nonce) in have:
            continue
        out.append(Divergence(
            "record_missing", user_id, c.kept, (c.request_id,),
            detail=f"a charge record of {c.cost} tokens ({c.route or 'no route'}) has no "
                   "usage record",
            fix=_audit_cmd(user_id) + " --repair", nonce=c.nonce))
    return out


def confirmed(first: Sequence[Divergence], second: Sequence[Divergence]) -> list[Divergence]:
    """The divergences of ``second`` that ``first`` found too (the same kind, user, grant
    and charges): what a second read still finds is no write on its way."""
    keys = {d.key() for d in first}
    return [d for d in second if d.key() in keys]


@dataclass(frozen=True)
class UserAudit:
    """The audit of one user.

    Attributes:
        user_id: the user.
        divergences: what does not balance (confirmed by a second read).
        notes: what could not be compared, and why.
        repaired: usage records the auditor wrote (provably missing).
    """

    user_id: str
    divergences: tuple[Divergence, ...] = ()
    notes: tuple[str, ...] = ()
    repaired: tuple[str, ...] = ()


@dataclass(frozen=True)
class AuditReport:
    """One run of the auditor.

    Attributes:
        started_ms: when it started.
        since_ms: the start of the span whose active users it audited.
        until_ms: its end (the next run's start).
        users_active: users with records in the span.
        users_audited: users audited (fewer when sampled or bounded).
        users_not_audited: users chosen for this run that it did not audit: DynamoDB or
            Redis did not answer for them, or the run ran out of time or reached its bound
            (the mark then stays, so the next run audits them).
        divergences: every divergence found.
        notes: per user, what could not be compared.
        repaired: usage records written, as ``user request_id``.
        duration_ms: how long it took.
        sample: the share of active users audited (1.0: all).
        grants_expired_swept: grants the run's expiry sweep recorded as expired with
            tokens unused (each reported once, as ``Atto Credit Expired``).
        expiry_swept_until_ms: how far the expiry sweep got (None: no sweep, as in a run
            over given users or one that leaves the mark alone).
    """

    started_ms: int
    since_ms: int
    until_ms: int
    users_active: int
    users_audited: int
    users_not_audited: int = 0
    divergences: tuple[Divergence, ...] = ()
    notes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    repaired: tuple[str, ...] = ()
    duration_ms: int = 0
    sample: float = 1.0
    grants_expired_swept: int = 0
    expiry_swept_until_ms: int | None = None

    @property
    def tokens(self) -> int:
        """Tokens off, summed over the divergences."""
        return sum(d.tokens for d in self.divergences)

    @property
    def balanced(self) -> bool:
        """Nothing diverged."""
        return not self.divergences

    def to_json(self) -> dict[str, Any]:
        """The report as the logs and the operator API show it."""
        from .models import iso

        return {"balanced": self.balanced, "divergences": [d.to_json() for d in
                                                           self.divergences],
                "divergence_count": len(self.divergences), "divergence_tokens": self.tokens,
                "users_active": self.users_active, "users_audited": self.users_audited,
                "users_not_audited": self.users_not_audited,
                "sample": self.sample, "since": iso(self.since_ms),
                "until": iso(self.until_ms), "started": iso(self.started_ms),
                "duration_ms": self.duration_ms, "repaired": list(self.repaired),
                "notes": {u: list(n) for u, n in self.notes.items()},
                "grants_expired_swept": self.grants_expired_swept,
                "expiry_swept_until": iso(self.expiry_swept_until_ms)}


def parse_view(reply: Sequence[Any]) -> LedgerView:
    """``budget_audit_read.lua``'s reply as a ``LedgerView``."""
    def text(v: Any) -> str:
        return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)

    clock, longest, epoch = int(text(reply[0])), int(text(reply[1])), int(text(reply[2]))
    raw = [text(v) for v in reply[3]]
    grants = []
    for ref, value in zip(raw[::2], raw[1::2], strict=True):
        rem, exp = value.split(" ")[:2]
        grants.append(CachedGrant(ref, int(rem), None if exp == "0" else int(exp)))
    charges = []
    rest = [text(v) for v in reply[5:]]
    for i in range(0, len(rest), 4):
        rid, score, ev, dr = rest[i:i + 4]
        cost, nonce, route = (ev.split(" ", 2) + ["", "", ""])[:3]
        draw_epoch = 0
        draws: tuple[tuple[str, int], ...] = ()
        if dr:
            head, _, body = dr.partition(" ")
            draw_epoch = int(head.lstrip("#") or 0)
            draws = decode_pairs(body)
        charges.append(LedgerCharge(rid, nonce, int(cost or 0), int(float(score)), route,
                                    draws, draw_epoch))
    return LedgerView(clock, longest, epoch, tuple(grants), tuple(charges),
                      truncated=bool(int(text(reply[4]))))
