"""GET /v1/usage: the caller's budget, recent spend and the price of every route (free);
GET /v1/usage/history: the caller's statement, from the usage records (free).

Every instant in the answer is an RFC 3339 UTC string (``iso``); durations are numbers
with their unit in the name (``window_s``).
"""

from __future__ import annotations

import usage_limits.coldstart  # noqa: F401  (first: no GC while loading; see its docstring)

# isort: split
from typing import Annotated

from fastapi import Depends, Query
from pydantic import BaseModel, Field

from usage_limits.entitlements import Plan, iso
from usage_limits.web import create_app, current_user, lambda_handler
from usage_limits.web.guard import current_plan, read_history, read_usage
from usage_limits.web.identity import shown_id
from usage_limits.web.statement import StatementOut, read_statement

app = create_app("Atto Cloud: usage")

#: Tokens per route, free ones at 0: a number, or for a route priced by the size of its
#: request, the rule in words. Each metered route declares the same in its
#: ``require_tokens(cost=...)``; a test keeps the two, and the README's table, in step.
PRICES: dict[str, int | str] = {
    "POST /v1/embeddings": "1 per started 8,000 characters of input",
    "GET /v1/salary": 2,
    "POST /v1/structured": "8 per started 8,000 characters of prompt and schema",
    "POST /v1/job-extraction": 10,
    "POST /v1/company-research": 20,
    "POST /v1/market-context": 30,
    "GET /v1/usage": 0,
    "GET /v1/usage/history": 0,
}


class WindowOut(BaseModel):
    limit: int = Field(description="Tokens allowed in the window.")
    used: int = Field(description="Tokens spent in the window.")
    remaining: int
    window_s: int = Field(description="Length of the sliding window in seconds.")
    resets_at: str | None = Field(
        description="When the oldest charge in the window leaves it, giving its tokens back "
                    "(RFC 3339, UTC); null when the window holds no charge (nothing to wait "
                    "for).")


class DrawOut(BaseModel):
    reference: str = Field(description="The grant the tokens came from.")
    tokens: int


class SpendEventOut(BaseModel):
    request_id: str = Field(description="The request's id, as its X-Request-Id header "
                                        "showed it: the id support refunds by.")
    cost: int
    route: str
    at: str = Field(description="When the charge was made (RFC 3339, UTC).")
    draws: list[DrawOut] = Field(
        default_factory=list,
        description="How much of the cost came from which credit grant (empty: all of it "
                    "from the plan's included quota).")


class GrantOut(BaseModel):
    reference: str = Field(description="The grant's reference (an invoice id, a campaign).")
    kind: str = Field(description="paid or promo.")
    remaining: int = Field(description="Tokens left to draw.")
    tokens: int = Field(description="Tokens granted.")
    expires_at: str | None = Field(description="RFC 3339, UTC; null when it never expires.")


class EndedGrantOut(BaseModel):
    reference: str
    kind: str = Field(description="paid or promo.")
    tokens: int = Field(description="Tokens granted.")
    ended: str = Field(description="expired or voided.")
    ended_at: str = Field(description="When it expired or was voided (RFC 3339, UTC).")
    forfeited: int = Field(description="Tokens unused when it ended: lost, never drawn.")


class RefundOut(BaseModel):
    request_id: str = Field(description="The refunded charge's id, as X-Request-Id showed "
                                        "it.")
    tokens: int | None = Field(description="Tokens given back (null while in progress).")
    refunded_at: str = Field(description="When support refunded it (RFC 3339, UTC).")


class UsageOut(BaseModel):
    user_id: str
    plan: str = Field(description="The name of the caller's plan.")
    windows: list[WindowOut]
    credit: int = Field(default=0, description="Tokens left in the live grants.")
    grants: list[GrantOut] = Field(
        default_factory=list,
        description="Live credit grants, in the order they are drawn: what a request that "
                    "does not fit the plan's longest window (its included quota) draws.")
    ended_grants: list[EndedGrantOut] = Field(
        default_factory=list,
        description="Grants that expired or were voided in the last 30 days, most recent "
                    "first, with the tokens forfeited (unused credit is lost when a grant "
                    "ends).")
    events: list[SpendEventOut] = Field(description="Most recent charges first.")
    refunded: list[RefundOut] = Field(
        default_factory=list,
        description="Charges support refunded in the last 30 days, most recent first (they "
                    "leave events).")
    prices: dict[str, int | str] = Field(
        description="Tokens per route (0 for a free one): a number, or the rule of a route "
                    "priced by the size of its request (e.g. \"1 per started 8,000 "
                    "characters of input\").")


@app.get("/v1/usage")
async def usage(plan: Annotated[Plan, Depends(current_plan)],
                user: str = Depends(current_user)) -> UsageOut:
    """What the caller has spent, what is left, the credit grants, and what each route
    costs."""
    report, used = await read_usage(user, plan)
    ended, refunded = await read_history(user)
    grants = [GrantOut(reference=g.reference, kind=g.kind, remaining=g.remaining,
                       tokens=g.tokens, expires_at=iso(g.expires_at_ms))
              for g in report.grants]
    return UsageOut(
        user_id=user,
        plan=used.name,
        windows=[WindowOut(limit=w.limit, used=w.used, remaining=w.remaining,
                           window_s=int(w.window_s), resets_at=iso(w.resets_at_ms))
                 for w in report.windows],
        credit=sum(g.remaining for g in grants),
        grants=grants,
        events=[SpendEventOut(request_id=shown_id(e.request_id),
                              cost=e.cost, route=e.route, at=iso(e.at_ms) or "",
                              draws=[DrawOut(reference=r, tokens=n)
                                     for r, n in e.draws])
                for e in report.events],
        ended_grants=[EndedGrantOut(
            reference=g.reference, kind=g.kind, tokens=g.tokens,
            ended="voided" if g.voided else "expired",
            ended_at=iso(g.voided.at_ms if g.voided else g.expires_at_ms) or "",
            forfeited=g.forfeited if g.forfeited is not None else g.tokens - g.consumed)
            for g in ended],
        refunded=[RefundOut(request_id=shown_id(r.request_id), tokens=r.tokens,
                            refunded_at=iso(r.change.at_ms) or "") for r in refunded],
        prices=PRICES,
    )


@app.get("/v1/usage/history")
async def usage_history(
        user: str = Depends(current_user),
        from_: Annotated[str | None, Query(
            alias="from", description="Oldest instant (RFC 3339), inclusive; default 30 days "
                                      "before `to` (with a cursor: the cursor's).")] = None,
        to: Annotated[str | None, Query(
            description="Newest instant (RFC 3339), exclusive; default now (with a cursor: "
                        "the cursor's).")] = None,
        cursor: Annotated[str | None, Query(
            description="The `cursor` of the previous page; absent for the first. It "
                        "carries the first page's span: another `from`/`to` is 400.")] = None,
        limit: Annotated[int, Query(ge=1, le=500, description="Records per page.")] = 50,
) -> StatementOut:
    """The caller's own usage records in [from, to), newest first, a page at a time, with
    the totals of every UTC day of the span and of the whole span on the first page; free."""
    return await read_statement(user, from_, to, cursor, limit)


handler = lambda_handler(app)
