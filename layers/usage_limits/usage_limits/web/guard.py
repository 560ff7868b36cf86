"""``require_tokens(cost)``: reserve a user's tokens before a route runs.

    @app.post("/v1/structured", dependencies=[Depends(require_tokens(cost=8))])
    async def structured(body: StructuredIn) -> StructuredOut: ...

The dependency identifies the caller, reserves ``cost`` tokens under the request's id in
one atomic script, and raises the public error when it cannot (429, 409, 401, 503). The
refund is not done here: ``UsageLimitsMiddleware`` sees the final status of the response
(a route may *return* a 5xx, which a dependency never sees) and refunds every charge whose
request did not succeed. A route that learns its real cost can lower the charge:

    async def route(charge: Charge = Depends(require_tokens(cost=10))):
        ...
        await charge.settle(3)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request

from ..budget import new_nonce
from ..exceptions import CostExceedsLimit, InvalidArgument, LimiterUnavailable
from . import identity, refunds, runtime
from . import observability as obs
from .charge import Charge
from .errors import (
    BudgetExceeded,
    CostExceedsPlan,
    IdempotencyConflict,
    LimiterUnavailableError,
    retry_after_header,
)
from .settings import settings

if TYPE_CHECKING:
    from ..budget import Reservation

STATE_KEY = "usage_limits"


@dataclass
class RequestState:
    """What the guard tells the middleware about one request."""

    reservation: Reservation | None = None
    charge: Charge | None = None
    user_id: str | None = None
    route_cost: int = 0


def request_state(request: Request) -> RequestState:
    """The per-request state the middleware created (a fresh one outside the middleware)."""
    scope_state = request.scope.setdefault("state", {})
    state = scope_state.get(STATE_KEY)
    if state is None:
        state = scope_state[STATE_KEY] = RequestState()
    return state  # type: ignore[no-any-return]


def current_user(request: Request) -> str:
    """Dependency for free routes: the caller's id, or 401."""
    user = identity.user_id(request)
    request_state(request).user_id = user
    obs.logger().append_keys(user=obs.hashed_user(user))
    return user


def _route_path(request: Request) -> str:
    """The matched route's path template, or the URL's path when no route matched."""
    path: str = getattr(request.scope.get("route"), "path", request.url.path)
    return path


def require_tokens(
    cost: int, *, route: str | None = None
) -> Callable[[Request], Awaitable[Charge]]:
    """A FastAPI dependency that reserves ``cost`` tokens before the route runs.

    Args:
        cost: tokens this route costs, a positive integer.
        route: the name recorded on the spend event (default: the route's path).

    Raises:
        InvalidArgument: ``cost`` is not a positive integer (at import time).
    """
    if isinstance(cost, bool) or not isinstance(cost, int) or cost <= 0:
        raise InvalidArgument(f"require_tokens: cost must be a positive integer, got {cost!r}")

    async def reserve_tokens(request: Request) -> Charge:
        state = request_state(request)
        state.route_cost = cost
        user = current_user(request)
        rid = identity.request_id(request)
        plan = settings().plan
        budget = runtime.get_budget(plan)
        name = route or _route_path(request)
        nonce = new_nonce()
        try:
            reservation = await budget.reserve(user, rid, cost=cost, route=name, nonce=nonce)
        except LimiterUnavailable as exc:
            # Redis may have made the charge and lost only its reply (a kill or a timeout
            # after the script ran): refund it later, when Redis answers again. The refund
            # carries this call's nonce, so it removes that charge or nothing: never the
            # charge of a retry that another environment served under the same id.
            refunds.keep(Charge(budget, user, rid, cost, nonce),
                         max(seconds for _, seconds in plan))
            raise LimiterUnavailableError(
                "the usage limiter is unavailable; nothing was charged",
                headers=retry_after_header(1)) from exc
        except CostExceedsLimit as exc:
            window_s = next((s for limit, s in plan if limit < cost), plan[-1][1])
            raise CostExceedsPlan(
                f"this request costs {cost} tokens, more than your plan allows in a window "
                f"of {window_s} s; it can never be served under this plan",
                cost=cost, limit=int(exc.limit), window_s=window_s) from exc
        state.reservation = reservation
        if not reservation.allowed:
            obs.count(obs.BUDGET_REJECTED)
            raise BudgetExceeded(
                f"token budget exceeded: this request costs {cost} tokens",
                headers=retry_after_header(reservation.retry_after_s),
                retry_after_s=round(reservation.retry_after_s, 3), limit=reservation.limit,
                remaining=reservation.remaining, window_s=_seconds(reservation.window_s),
                cost=cost)
        if reservation.duplicate:
            raise IdempotencyConflict(
                "this Idempotency-Key was already used for a request that was charged; "
                "use a new key for a new request")
        state.charge = Charge(budget, user, rid, cost, nonce, reservation)
        obs.count(obs.TOKENS_RESERVED, cost)
        return state.charge

    reserve_tokens.__name__ = f"require_tokens_{cost}"
    reserve_tokens.cost = cost  # type: ignore[attr-defined]  # read by the price-list test
    return reserve_tokens


def _seconds(value: float) -> float | int:
    """A window length as JSON shows it: whole seconds as an integer."""
    return int(value) if float(value).is_integer() else value
