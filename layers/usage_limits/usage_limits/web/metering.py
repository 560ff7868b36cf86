"""``MeteredRoute``: charges a request after FastAPI has validated it, before the route runs.

FastAPI solves a route's dependencies before it validates the body and query, so a guard
that reserved inside its dependency would charge (and refund) every malformed request and
answer 429 instead of 422 to a user without budget. ``create_app`` makes every route a
``MeteredRoute`` instead, which takes the route's ``require_tokens`` guard out of what
FastAPI solves per request (solving one more dependency costs FastAPI tens of
microseconds) and runs its steps itself: before FastAPI validates the request, the caller
is identified (401, and 400 for a malformed ``Idempotency-Key``); the route's endpoint is
wrapped so that, once every argument is valid,

1. the charge is prepared under the caller's plan;
2. a request with an ``Idempotency-Key`` claims its key (``web.idempotency``): a repeat of a
   completed request gets the stored answer (``Idempotent-Replayed: true``, nothing charged,
   no provider called), a repeat of one in flight gets 409 ``idempotency_conflict``, a reuse
   for another request 422 ``idempotency_key_reused``;
3. the cost is computed (fixed, or from the validated request model) and reserved, and a
   parameter declared with ``Depends(require_tokens(...))`` is given the ``Charge``;
4. the route's own code runs.

A replay, a 409 and a 422 of the key reserve nothing, so the guard reads the user's windows
(one script call) for their ``RateLimit`` headers: a replay costs one DynamoDB call (the
refused PutItem returns the stored answer) and one Redis round trip (the usage read).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from ..entitlements.models import iso
from ..exceptions import InvalidArgument, LimiterUnavailable
from . import idempotency as idem
from . import observability as obs
from .errors import (
    AccountSuspended,
    IdempotencyAnswerGone,
    IdempotencyConflict,
    IdempotencyKeyReused,
    LimiterUnavailableError,
    retry_after_header,
)
from .guard import RequestState, TokenGuard, request_state, token_guard

#: The endpoint argument the wrapper adds to receive the request (never the route's own).
_REQUEST_ARG = "_metered_request"


class MeteredRoute(APIRoute):
    """A FastAPI route whose ``require_tokens`` charge is made after validation.

    When the route is made, the ``require_tokens`` dependency it declares (in
    ``dependencies=[...]`` or as a parameter) is taken out of the dependant FastAPI solves
    per request (``solved_dependant``; ``dependant`` keeps it, for OpenAPI and the price
    list): the route identifies the caller itself before FastAPI validates the request, and
    its endpoint wrapper makes the charge once the request is valid, handing a parameter
    declared with the dependency its ``Charge``. A route with several different guards, or
    a guard inside another dependency, is left to FastAPI to solve, as is a route of an
    included router (``RequestState.meter``). ``app.dependency_overrides`` does not
    replace a guard the route took over.
    """

    reserves_after_validation = True  # guard.METERED_ROUTE: the guard checks routes by it
    #: What FastAPI solves per request: ``dependant`` without the route's guard.
    solved_dependant: Dependant

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        self.metering = Metering()
        super().__init__(path, metered(endpoint, self.metering), **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's request handler over the dependant without the guard, identifying the
        caller first (401 and a malformed Idempotency-Key's 400 come before a 422)."""
        dependant = self.dependant
        guard, solved = _take_guard(dependant)
        self.solved_dependant = solved
        if guard is None:
            return super().get_route_handler()
        self.metering.guard, self.metering.route = guard, guard.route or self.path
        self.metering.charge_args = tuple(
            d.name for d in dependant.dependencies if d.name is not None
            and token_guard(d.call) is guard)
        self.dependant = solved
        try:
            handler = super().get_route_handler()
        finally:
            self.dependant = dependant

        async def identified(request: Request) -> Response:
            guard.identify(request)
            return await handler(request)

        return identified


class Metering:
    """What a metered route's endpoint wrapper charges: filled in when the route is made.

    Attributes:
        guard: the route's ``require_tokens`` guard, when the route makes its charge itself.
        route: the name recorded on the spend event.
        charge_args: the endpoint's parameters declared with the guard (they get the Charge).
    """

    __slots__ = ("charge_args", "guard", "route")

    def __init__(self) -> None:
        self.guard: TokenGuard | None = None
        self.route = ""
        self.charge_args: tuple[str, ...] = ()


def _take_guard(dependant: Dependant) -> tuple[TokenGuard | None, Dependant]:
    """The one guard among ``dependant``'s own dependencies, and ``dependant`` without it.

    Returns:
        ``(None, dependant)`` when there is no guard there, or a guard FastAPI has to solve:
        more than one guard, or one inside another dependency.
    """
    guards = {id(g): g for d in dependant.dependencies if (g := token_guard(d.call))}
    if len(guards) != 1 or _nested_guard(dependant):
        return None, dependant
    (guard,) = guards.values()
    rest = [d for d in dependant.dependencies if token_guard(d.call) is None]
    return guard, dataclasses.replace(dependant, dependencies=rest)


def _nested_guard(dependant: Dependant) -> bool:
    """Whether a guard sits inside one of ``dependant``'s dependencies."""
    stack = [sub for d in dependant.dependencies for sub in d.dependencies]
    while stack:
        d = stack.pop()
        if token_guard(d.call) is not None:
            return True
        stack.extend(d.dependencies)
    return False


def metered(endpoint: Callable[..., Any], metering: Metering | None = None) -> Callable[..., Any]:
    """``endpoint`` wrapped to claim the key and reserve the charge just before it runs.

    The wrapper's signature is the endpoint's plus one ``Request`` argument, so FastAPI
    validates exactly what the endpoint declares and hands the wrapper the request.

    Args:
        endpoint: the route's function.
        metering: what the route charges itself (``MeteredRoute`` fills it in); without
            one, only a charge FastAPI's solving of the guard prepared is made.

    Returns:
        The wrapper.

    Raises:
        InvalidArgument: the endpoint has an argument of the wrapper's own name.
    """
    signature = inspect.signature(endpoint, eval_str=True)
    if _REQUEST_ARG in signature.parameters:
        raise InvalidArgument(f"an endpoint may not take an argument named {_REQUEST_ARG}")
    is_async = inspect.iscoroutinefunction(endpoint)
    taken = Metering() if metering is None else metering

    @functools.wraps(endpoint)
    async def wrapper(**arguments: Any) -> Any:
        request = arguments.pop(_REQUEST_ARG)
        state = request_state(request)
        if state.meter is not None:  # FastAPI solved the guard
            if state.idempotency is not None:
                answer = await claim_key(state)
                if answer is not None:
                    return answer
            await state.meter(arguments)
        elif (guard := taken.guard) is not None:
            guard.prepare(request, state)
            if state.idempotency is not None:
                answer = await claim_key(state)
                if answer is not None:
                    return answer
            charge = await guard.charge(state, guard.cost_of(arguments), taken.route)
            for name in taken.charge_args:
                arguments[name] = charge
        if is_async:
            return await endpoint(**arguments)
        return await run_in_threadpool(endpoint, **arguments)

    request_arg = inspect.Parameter(_REQUEST_ARG, inspect.Parameter.KEYWORD_ONLY,
                                    annotation=Request)
    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), request_arg])
    return wrapper


async def claim_key(state: RequestState) -> Response | None:
    """Claim the request's Idempotency-Key; a replay to send, or None to go on.

    Raises:
        IdempotencyConflict: the key's first request is in flight (409).
        IdempotencyKeyReused: the key was used for another request (422).
        IdempotencyAnswerGone: the key's request was served and charged once, and its answer
            is not kept (422).
        LimiterUnavailableError: the idempotency store could not be reached.
    """
    record = state.idempotency
    if record is None:
        return None
    try:
        replay = await idem.begin(record, state.remaining_ms)
    except idem.InFlight:
        await _read_windows(state)
        raise IdempotencyConflict("a request with this Idempotency-Key is still in progress",
                                  headers=retry_after_header(1)) from None
    except idem.KeyReused:
        await _read_windows(state)
        raise IdempotencyKeyReused(
            "this Idempotency-Key was used for a different request (method, path, query or "
            "body): send this request with a new key") from None
    except idem.AnswerGone:
        await _read_windows(state)
        raise IdempotencyAnswerGone(
            "this Idempotency-Key's request was served and charged once; its answer is too "
            "large to keep: use a new key for a new request") from None
    except Exception as exc:  # LimiterUnavailable, or anything else the store raised
        if not isinstance(exc, LimiterUnavailable):
            obs.logger().exception("idempotency store failed")
        raise LimiterUnavailableError("the usage limiter is unavailable; nothing was charged",
                                      headers=retry_after_header(1)) from exc
    if replay is None:
        state.claimed = record
        return None
    await _read_windows(state, replay=True)
    return Response(replay.body, status_code=replay.status,
                    headers={**dict(replay.headers), idem.REPLAY_HEADER: "true"})


async def _read_windows(state: RequestState, *, replay: bool = False) -> None:
    """Read the user's windows for the RateLimit headers of an answer that reserved nothing.

    The answer goes out without those headers when Redis fails now (it answered the key's
    claim a moment ago): the stored answer or the conflict matters more than the headers.
    With entitlements on, a suspended account gets its 403 here too: a replay is a
    metered request, and it is refused like any other. So a replay is never sent when the
    user's entitlements cannot be read (their copy is not loaded and DynamoDB fails): that
    user may be suspended.

    Raises:
        AccountSuspended: the account is suspended.
        LimiterUnavailableError: a replay, with entitlements on, whose user's entitlements
            could not be read.
    """
    charge = state.pending
    if charge is None:
        return
    try:
        if charge.entitlements is None:
            usage = await charge.budget.usage(charge.user_id, events=0)
        else:
            usage = await charge.entitlements.usage(charge.budget, charge.user_id, events=0,
                                                    plan_name=state.plan_name)
    except Exception as exc:
        obs.logger().warning("could not read the usage for the RateLimit headers")
        if replay and charge.entitlements is not None:
            raise LimiterUnavailableError(
                "the usage limiter is unavailable; nothing was charged",
                headers=retry_after_header(1)) from exc
        return
    state.windows = usage.windows
    if charge.entitlements is not None:
        state.credit = sum(g.remaining for g in usage.grants)
    until = usage.suspended_until_ms
    if charge.entitlements is not None and until is not None:
        raise AccountSuspended("this account is suspended", until=iso(until) if until else None)
