"""``require_tokens(cost)``: reserve a user's tokens before a route runs.

    @app.post("/v1/structured", dependencies=[Depends(require_tokens(cost=8))])
    async def structured(body: StructuredIn) -> StructuredOut: ...

The guard identifies the caller (401) before the request is validated; once the request
is valid, it reserves ``cost`` tokens under the request's id in one atomic script and
raises the public error when it cannot (429, 409, 503). The refund is not done here:
``UsageLimitsMiddleware`` sees the final status of the response (a route may *return* a
5xx, which a dependency never sees) and refunds every charge whose request did not
succeed. A route that learns its real cost can lower the charge:

    async def route(charge: Charge = Depends(require_tokens(cost=10))):
        ...
        await charge.settle(3)

The charge is made after FastAPI has validated the request: ``create_app``'s routes
(``web.metering``) take the guard over from FastAPI, identify the caller first and reserve
just before the route's code runs. A malformed request gets its 422 from every identified
caller, whatever their budget, and costs no Redis call. A cost may also be computed from
the validated request (``web.costs``):

    @app.post("/v1/embeddings",
              dependencies=[Depends(require_tokens(cost=per_started(EmbeddingsIn, ...)))])
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from ..budget import new_nonce
from ..entitlements.exceptions import StoreUnavailable
from ..entitlements.models import iso
from ..entitlements.plans import Plan
from ..exceptions import CostExceedsLimit, InvalidArgument, LimiterUnavailable
from ..throttle import bind_share
from . import events, holds, identity, records, refunds, runtime
from . import observability as obs
from .charge import Charge, CreditPending
from .costs import Cost, price
from .errors import (
    AccountSuspended,
    BudgetExceeded,
    CostExceedsPlan,
    IdempotencyConflict,
    LimiterUnavailableError,
    retry_after_header,
)
from .settings import settings

if TYPE_CHECKING:
    from ..budget import Reservation, Usage, WindowUsage
    from ..entitlements.cache import EntitlementCache

STATE_KEY = "usage_limits"
#: Attribute of a route class that reserves after validation (``metering.MeteredRoute``).
METERED_ROUTE = "reserves_after_validation"


@dataclass
class RequestState:
    """What the guard tells the middleware about one request."""

    reservation: Reservation | None = None
    charge: Charge | None = None
    user_id: str | None = None
    route_cost: int = 0
    #: The charge ``require_tokens`` prepared; reserved by ``meter`` once the request is valid.
    pending: Charge | None = None
    #: Computes the cost from the route's validated arguments and reserves it.
    meter: Callable[[dict[str, Any]], Awaitable[Charge]] | None = None
    #: The Idempotency-Key record of a keyed request from an identified user, and the record
    #: this request claimed (completed or abandoned by the middleware).
    idempotency: dict[str, Any] | None = None
    claimed: dict[str, Any] | None = None
    #: Milliseconds the request may run, from the Lambda context.
    remaining_ms: int = 29_000
    #: The name of the plan the charge is made under (named in usage events).
    plan_name: str = ""
    #: The user's windows read for an answer that reserved nothing (a replay, a 409).
    windows: tuple[WindowUsage, ...] = ()
    #: With entitlements on, the live credit read with ``windows``; else None.
    credit: int | None = None


def request_state(request: Request) -> RequestState:
    """The per-request state the middleware created (a fresh one outside the middleware)."""
    scope_state = request.scope.setdefault("state", {})
    state = scope_state.get(STATE_KEY)
    if state is None:
        state = scope_state[STATE_KEY] = RequestState()
    return state  # type: ignore[no-any-return]


async def current_user(request: Request) -> str:
    """Dependency for free routes: the caller's id, or 401.

    A coroutine on purpose: FastAPI runs a plain function dependency in a worker thread,
    which costs a free route several hundred microseconds.
    """
    return _identify(request)


def _identify(request: Request) -> str:
    """The caller's id (401 when there is none), noted in the request state and the logs."""
    user = identity.user_id(request)
    request_state(request).user_id = user
    obs.logger().append_keys(user=obs.hashed_user(user))
    return user


async def current_plan(request: Request) -> Plan:
    """Dependency: the caller's plan (the claim's, else the default); a coroutine, so FastAPI
    runs it on the loop, not in a worker thread."""
    return identity.plan(request).plan


async def read_usage(user: str, plan: Plan, *, events: int = 50) -> tuple[Usage, Plan]:
    """The user's windows, recent spend and grants, for a route that charges nothing.

    With entitlements on, the user's copy is loaded when the cache has none, a suspended
    account is refused like on every metered route, and the windows are those of the plan
    in force (an operator's override beats ``plan``).

    Args:
        plan: the plan from the claim or the default.
        events: how many recent spend events to read.

    Returns:
        The usage and the plan it was read for.

    Raises:
        AccountSuspended: the account is suspended.
        LimiterUnavailableError: Redis or DynamoDB could not be reached.
    """
    budget = runtime.get_budget(plan.windows)
    ent = runtime.get_entitlements()
    if ent is None:
        return await budget.usage(user, events=events), plan
    try:
        report = await ent.usage(budget, user, events=events, plan_name=plan.name)
    except StoreUnavailable as exc:
        raise LimiterUnavailableError("the usage limiter is unavailable",
                                      headers=retry_after_header(1)) from exc
    if not report.loaded:  # operator changes kept overtaking the load
        raise LimiterUnavailableError("the usage limiter is unavailable",
                                      headers=retry_after_header(1))
    until = report.suspended_until_ms
    if until is not None:
        raise AccountSuspended("this account is suspended", until=iso(until) if until else None)
    return report, settings().plans.get(report.plan_name) or plan


async def read_history(user: str) -> tuple[list[Any], list[Any]]:
    """The user's recently ended grants and support refunds (``EntitlementCache.history``);
    nothing with entitlements off. A grant seen expired with tokens unused is recorded and
    reported (``Atto Credit Expired``) on the way.

    Raises:
        LimiterUnavailableError: DynamoDB could not be reached.
    """
    ent = runtime.get_entitlements()
    if ent is None:
        return [], []
    try:
        return await ent.history(user)
    except StoreUnavailable as exc:
        raise LimiterUnavailableError("the usage limiter is unavailable",
                                      headers=retry_after_header(1)) from exc


def _route_path(request: Request) -> str:
    """The matched route's path template, or the URL's path when no route matched."""
    path = getattr(request.scope.get("route"), "path", None)
    return path if isinstance(path, str) else request.url.path


class TokenGuard:
    """What one ``require_tokens(cost)`` declares, and the steps that charge it.

    ``MeteredRoute`` finds the guard of a route when the route is made and runs its steps
    itself: ``identify`` before FastAPI validates the request, ``prepare`` and ``charge``
    once it is valid. FastAPI then never solves the dependency per request. When FastAPI
    does solve it (a route of an included router, or the guard inside another dependency),
    the dependency runs ``identify`` and ``prepare`` and leaves ``charge`` to the route's
    endpoint wrapper, as ``RequestState.meter``.

    Attributes:
        cost: the declared cost: a positive integer, or a ``Cost`` of the request model.
        route: the name recorded on the spend event (None: the route's path).
    """

    __slots__ = ("cost", "route")

    def __init__(self, cost: int | Cost[Any], route: str | None) -> None:
        self.cost = cost
        self.route = route

    def identify(self, request: Request) -> None:
        """Identify the caller and the request id before anything else is done.

        Raises:
            Unauthorized: the request names no user (401).
            InvalidRequest: its Idempotency-Key is malformed (400).
        """
        _identify(request)
        identity.request_id(request)

    def prepare(self, request: Request, state: RequestState) -> Charge:
        """The charge to be made for an identified request, under the caller's plan.

        Returns:
            The charge, not yet reserved (cost 0), also kept as ``state.pending``.
        """
        plan = identity.plan(request).plan
        state.plan_name = plan.name
        # The route's throttled provider calls queue as this user, with the plan's share.
        bind_share(identity.user_id(request), plan.weight)
        charge = state.pending = Charge(
            runtime.get_budget(plan.windows), identity.user_id(request),
            identity.request_id(request), 0, nonce="", entitlements=runtime.get_entitlements())
        return charge

    def cost_of(self, arguments: dict[str, Any]) -> int:
        """The request's cost: the fixed one, or the rule's for the validated request model.

        Raises:
            InvalidArgument: the route takes no argument of the ``Cost``'s model.
        """
        declared = self.cost
        if isinstance(declared, int):
            return declared
        model = next((v for v in arguments.values() if isinstance(v, declared.model)), None)
        if model is None:
            raise InvalidArgument(f"the route takes no {declared.model.__name__} to price")
        return declared.of(model)

    async def charge(self, state: RequestState, cost: int, route: str, *,
                     again: bool = False) -> Charge:
        """Reserve ``cost`` tokens for the prepared charge, or raise the public error.

        The charge is provisional (``web.holds``): the middleware confirms it when the
        request succeeds. A refusal (429) or an id already charged (409) first undoes the
        user's expired provisional charges, and when that freed this id or some room, the
        reservation is made once more.

        Args:
            state: the request's state, with the charge ``prepare`` made.
            cost: tokens to reserve.
            route: the name recorded on the spend event.
            again: this is that second reservation.

        Returns:
            The charge, now holding ``cost`` tokens (also ``state.charge``).

        Raises:
            BudgetExceeded: the budget has no room (429).
            CostExceedsPlan: the cost can never fit a window of the plan (422).
            IdempotencyConflict: the request id was charged already (409).
            AccountSuspended: the account is suspended (403).
            LimiterUnavailableError: Redis or the entitlements store failed (503).
        """
        state.route_cost = cost
        charge = state.pending
        if charge is None:
            raise InvalidArgument("no charge was prepared for this request")
        user, rid, budget, ent = charge.user_id, charge.request_id, charge.budget, \
            charge.entitlements
        nonce = new_nonce()
        hold_ms = holds.hold_ms(state.remaining_ms)
        try:
            if ent is None:
                reservation = await budget.reserve(user, rid, cost=cost, route=route,
                                                   nonce=nonce, hold_ms=hold_ms)
            else:  # loads the user's entitlements first when the cache has none
                reservation = await ent.reserve(budget, user, rid, cost, route=route,
                                                nonce=nonce, plan_name=state.plan_name,
                                                hold_ms=hold_ms)
        except LimiterUnavailable as exc:
            # Redis may have made the charge and lost only its reply (a kill or a timeout
            # after the script ran): refund it later, when Redis answers again. The refund
            # carries this call's nonce, so it removes that charge or nothing: never the
            # charge of a retry that another environment served under the same id.
            refunds.keep(Charge(budget, user, rid, cost, nonce, entitlements=ent),
                         settings().plans.longest_s)
            raise LimiterUnavailableError(
                "the usage limiter did not answer; this request may have been charged, and "
                "if it was, the charge will be refunded", headers=retry_after_header(1),
                charged="unknown") from exc
        except StoreUnavailable as exc:  # a load was needed; nothing was charged
            raise LimiterUnavailableError(
                "the usage limiter is unavailable; nothing was charged",
                headers=retry_after_header(1)) from exc
        except CostExceedsLimit as exc:
            from .metering import _read_windows  # metering imports this module

            await _read_windows(state)  # the 422's RateLimit fields, and the quota's room
            raise _cost_exceeds_plan(cost, exc, budget.windows[-1].seconds,
                                     entitled=ent is not None, windows=state.windows) from exc
        if ent is not None:
            _check_entitlements(reservation)
            state.plan_name = reservation.plan_name or state.plan_name
        state.reservation = reservation
        if reservation.status in ("duplicate", "rejected") and not again:
            undone = await holds.undo(budget, ent, user)
            if undone and (reservation.status == "rejected" or rid in undone):
                return await self.charge(state, cost, route, again=True)
        if not reservation.allowed:
            obs.count(obs.BUDGET_REJECTED)
            extra = {} if ent is None else {"credit": reservation.credit or 0}
            raise BudgetExceeded(
                f"token budget exceeded: this request costs {cost} tokens"
                + _why_refused(reservation, ent is not None),
                headers=retry_after_header(reservation.retry_after_s),
                retry_after_s=round(reservation.retry_after_s, 3), limit=reservation.limit,
                remaining=reservation.remaining, window_s=_seconds(reservation.window_s),
                cost=cost, **extra)
        if reservation.duplicate:
            raise IdempotencyConflict(
                "this Idempotency-Key was already used for a request that was charged; "
                "use a new key for a new request")
        charge.cost, charge.nonce, charge.reservation = cost, nonce, reservation
        if ent is not None and reservation.drawn > 0:
            await _record_draw(state, charge, ent, reservation, route)
        state.charge = charge
        records.start(charge, route=route, plan=state.plan_name)  # beside the provider call
        obs.count(obs.TOKENS_RESERVED, cost)
        if reservation.crossings:  # published alongside the request, within a short bound
            events.publish_soon(events.threshold_events(user, state.plan_name,
                                                        reservation.crossings))
        return charge


#: Attribute of a ``require_tokens`` dependency holding its ``TokenGuard``.
GUARD_ATTR = "token_guard"


def token_guard(call: object) -> TokenGuard | None:
    """The ``TokenGuard`` of a ``require_tokens`` dependency; None for any other callable."""
    guard = getattr(call, GUARD_ATTR, None)
    return guard if isinstance(guard, TokenGuard) else None


def require_tokens(
    cost: int | Cost[Any], *, route: str | None = None
) -> Callable[[Request], Awaitable[Charge]]:
    """A FastAPI dependency that reserves ``cost`` tokens once the request is validated.

    On a route of ``create_app`` the route itself identifies the caller and makes the
    charge (``web.metering``); FastAPI never calls the dependency, and a parameter declared
    with it receives the request's ``Charge``.

    Args:
        cost: tokens this route costs: a positive integer, or a ``Cost`` computed from the
            route's validated request model (``costs.per_started``).
        route: the name recorded on the spend event (default: the route's path).

    Returns:
        The dependency; it gives the route the request's ``Charge``.

    Raises:
        InvalidArgument: ``cost`` is neither a positive integer nor a ``Cost`` (at import
            time).
    """
    if not isinstance(cost, Cost) and (isinstance(cost, bool) or not isinstance(cost, int)
                                       or cost <= 0):
        raise InvalidArgument(f"require_tokens: cost must be a positive integer or a Cost, "
                              f"got {cost!r}")
    guard = TokenGuard(cost, route)

    async def reserve_tokens(request: Request) -> Charge:
        """Identify the caller and prepare the charge; the metered route's wrapper makes it
        (FastAPI calls this only where the route could not take the guard over)."""
        if not getattr(request.scope.get("route"), METERED_ROUTE, False):
            raise InvalidArgument("require_tokens is only for routes of an app made by create_app")
        guard.identify(request)
        state = request_state(request)
        charge = guard.prepare(request, state)

        async def meter(arguments: dict[str, Any]) -> Charge:
            return await guard.charge(state, guard.cost_of(arguments),
                                      guard.route or _route_path(request))

        state.meter = meter
        return charge

    reserve_tokens.__name__ = (f"require_tokens_{cost}" if isinstance(cost, int)
                               else f"require_tokens_per_{cost.model.__name__}")
    reserve_tokens.cost = price(cost)  # type: ignore[attr-defined]  # read by the price-list test
    setattr(reserve_tokens, GUARD_ATTR, guard)
    return reserve_tokens


def _check_entitlements(reservation: Reservation) -> None:
    """Raise the public error of a reservation the user's entitlements refused.

    Raises:
        AccountSuspended: the account is suspended (nothing was charged).
        LimiterUnavailableError: the user's entitlements could not be loaded (operator
            changes kept overtaking the load); nothing was charged.
    """
    if reservation.status == "suspended":
        until = reservation.suspended_until_ms
        raise AccountSuspended("this account is suspended; nothing was charged",
                               until=iso(until) if until else None)
    if reservation.status == "not_loaded":
        raise LimiterUnavailableError("the usage limiter is unavailable; nothing was charged",
                                      headers=retry_after_header(1))


def _why_refused(reservation: Reservation, entitled: bool) -> str:
    """The end of a 429's message: which window is full and whether credit could help."""
    if not entitled:
        return ""
    window_s = _seconds(reservation.window_s)
    if reservation.windows and reservation.window_s == reservation.windows[-1].window_s:
        return (f"; your plan's quota (the {window_s} s window) lacks room for it and your "
                f"credit ({reservation.credit or 0} tokens) does not cover the rest: more "
                "credit, or waiting Retry-After, lets it be served")
    return (f"; the {window_s} s window is full, and credit pays only beyond the quota "
            "(the plan's longest window): wait Retry-After")


def _cost_exceeds_plan(cost: int, exc: CostExceedsLimit, longest_s: float, *,
                       entitled: bool, windows: tuple[WindowUsage, ...] = ()
                       ) -> CostExceedsPlan:
    """The 422 for a cost the plan used cannot serve, saying whether credit could help.

    ``exc.credit`` is set when the window is the plan's quota: credit pays the part beyond
    it, and the user's live credit is short of that part. ``credit_needed`` is the credit
    that serves the request now: the cost less the room the quota has left (``windows``,
    read after the refusal; the quota is the last), not merely the cost less the quota,
    since a quota partly spent covers only its room. Without ``windows`` (the read failed)
    it is ``cost - limit``, the least that could do. A shorter window bounds every
    request, credit or not.
    """
    window_s = int(exc.window_s if exc.window_s is not None else longest_s)
    limit = int(exc.limit)
    if exc.credit is not None:
        quota = windows[-1] if windows and int(windows[-1].window_s) == window_s else None
        needed = cost - (limit if quota is None else min(limit, max(quota.remaining, 0)))
        return CostExceedsPlan(
            f"this request costs {cost} tokens, more than your plan's quota of {limit} "
            f"tokens per {window_s} s; credit pays the part beyond the quota, and it needs "
            f"{needed} tokens of credit where you have {exc.credit}: more credit would let "
            "it be served", cost=cost, limit=limit, window_s=window_s,
            credit=exc.credit, credit_needed=needed)
    why = ("; credit cannot pay for it (credit pays only beyond the quota, the plan's "
           "longest window), so" if entitled else ";")
    return CostExceedsPlan(
        f"this request costs {cost} tokens, more than your plan allows in a window of "
        f"{window_s} s{why} it can never be served under this plan",
        cost=cost, limit=limit, window_s=window_s)


async def _record_draw(state: RequestState, charge: Charge, ent: EntitlementCache,
                       reservation: Reservation, route: str) -> None:
    """Record the charge's draws from grants in DynamoDB before the route runs.

    Raises:
        LimiterUnavailableError: they could not be recorded; the charge is refunded (or
            kept to be refunded) and no provider is called. The answer says nothing was
            charged only when that is known.
    """
    outcome = await ent.commit_draw(charge.budget, charge.user_id, charge.request_id,
                                    charge.nonce, reservation, route=route)
    charge.credit = outcome
    if outcome == "recorded":
        obs.count(obs.CREDIT_DRAWN, reservation.drawn)
        if reservation.credit_crossings:
            events.publish_soon(events.credit_events(charge.user_id, state.plan_name,
                                                     reservation.credit_crossings))
        return
    records.start(charge, route=route, plan=state.plan_name)  # made, and refunded below
    state.reservation = None  # no RateLimit fields claiming a charge that is undone
    charge.uncross = reservation.crossings  # never reported: the next crossing reports them
    known = outcome == "undone"
    try:
        await charge.refund()
    except CreditPending:  # the ledger's part is done; DynamoDB's is kept
        obs.logger().warning("refund of a draw whose record is unknown; kept")
        charge.cost = reservation.cost
        refunds.keep(charge, settings().plans.longest_s)
        known = False
    except Exception:  # Redis failed too: refund before this environment's next request
        obs.logger().exception("refund of an unrecorded draw failed; kept")
        charge.cost = reservation.cost
        refunds.keep(charge, settings().plans.longest_s)
        known = False
    message = ("the usage limiter is unavailable; nothing was charged" if known else
               "the usage limiter is unavailable; this request may have been charged, and "
               "the tokens will be refunded")
    raise LimiterUnavailableError(message, headers=retry_after_header(1))


def _seconds(value: float) -> float | int:
    """A window length as JSON shows it: whole seconds as an integer."""
    return int(value) if float(value).is_integer() else value
