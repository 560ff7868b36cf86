"""Usage records: the durable statement of every charge, with or without credit.

The contract (``usage_store.UsageStore`` writes and reads them; the request path, the
operator API and the auditor use them):

- **One record per charge**, made by the reservation that charged it, named by the
  charge's request id and the reservation's nonce (a retry of the same request id served
  elsewhere is another charge, with its own record). It says who was charged (``user_id``),
  for what (``route``, ``plan``), how much was reserved (``cost``) and is kept now
  (``kept``), which credit grants it drew from (``draws``: (reference, tokens) in draw
  order), its ``state`` (``charged``, ``settled``, ``refunded``, ``support-refunded``) and
  when it was made (``at_ms``) and last changed (``changed_ms``).
- **Where.** Its own DynamoDB table (``ATTO_USAGE_TABLE``; template.yaml ``UsageTable``,
  ``atto-<stage>-usage``): pk ``U#<user>``, sk ``<request id>#<nonce>``; the local
  secondary index ``by_time`` (sort key ``at``, ms) orders a user's records by time, strongly
  consistent. An LSI can only be made with a new table, which is why the records are not in
  the entitlements table. Each record expires ``ATTO_USAGE_RECORDS_DAYS`` (default 400)
  after it was made (attribute ``ttl``).
- **Active users.** The first record of a user in an hour also writes a marker
  ``pk ACTIVE#<YYYY-MM-DDTHH>`` (UTC), ``sk <user>``: the users with records in a span are
  found by reading one partition per hour, never by scanning all users.
- **Idempotent writes.** ``put`` writes the record's fixed fields and sets ``kept``,
  ``state`` and ``changed_ms`` only when the record has none yet; ``lower`` moves ``kept``
  down and never up: a record already at or below the new ``kept`` is left as it is. So any
  order of a put, its lowerings, their re-sends and lost replies ends in the same record,
  and a record moves at most once per lowering. A lowering that comes before its put makes
  a partial record (no route or cost yet) that the put completes.
- **Never money.** The money record of truth stays the charge record ``C#<rid>#<nonce>`` in
  the entitlements table (``charges``): usage records are written off the request's
  critical path and may lag it (the write bound is the request's deadline; a failed write
  is kept and retried by the environment, and counted: ``RecordsKept``, ``RecordsLost``).
  So a record may lag its charge by the request's time (at most about 30 s) and, when its
  write was kept, by up to ``web.records.KEEP_S`` (a day) before it is dropped as lost; a
  lowering may lag the same way. They never decide what is charged or returned.

This module is pure: the record, its item, its keys, the statement's day totals and a
grant's history; the store sends them.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from ..exceptions import InvalidArgument
from .charges import ChargeRecord, Pairs, decode_pairs, encode_pairs
from .models import LATEST_MS

RecordState = Literal["charged", "settled", "refunded", "support-refunded"]
#: Every state a record may be in; ``charged`` is the only one ``kept == cost``.
RECORD_STATES: tuple[RecordState, ...] = ("charged", "settled", "refunded", "support-refunded")

#: Partition key prefixes: a user's records, and one hour's active-user markers.
USER_PREFIX = "U#"
ACTIVE_PREFIX = "ACTIVE#"
#: The local secondary index ordering a user's records by ``at`` (ms).
TIME_INDEX = "by_time"
#: The attribute DynamoDB's time to live reads (epoch seconds).
TTL_ATTRIBUTE = "ttl"
#: Days a record is kept by default (``ATTO_USAGE_RECORDS_DAYS``): a year of statements.
DEFAULT_RECORD_DAYS = 400

HOUR_MS = 3_600_000
DAY_MS = 86_400_000
_MAX_ID = 256
#: DynamoDB's largest sort key, bytes.
MAX_SORT_KEY_BYTES = 1024


@dataclass(frozen=True)
class UsageRecord:
    """One charge as its statement shows it.

    Attributes:
        user_id: whose budget was charged.
        request_id: the charge's request id (as the ledger holds it).
        nonce: the reservation's nonce.
        route: the route charged ("" in a partial record: a lowering landed first).
        plan: the plan the charge was made under ("" when unknown).
        cost: tokens the reservation charged.
        kept: tokens charged now (after settles and refunds; 0 once refunded).
        draws: (grant reference, tokens) drawn from credit, in draw order (() for none).
        state: ``charged``, ``settled`` (kept below its cost), ``refunded`` (0, by the
            request path) or ``support-refunded`` (0, by an operator).
        at_ms: when the charge was made, ms since the epoch.
        changed_ms: when it was last lowered (None: never).
    """

    user_id: str
    request_id: str
    nonce: str
    route: str
    plan: str
    cost: int
    kept: int
    draws: Pairs = ()
    state: RecordState = "charged"
    at_ms: int = 0
    changed_ms: int | None = None

    def __post_init__(self) -> None:
        check_id(self.user_id, "user id")
        check_id(self.request_id, "request_id")
        if not self.nonce or "#" in self.nonce or " " in self.nonce:
            raise InvalidArgument("a usage record's nonce must be non-empty, without # or space")
        for name in ("cost", "kept", "at_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"a usage record's {name} must be an integer >= 0")
        if self.kept > self.cost:
            raise InvalidArgument(f"usage record {self.request_id!r} keeps {self.kept} of "
                                  f"{self.cost}")
        if self.state not in RECORD_STATES:
            raise InvalidArgument(f"a usage record's state must be one of {RECORD_STATES}")
        if (self.state == "charged") != (self.kept == self.cost) and self.route:
            raise InvalidArgument(f"usage record {self.request_id!r} is {self.state} but "
                                  f"keeps {self.kept} of {self.cost}")
        if self.state in ("refunded", "support-refunded") and self.kept:
            raise InvalidArgument(f"usage record {self.request_id!r} is {self.state} but "
                                  f"keeps {self.kept}")
        if sum(n for _, n in self.draws) > self.cost:
            raise InvalidArgument(f"usage record {self.request_id!r} drew more than it cost")

    @property
    def refunded(self) -> int:
        """Tokens given back since the charge (by settles and refunds)."""
        return self.cost - self.kept

    @property
    def credit(self) -> int:
        """Tokens of the charge drawn from credit grants."""
        return sum(n for _, n in self.draws)

    @property
    def partial(self) -> bool:
        """A lowering landed before the record's put: route, plan and cost are unknown."""
        return not self.route

    def lowered(self, kept: int, state: RecordState, at_ms: int) -> UsageRecord:
        """This record lowered to ``kept`` (itself when already at or below it)."""
        if kept >= self.kept:
            return self
        return UsageRecord(self.user_id, self.request_id, self.nonce, self.route, self.plan,
                           self.cost, kept, self.draws, state, self.at_ms, at_ms)


def check_id(value: object, what: str) -> str:
    """A user or request id as records carry it: 1 to 256 printable characters.

    Raises:
        InvalidArgument: anything else.
    """
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_ID or not value.isprintable():
        raise InvalidArgument(f"{what} must be 1 to {_MAX_ID} printable characters")
    return value


def lowered_state(kept: int, *, support: bool = False) -> RecordState:
    """The state of a record lowered to ``kept``: settled above 0, else (support-)refunded."""
    if kept > 0:
        return "settled"
    return "support-refunded" if support else "refunded"


# --- keys and items -------------------------------------------------------------------------

def user_pk(user_id: str) -> str:
    """The partition key of a user's records."""
    return USER_PREFIX + check_id(user_id, "user id")


def record_sk(request_id: str, nonce: str) -> str:
    """The sort key of the record of the charge ``nonce`` made for ``request_id``."""
    return f"{check_id(request_id, 'request_id')}#{nonce}"


def record_key(user_id: str, request_id: str, nonce: str) -> dict[str, str]:
    """The item key of one record (plain values: the store serializes them)."""
    return {"pk": user_pk(user_id), "sk": record_sk(request_id, nonce)}


def hour_of(at_ms: int) -> str:
    """The UTC hour of an instant, ``YYYY-MM-DDTHH``: the active-user marker's partition."""
    return datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%dT%H")


def active_key(user_id: str, at_ms: int) -> dict[str, str]:
    """The key of the marker saying ``user_id`` has a record in the hour of ``at_ms``."""
    return {"pk": ACTIVE_PREFIX + hour_of(at_ms), "sk": check_id(user_id, "user id")}


def hours(since_ms: int, until_ms: int) -> list[str]:
    """The UTC hours (``hour_of``) that the span [since, until) touches, oldest first."""
    if until_ms <= since_ms:
        return []
    start = since_ms - since_ms % HOUR_MS
    return [hour_of(t) for t in range(start, until_ms, HOUR_MS)]


def fixed_fields(record: UsageRecord) -> dict[str, Any]:
    """The attributes ``put`` always writes (the same for every put of one record)."""
    return {"user_id": record.user_id, "request_id": record.request_id,
            "nonce": record.nonce, "route": record.route, "plan": record.plan,
            "cost": record.cost, "draws": encode_pairs(record.draws), "at": record.at_ms}


def moving_fields(record: UsageRecord) -> dict[str, Any]:
    """The attributes a lowering changes: ``put`` writes them only to a new record."""
    return {"kept": record.kept, "state": record.state, "changed_at": record.changed_ms}


def record_of(item: Mapping[str, Any]) -> UsageRecord:
    """A usage record from its (deserialized) item; a partial one (a lowering written
    before its put) gets its cost from what it keeps."""
    kept = int(item.get("kept", 0))
    changed = item.get("changed_at")
    at = item.get("at", changed or 0)
    return UsageRecord(
        user_id=str(item["user_id"]), request_id=str(item["request_id"]),
        nonce=str(item["nonce"]), route=str(item.get("route", "")),
        plan=str(item.get("plan", "")), cost=int(item.get("cost", kept)), kept=kept,
        draws=decode_pairs(item.get("draws")), state=item.get("state", "charged"),
        at_ms=int(at), changed_ms=None if changed is None else int(changed))


# --- the statement's cursor and day totals ---------------------------------------------------

def encode_cursor(last_key: Mapping[str, Any], from_ms: int, to_ms: int) -> str:
    """An opaque cursor for DynamoDB's ``LastEvaluatedKey`` of the time index (plain
    values: sk and at; the partition is always the caller's own) and the statement's span
    [from, to): every page of one statement covers the span its first page fixed."""
    raw = json.dumps({"s": str(last_key["sk"]), "a": int(last_key["at"]), "f": from_ms,
                      "t": to_ms}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


@dataclass(frozen=True)
class Cursor:
    """Where a statement's next page starts, and the span it belongs to.

    Attributes:
        sk: the last record's sort key.
        at_ms: the last record's instant (the time index's sort key).
        from_ms: the statement's span's start, inclusive.
        to_ms: its end, exclusive.
    """

    sk: str
    at_ms: int
    from_ms: int
    to_ms: int


def decode_cursor(cursor: str) -> Cursor:
    """What a cursor of ``encode_cursor`` holds.

    Raises:
        InvalidArgument: it is not one (a cursor written before cursors carried their
            span is not one either: its statement starts again).
    """
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        sk, at, f, t = data["s"], data["a"], data["f"], data["t"]
        if not isinstance(sk, str) or not sk or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in (at, f, t)):
            raise ValueError(cursor)
        # DynamoDB refuses a number past 38 digits and a sort key past 1,024 bytes
        if not 0 <= f <= at < t <= LATEST_MS or len(sk.encode()) > MAX_SORT_KEY_BYTES:
            raise ValueError(cursor)
    # RecursionError: JSON nested deeper than the parser's stack (a crafted cursor)
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeError, RecursionError):
        raise InvalidArgument("cursor is not one this API returned") from None
    return Cursor(sk, at, f, t)


def utc_day(at_ms: int) -> str:
    """The UTC date of an instant, ``YYYY-MM-DD``."""
    return datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%d")


@dataclass(frozen=True)
class Totals:
    """What a statement's records charged, gave back and kept: per UTC day, or the span.

    ``charges`` - ``refunds`` are the charges that stand (``charged`` or ``settled``), and
    ``reserved`` = ``refunded`` + ``kept``.

    Attributes:
        charges: charges made (each reservation of a request), refunded ones included.
        reserved: tokens they reserved.
        refunds: charges given back whole (``refunded``: failed requests, refunded
            automatically; ``support-refunded``).
        refunded: tokens given back, by refunds and settles: reserved - kept.
        kept: tokens kept now.
        credit: tokens drawn from credit grants.
    """

    charges: int = 0
    reserved: int = 0
    refunds: int = 0
    refunded: int = 0
    kept: int = 0
    credit: int = 0

    def add(self, r: UsageRecord) -> Totals:
        """These totals with ``r`` counted too."""
        refund = r.state in ("refunded", "support-refunded")
        return Totals(self.charges + 1, self.reserved + r.cost,
                      self.refunds + refund, self.refunded + r.refunded,
                      self.kept + r.kept, self.credit + r.credit)


@dataclass(frozen=True)
class DayTotal:
    """One UTC day of a statement.

    Attributes:
        day: ``YYYY-MM-DD`` (UTC).
        totals: the records made that day (all zero on a day without any).
    """

    day: str
    totals: Totals


def span_days(from_ms: int, to_ms: int) -> list[str]:
    """Every UTC day that [from, to) touches, newest first.

    Raises:
        InvalidArgument: ``to`` not after ``from``.
    """
    if to_ms <= from_ms:
        raise InvalidArgument("to must be later than from")
    first = datetime.fromtimestamp(from_ms / 1000, UTC).date()
    last = datetime.fromtimestamp((to_ms - 1) / 1000, UTC).date()
    return [(last - timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]


def day_totals(records: Iterable[UsageRecord], from_ms: int, to_ms: int) -> list[DayTotal]:
    """Per UTC day of the span [from, to), newest first: what the records made that day
    (by ``at_ms``) charged, kept, gave back and drew from credit. Every day of the span is
    listed, a day without records with zeros; a record outside the span counts nowhere."""
    days = dict.fromkeys(span_days(from_ms, to_ms), Totals())
    for r in records:
        day = utc_day(r.at_ms)
        if from_ms <= r.at_ms < to_ms and day in days:
            days[day] = days[day].add(r)
    return [DayTotal(day, totals) for day, totals in days.items()]


def span_totals(records: Iterable[UsageRecord], from_ms: int, to_ms: int) -> Totals:
    """The totals of the records made in [from, to): a statement's summary, the sum of
    its days."""
    out = Totals()
    for r in records:
        if from_ms <= r.at_ms < to_ms:
            out = out.add(r)
    return out


def month_span(month: str) -> tuple[int, int]:
    """[start, end) of a ``YYYY-MM`` month (UTC), ms since the epoch.

    Raises:
        InvalidArgument: not a ``YYYY-MM`` month.
    """
    try:
        start = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
    except (ValueError, TypeError):
        raise InvalidArgument(f"month must be YYYY-MM, got {month!r}") from None
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 \
        else start.replace(month=start.month + 1)
    return int(start.timestamp() * 1000), int(end.timestamp() * 1000)


# --- a grant's history -------------------------------------------------------------------------

@dataclass(frozen=True)
class GrantEvent:
    """One event in a grant's life.

    Attributes:
        kind: ``created``, ``draw``, ``return``, ``forfeit``, ``void`` or ``expired``.
        at_ms: when it happened (a return or forfeit: when its charge was last lowered).
        tokens: tokens it moved (created: the grant's tokens; expired: what was forfeited;
            void: 0).
        request_id: the charge that drew or got credit back (None for the grant's own).
        actor: who made it (created, void), else None.
        reason: why (created, void), else None.
    """

    kind: str
    at_ms: int
    tokens: int
    request_id: str | None = None
    actor: str | None = None
    reason: str | None = None


def grant_history(grant_item: Mapping[str, Any],
                  charges: Sequence[ChargeRecord]) -> list[GrantEvent]:
    """A grant's events, oldest first, from its item and the charge records of its user.

    Args:
        grant_item: the grant's (deserialized) item in the entitlements table: its
            creation (``at``, ``actor``, ``reason``, ``tokens``), its void (``void_*``) and,
            when present, its expiry (``expired_at``, ``forfeited``).
        charges: the user's charge records; only those that drew from this grant count.
    """
    reference = str(grant_item["reference"])
    out = [GrantEvent("created", int(grant_item["at"]), int(grant_item["tokens"]),
                      actor=str(grant_item.get("actor", "")),
                      reason=str(grant_item.get("reason", "")))]
    for c in charges:
        drawn = sum(n for r, n in c.draws if r == reference)
        if not drawn:
            continue
        out.append(GrantEvent("draw", c.at_ms, drawn, c.request_id))
        back = sum(n for r, n in c.returned if r == reference)
        lost = sum(n for r, n in c.forfeited if r == reference)
        when = c.changed_ms if c.changed_ms is not None else c.at_ms
        if back:
            out.append(GrantEvent("return", when, back, c.request_id))
        if lost:
            out.append(GrantEvent("forfeit", when, lost, c.request_id))
    if "void_at" in grant_item:
        out.append(GrantEvent("void", int(grant_item["void_at"]), 0,
                              actor=str(grant_item.get("void_actor", "")),
                              reason=str(grant_item.get("void_reason", ""))))
    if "expired_at" in grant_item:
        out.append(GrantEvent("expired", int(grant_item["expired_at"]),
                              int(grant_item.get("forfeited", 0))))
    order = {"created": 0, "draw": 1, "return": 2, "forfeit": 3, "void": 4, "expired": 5}
    out.sort(key=lambda e: (e.at_ms, order[e.kind]))
    return out
