"""The operator API under /admin/v1/: plans, grants, refunds and suspensions of one user,
its statement (usage records) and a grant's history.

Every instant in an answer is an RFC 3339 UTC string (``iso``), audit details included.

Authorized by IAM (the HTTP API's ``AWS_IAM`` on these routes only; a user's JWT never
reaches them), except in local mode, where nothing signs and the operator is ``local``.
Every change needs a reason and is audited with the caller's IAM principal.
"""

from __future__ import annotations

import usage_limits.coldstart  # noqa: F401  (first: no GC while loading; see its docstring)

# isort: split
import time
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import Body, Depends, Path, Query, Request
from fastapi.responses import JSONResponse
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from usage_limits.entitlements import Grant, GrantConflict, NotFound, StoreUnavailable, iso
from usage_limits.entitlements.exceptions import NotRefreshed
from usage_limits.entitlements.models import MAX_GRANT_TOKENS, MAX_REASON, Change, Suspension
from usage_limits.entitlements.operator import Operator, Picture
from usage_limits.entitlements.store import MAX_AUDIT, default_store
from usage_limits.entitlements.usage_store import MAX_PAGE, default_usage_store
from usage_limits.exceptions import InvalidArgument, LimiterUnavailable
from usage_limits.web import ApiError, ErrorBody, create_app, lambda_handler, settings
from usage_limits.web.errors import error_response, retry_after_header
from usage_limits.web.identity import operator_principal, shown_id
from usage_limits.web.runtime import get_budget, get_entitlements
from usage_limits.web.statement import StatementOut, read_statement

app = create_app("Atto Cloud: operator API")

#: Answers every operator route may give besides the common ones.
RESPONSES: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorBody, "description": "forbidden: the request carries no IAM principal"},
    404: {"model": ErrorBody, "description": "not_found: no such grant or charge"},
}
#: Routes that create something answer 201, or 200 with what an earlier call created.
CREATED: dict[int | str, dict[str, Any]] = {
    **RESPONSES, 201: {"description": "created by this call"}}

UserId = Annotated[str, Path(min_length=1, max_length=256)]
#: Seconds ``books`` audits users before it answers (the function times out at 10 s).
BOOKS_TIME_S = 6.0
Reason = Annotated[str, Field(min_length=1, max_length=MAX_REASON,
                              description="Why; recorded in the audit log.")]
Reference = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:@/+=-]{1,128}$",
                                 description="Makes creation idempotent (an invoice id).")]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlanIn(_In):
    plan: str = Field(min_length=1, max_length=64)
    reason: Reason


class ReasonIn(_In):
    reason: Reason


class GrantIn(_In):
    tokens: int = Field(gt=0, le=MAX_GRANT_TOKENS, strict=True)
    kind: Literal["paid", "promo"]
    reference: Reference
    expires_at: AwareDatetime | None = None
    reason: Reason


class RefundIn(_In):
    request_id: str = Field(min_length=1, max_length=256)
    reason: Reason


class SuspensionIn(_In):
    reason: Reason
    until: AwareDatetime | None = None


class BooksIn(_In):
    user_id: str | None = Field(default=None, min_length=1, max_length=256,
                                description="Audit this user; default: the users active "
                                            "since the last scheduled run.")
    repair: bool = Field(default=False, description="Write usage records that are "
                                                    "provably missing.")


class _Misconfigured(ApiError):
    status, code = 500, "internal_error"


@app.exception_handler(InvalidArgument)
async def invalid_argument(_: Request, exc: InvalidArgument) -> JSONResponse:
    return error_response(400, "invalid_request", str(exc))


@app.exception_handler(NotFound)
async def not_found(_: Request, exc: NotFound) -> JSONResponse:
    return error_response(404, "not_found", str(exc))


@app.exception_handler(GrantConflict)
async def grant_conflict(_: Request, exc: GrantConflict) -> JSONResponse:
    existing = exc.existing
    assert isinstance(existing, Grant)
    asked = dict(exc.asked)
    asked["expires_at"] = iso(asked.pop("expires_at_ms"))  # type: ignore[arg-type]
    return error_response(409, "grant_conflict", str(exc),
                          existing={"tokens": existing.tokens, "kind": existing.kind,
                                    "expires_at": iso(existing.expires_at_ms)},
                          asked=asked)


@app.exception_handler(NotRefreshed)
async def not_refreshed(_: Request, exc: NotRefreshed) -> JSONResponse:
    return error_response(503, "not_refreshed", str(exc), headers=retry_after_header(1))


@app.exception_handler(StoreUnavailable)
async def store_unavailable(_: Request, exc: StoreUnavailable) -> JSONResponse:
    return error_response(503, "store_unavailable",
                          "the entitlements store is unavailable; the change may not have "
                          "been made: repeat the call (every change is idempotent)",
                          headers=retry_after_header(1))


async def operator(_: Annotated[str, Depends(operator_principal)]) -> Operator:
    """The operator service over this environment's store, plans and ledger.

    It needs the caller's IAM principal first, so an unsigned request is 403 even when the
    store is missing or down (FastAPI resolves the principal once per request).
    """
    try:
        plans = settings().plans
        return Operator(default_store(), plans, get_budget(plans.default_plan.windows),
                        get_entitlements(), usage=default_usage_store())
    except InvalidArgument as exc:  # a deployment setting, not the caller's input
        raise _Misconfigured("the server is misconfigured") from exc


Ops = Annotated[Operator, Depends(operator)]
Actor = Annotated[str, Depends(operator_principal)]


def _ms(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp() * 1000)


def _reason(body: ReasonIn | None, query: str | None) -> str:
    """A DELETE's reason, from its JSON body or its ``reason`` query parameter."""
    reason = body.reason if body is not None else query
    if reason is None or not reason.strip():
        raise InvalidArgument("a reason is required for every change (JSON body "
                              '{"reason": "..."} or ?reason=...)')
    return reason


def _change(change: Change, prefix: str = "") -> dict[str, Any]:
    return {f"{prefix}at": iso(change.at_ms), f"{prefix}by": change.actor,
            f"{prefix}reason": change.reason}


def grant_out(grant: Grant, now_ms: int) -> dict[str, Any]:
    """A grant as the API shows it."""
    out = {"reference": grant.reference, "tokens": grant.tokens, "consumed": grant.consumed,
           "remaining": grant.remaining, "kind": grant.kind,
           "expires_at": iso(grant.expires_at_ms), "live": grant.live(now_ms),
           "created": _change(grant.created),
           "voided": _change(grant.voided) if grant.voided else None}
    return out


def suspension_out(suspension: Suspension | None, now_ms: int) -> dict[str, Any] | None:
    """A suspension as the API shows it."""
    if suspension is None:
        return None
    return {"reason": suspension.reason, "until": iso(suspension.until_ms),
            "active": suspension.active(now_ms), "since": iso(suspension.change.at_ms),
            "by": suspension.change.actor}


def picture_out(p: Picture) -> dict[str, Any]:
    """A user's whole picture as the API shows it."""
    override = p.entitlements.override
    grants = [grant_out(g, p.now_ms) for g in p.entitlements.grants]
    return {
        "user_id": p.user_id,
        "at": iso(p.now_ms),
        "plan": {"name": p.plan.name, "source": p.plan_source,
                 "windows": [{"limit": limit, "window_s": seconds}
                             for limit, seconds in p.plan.windows]},
        "override": None if override is None else {"plan": override.plan,
                                                    **_change(override.change)},
        "last_charged": None if p.last_charge is None else {
            "plan": p.last_charge[1], "at": iso(p.last_charge[0])},
        "windows": [{"limit": w.limit, "used": w.used, "remaining": w.remaining,
                     "window_s": int(w.window_s),
                     "resets_at": iso(w.resets_at_ms) if w.used else None}
                    for w in p.windows],
        "grants": grants,
        "credit": sum(g["remaining"] for g in grants if g["live"]),
        "suspension": suspension_out(p.entitlements.suspension, p.now_ms),
        "events": [{"request_id": shown_id(e.request_id), "cost": e.cost, "route": e.route,
                    "at": iso(e.at_ms),
                    "draws": [{"reference": r, "tokens": n} for r, n in e.draws]}
                   for e in p.events],
    }


@app.get("/admin/v1/users/{user_id}", responses=RESPONSES)
async def get_user(user_id: UserId, ops: Ops, _: Actor) -> dict[str, Any]:
    """The user's plan and its source, windows, grants, suspension and recent spend.

    A user never seen gets an empty picture, not a 404."""
    return picture_out(await ops.picture(user_id))


@app.put("/admin/v1/users/{user_id}/plan", responses=RESPONSES)
async def set_plan(user_id: UserId, body: PlanIn, ops: Ops, actor: Actor) -> dict[str, Any]:
    """Give the user a plan of the operator's choice (it beats the JWT claim)."""
    override = await ops.set_plan(user_id, body.plan, actor=actor, reason=body.reason)
    return {"user_id": user_id, "override": {"plan": override.plan, **_change(override.change)}}


@app.delete("/admin/v1/users/{user_id}/plan", responses=RESPONSES)
async def clear_plan(user_id: UserId, ops: Ops, actor: Actor,
                     body: Annotated[ReasonIn | None, Body()] = None,
                     reason: Annotated[str | None, Query(max_length=MAX_REASON)] = None,
                     ) -> dict[str, Any]:
    """Remove the user's override; the claim or the default applies again."""
    removed = await ops.clear_plan(user_id, actor=actor, reason=_reason(body, reason))
    return {"user_id": user_id, "cleared": removed is not None,
            "override": None if removed is None else {"plan": removed.plan,
                                                      **_change(removed.change)}}


@app.post("/admin/v1/users/{user_id}/grants", responses=CREATED)
async def create_grant(user_id: UserId, body: GrantIn, ops: Ops,
                       actor: Actor) -> JSONResponse:
    """Create a grant; the same reference again returns the existing grant (200, not 201)."""
    grant, created = await ops.create_grant(
        user_id, tokens=body.tokens, kind=body.kind, reference=body.reference,
        expires_at_ms=_ms(body.expires_at), actor=actor, reason=body.reason)
    return JSONResponse({"user_id": user_id, "created": created,
                         "grant": grant_out(grant, ops.now_ms())},
                        status_code=201 if created else 200)


@app.delete("/admin/v1/users/{user_id}/grants/{reference}", responses=RESPONSES)
async def void_grant(user_id: UserId, reference: Annotated[str, Path(max_length=128)],
                     ops: Ops, actor: Actor,
                     body: Annotated[ReasonIn | None, Body()] = None,
                     reason: Annotated[str | None, Query(max_length=MAX_REASON)] = None,
                     ) -> dict[str, Any]:
    """Void a grant: what is left of it can no longer be drawn."""
    grant, voided = await ops.void_grant(user_id, reference, actor=actor,
                                         reason=_reason(body, reason))
    return {"user_id": user_id, "voided": voided, "grant": grant_out(grant, ops.now_ms())}


@app.post("/admin/v1/users/{user_id}/refunds", responses=CREATED)
async def refund(user_id: UserId, body: RefundIn, ops: Ops, actor: Actor) -> JSONResponse:
    """Refund one charge, at most once (a second call returns the first refund, 200)."""
    done, created = await ops.refund(user_id, body.request_id, actor=actor, reason=body.reason)
    return JSONResponse({"user_id": user_id, "created": created,
                         "refund": {"request_id": shown_id(done.request_id), "tokens": done.tokens,
                                    **_change(done.change)}},
                        status_code=201 if created else 200)


@app.get("/admin/v1/users/{user_id}/statement", responses=RESPONSES)
async def statement(user_id: UserId, _: Actor,
                    from_: Annotated[str | None, Query(alias="from")] = None,
                    to: Annotated[str | None, Query()] = None,
                    cursor: Annotated[str | None, Query()] = None,
                    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50) -> StatementOut:
    """The user's usage records in [from, to), newest first, a page at a time (a cursor
    carries its span), with the totals of every day and of the span on the first page:
    what ``GET /v1/usage/history`` shows the user."""
    return await read_statement(user_id, from_, to, cursor, limit)


@app.get("/admin/v1/users/{user_id}/grants/{reference}/history", responses=RESPONSES)
async def grant_history(user_id: UserId, reference: Annotated[str, Path(max_length=128)],
                        ops: Ops, _: Actor) -> dict[str, Any]:
    """A grant's own history, oldest first: created, each draw, each return (or forfeit),
    void and expiry."""
    events = await ops.grant_history(user_id, reference)
    return {"user_id": user_id, "reference": reference,
            "events": [{"kind": e.kind, "at": iso(e.at_ms), "tokens": e.tokens,
                        "request_id": None if e.request_id is None else shown_id(e.request_id),
                        "actor": e.actor, "reason": e.reason} for e in events]}


@app.put("/admin/v1/users/{user_id}/suspension", responses=RESPONSES)
async def suspend(user_id: UserId, body: SuspensionIn, ops: Ops,
                  actor: Actor) -> dict[str, Any]:
    """Suspend the user, until ``until`` or until lifted."""
    suspension = await ops.suspend(user_id, reason=body.reason, until_ms=_ms(body.until),
                                   actor=actor)
    return {"user_id": user_id, "suspension": suspension_out(suspension, ops.now_ms())}


@app.delete("/admin/v1/users/{user_id}/suspension", responses=RESPONSES)
async def lift_suspension(user_id: UserId, ops: Ops, actor: Actor,
                          body: Annotated[ReasonIn | None, Body()] = None,
                          reason: Annotated[str | None, Query(max_length=MAX_REASON)] = None,
                          ) -> dict[str, Any]:
    """Lift the suspension; service returns on the user's next request."""
    lifted = await ops.lift_suspension(user_id, actor=actor, reason=_reason(body, reason))
    return {"user_id": user_id, "lifted": lifted is not None,
            "suspension": suspension_out(lifted, ops.now_ms())}


@app.get("/admin/v1/audit", responses=RESPONSES)
async def audit(ops: Ops, _: Actor,
                user_id: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
                limit: Annotated[int, Query(ge=1, le=MAX_AUDIT)] = 50) -> dict[str, Any]:
    """Operator actions, newest first: one user's, or everyone's."""
    entries = await ops.audit(user_id, limit=limit)
    return {"entries": [{"user_id": e.user_id, "action": e.action,
                         "details": details_out(e.details), **_change(e.change)}
                        for e in entries]}


@app.post("/admin/v1/books", responses=RESPONSES)
async def books(body: BooksIn, ops: Ops, _: Actor) -> dict[str, Any]:
    """Check the books (the conservation audit): one user's, or those of the users active
    since the last scheduled run (whose mark it leaves alone); every divergence with the
    command that fixes it. Nothing is changed unless ``repair`` (provably missing usage
    records only)."""
    from usage_limits.entitlements.auditor import Auditor

    auditor = Auditor(ops.store, ops.budget.redis, usage_store(), repair=body.repair)
    deadline = time.monotonic() + BOOKS_TIME_S
    report = await auditor.run(users=None if body.user_id is None else [body.user_id],
                               move_mark=False,
                               time_left_s=lambda: deadline - time.monotonic())
    return report.to_json()


@app.post("/admin/v1/users/{user_id}/reload", responses=RESPONSES)
async def reload(user_id: UserId, ops: Ops, _: Actor) -> dict[str, Any]:
    """Drop the user's cached entitlements: the next request loads them from DynamoDB
    (moves no money; the fix for a cached copy whose credit differs)."""
    if ops.cache is None:
        return {"user_id": user_id, "reloaded": False}
    try:
        epoch = await ops.cache.refresh(ops.budget, user_id)
    except LimiterUnavailable as exc:
        raise NotRefreshed("the cached copy could not be dropped; repeat the call") from exc
    return {"user_id": user_id, "reloaded": True, "epoch": epoch}


def usage_store() -> Any:
    """The usage-record store of this environment (None: not deployed with it)."""
    return default_usage_store()


def details_out(details: dict[str, Any]) -> dict[str, Any]:
    """An audit entry's details as the API shows them: an instant the store keeps in ms
    (``expires_at_ms``, ``until_ms``) as RFC 3339 under its name without ``_ms``, a request
    id as the user sees it."""
    out: dict[str, Any] = {}
    for key, value in details.items():
        if key.endswith("_ms") and (value is None or isinstance(value, int)):
            out[key.removesuffix("_ms")] = iso(value)
        elif key == "request_id" and isinstance(value, str):
            out[key] = shown_id(value)
        else:
            out[key] = value
    return out


handler = lambda_handler(app)
