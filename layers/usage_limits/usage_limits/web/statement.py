"""A statement: one user's usage records in a span, newest first, with per-day totals.

``GET /v1/usage/history`` (the caller's own) and the operator's
``GET /admin/v1/users/{user_id}/statement`` (any user's) answer the same body. The records
come a page at a time (an opaque ``cursor``); the per-day (UTC) totals of the whole span
come with the first page (no cursor), ``days`` is null on the others. Every instant is an
RFC 3339 UTC string.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel, Field

from ..entitlements.exceptions import StoreUnavailable
from ..entitlements.models import iso, parse_time
from ..entitlements.usage import DAY_MS, UsageRecord, day_totals
from ..entitlements.usage_store import UsagePage, default_usage_store
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


class DayOut(BaseModel):
    day: str = Field(description="The UTC date, YYYY-MM-DD.")
    charges: int
    reserved: int
    kept: int
    refunded: int
    credit: int = Field(description="Tokens drawn from credit grants.")


class StatementOut(BaseModel):
    user_id: str
    from_: str = Field(alias="from", serialization_alias="from")
    to: str
    records: list[RecordOut] = Field(description="Newest first.")
    days: list[DayOut] | None = Field(
        description="Per UTC day of the whole span, newest first (days without records left "
                    "out); only on the first page, null on the others.")
    cursor: str | None = Field(description="Pass it for the next page; null on the last.")

    model_config = {"populate_by_name": True}


def record_out(r: UsageRecord) -> RecordOut:
    """A record as a statement shows it."""
    return RecordOut(request_id=shown_id(r.request_id), route=r.route, plan=r.plan,
                     cost=r.cost, kept=r.kept, refunded=r.refunded,
                     credit=[CreditOut(reference=ref, tokens=n) for ref, n in r.draws],
                     state=r.state, at=iso(r.at_ms) or "", changed_at=iso(r.changed_ms))


def span(from_text: str | None, to_text: str | None, *, now_ms: int | None = None,
         ) -> tuple[int, int]:
    """[from, to) in ms from a statement's query.

    Raises:
        InvalidArgument: a time that is not RFC 3339 with a zone, ``to`` not after
            ``from``, or a span longer than ``MAX_SPAN_MS``.
    """
    to_ms = (int(time.time() * 1000) + 1 if now_ms is None else now_ms) if to_text is None \
        else parse_time(to_text, name="to")
    from_ms = to_ms - DEFAULT_SPAN_MS if from_text is None else parse_time(from_text,
                                                                           name="from")
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
        from_ms, to_ms = span(from_text, to_text)
        page: UsagePage = await asyncio.to_thread(store.history, user_id, from_ms, to_ms,
                                                  cursor, limit)
        days = None
        if cursor is None:
            every = page.records if page.cursor is None else await asyncio.to_thread(
                store.records, user_id, from_ms, to_ms)
            days = [DayOut(**vars(d)) for d in day_totals(every)]
    except InvalidArgument as exc:
        raise InvalidRequest(str(exc)) from exc
    except StoreUnavailable as exc:
        raise LimiterUnavailableError("the usage records are unavailable",
                                      headers=retry_after_header(1)) from exc
    return StatementOut(user_id=user_id, **{"from": iso(from_ms) or ""}, to=iso(to_ms) or "",
                        records=[record_out(r) for r in page.records], days=days,
                        cursor=page.cursor)
