"""A statement: one user's usage records in a span, newest first, with per-day totals.

``GET /v1/usage/history`` (the caller's own) and the operator's
``GET /admin/v1/users/{user_id}/statement`` (any user's) answer the same body. The records
come a page at a time (an opaque ``cursor``); the first page (no cursor) fixes the span
(``to`` defaults to now) and every cursor carries it, so the pages of one statement cover
one span: with a cursor, ``from`` and ``to`` may be left out, and another span is 400. The
per-day (UTC) totals of every day of the span and the span's ``summary`` (what was charged,
given back and kept) come with the first page, null on the others. Every instant is an
RFC 3339 UTC string.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel, Field

from ..entitlements.exceptions import StoreUnavailable
from ..entitlements.models import iso, parse_time
from ..entitlements.usage import DAY_MS, UsageRecord, day_totals, decode_cursor, span_totals
from ..entitlements.usage_store import UsagePage, cursor_in_span, default_usage_store
from ..exceptions import InvalidArgument
from .errors import InvalidRequest, LimiterUnavailableError, retry_after_header
from .identity import shown_id

#: The span a statement covers when ``from`` is not given, before ``to``.
DEFAULT_SPAN_MS = 30 * DAY_MS
#: The longest span one statement may cover (a year and a day, leap years included).
MAX_SPAN_MS = 367 * DAY_MS


class CreditOut(BaseModel):
    reference: str = Field(description="The credit grant the tokens came from.")
    tokens: int


class RecordOut(BaseModel):
    request_id: str = Field(description="The request's id, as its X-Request-Id showed it.")
    route: str = Field(description="The route charged (empty while the record is partial: "
                                   "its refund was written before it).")
    plan: str
    cost: int = Field(description="Tokens reserved.")
    kept: int = Field(description="Tokens kept now, after settles and refunds.")
    refunded: int = Field(description="Tokens given back: cost - kept.")
    credit: list[CreditOut] = Field(description="Tokens of the cost drawn from credit "
                                                "grants (empty: none).")
    state: str = Field(description="charged, settled, refunded or support-refunded.")
    at: str = Field(description="When the charge was made (RFC 3339, UTC).")
    changed_at: str | None = Field(description="When it was last settled or refunded; "
                                               "null: never.")


class TotalsOut(BaseModel):
    charges: int = Field(description="Charges made, refunded ones included.")
    reserved: int = Field(description="Tokens they reserved.")
    refunds: int = Field(description="Charges given back whole: failed requests (refunded "
                                     "automatically) and support refunds.")
    refunded: int = Field(description="Tokens given back, by refunds and settles: "
                                      "reserved - kept.")
    kept: int = Field(description="Tokens kept now.")
    credit: int = Field(description="Tokens drawn from credit grants.")


class DayOut(TotalsOut):
    day: str = Field(description="The UTC date, YYYY-MM-DD.")


class StatementOut(BaseModel):
    user_id: str
    from_: str = Field(alias="from", serialization_alias="from")
    to: str
    records: list[RecordOut] = Field(description="Newest first.")
    days: list[DayOut] | None = Field(
        description="Every UTC day the span touches, newest first (a day without records "
                    "with zeros); only on the first page, null on the others.")
    summary: TotalsOut | None = Field(
        description="The whole span: charged (charges, reserved), given back (refunds, "
                    "refunded) and kept; only on the first page, null on the others.")
    cursor: str | None = Field(description="Pass it for the next page (it carries the "
                                           "span); null on the last.")

    model_config = {"populate_by_name": True}


def record_out(r: UsageRecord) -> RecordOut:
    """A record as a statement shows it."""
    return RecordOut(request_id=shown_id(r.request_id), route=r.route, plan=r.plan,
                     cost=r.cost, kept=r.kept, refunded=r.refunded,
                     credit=[CreditOut(reference=ref, tokens=n) for ref, n in r.draws],
                     state=r.state, at=iso(r.at_ms) or "", changed_at=iso(r.changed_ms))


def span(from_text: str | None, to_text: str | None, *, cursor: str | None = None,
         now_ms: int | None = None) -> tuple[int, int]:
    """[from, to) in ms from a statement's query: the cursor's span when there is one
    (``from`` and ``to``, when given, must be that span's).

    Raises:
        InvalidArgument: a time that is not RFC 3339 with a zone, ``to`` not after
            ``from``, a span longer than ``MAX_SPAN_MS``, or a cursor that is not one or
            belongs to another span.
    """
    if cursor is not None:
        at = decode_cursor(cursor)
        from_ms = at.from_ms if from_text is None else parse_time(from_text, name="from")
        to_ms = at.to_ms if to_text is None else parse_time(to_text, name="to")
        cursor_in_span(cursor, from_ms, to_ms)
    else:
        to_ms = (int(time.time() * 1000) + 1 if now_ms is None else now_ms) \
            if to_text is None else parse_time(to_text, name="to")
        from_ms = to_ms - DEFAULT_SPAN_MS if from_text is None \
            else parse_time(from_text, name="from")
    if from_ms < 0:
        raise InvalidArgument("from must be after 1970-01-01T00:00:00Z")
    if to_ms <= from_ms:
        raise InvalidArgument("to must be later than from")
    if to_ms - from_ms > MAX_SPAN_MS:
        raise InvalidArgument("a statement covers at most 367 days: narrow from/to")
    return from_ms, to_ms


async def read_statement(user_id: str, from_text: str | None, to_text: str | None,
                         cursor: str | None, limit: int) -> StatementOut:
    """One page of ``user_id``'s statement.

    Raises:
        InvalidRequest: a bad ``from``, ``to`` or ``cursor`` (400).
        LimiterUnavailableError: the usage records cannot be read (503).
    """
    store = default_usage_store()
    if store is None:
        raise LimiterUnavailableError("usage records are not configured here",
                                      headers=retry_after_header(60))
    try:
        from_ms, to_ms = span(from_text, to_text, cursor=cursor)
        page: UsagePage = await asyncio.to_thread(store.history, user_id, from_ms, to_ms,
                                                  cursor, limit)
        days, summary = None, None
        if cursor is None:
            every = page.records if page.cursor is None else await asyncio.to_thread(
                store.records, user_id, from_ms, to_ms)
            days = [DayOut(day=d.day, **vars(d.totals))
                    for d in day_totals(every, from_ms, to_ms)]
            summary = TotalsOut(**vars(span_totals(every, from_ms, to_ms)))
    except InvalidArgument as exc:
        raise InvalidRequest(str(exc)) from exc
    except StoreUnavailable as exc:
        raise LimiterUnavailableError("the usage records are unavailable",
                                      headers=retry_after_header(1)) from exc
    return StatementOut(user_id=user_id, **{"from": iso(from_ms) or ""}, to=iso(to_ms) or "",
                        records=[record_out(r) for r in page.records], days=days,
                        summary=summary, cursor=page.cursor)
