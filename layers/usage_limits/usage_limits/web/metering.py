"""``MeteredRoute``: charges a request after FastAPI has validated it, before the route runs.

FastAPI solves a route's dependencies before it validates the body and query, so a guard
that reserved inside its dependency would charge (and refund) every malformed request and
answer 429 instead of 422 to a user without budget. ``create_app`` makes every route a
``MeteredRoute`` instead: ``require_tokens`` only identifies the caller and prepares the
charge, and the route's endpoint is wrapped so that, once every argument is valid,

1. a request with an ``Idempotency-Key`` claims its key (``web.idempotency``): a repeat of a
   completed request gets the stored answer (``Idempotent-Replayed: true``, nothing charged,
   no provider called), a repeat of one in flight or a reuse for another request gets 409
   ``idempotency_conflict``;
2. the cost is computed (fixed, or from the validated request model) and reserved;
3. the route's own code runs.

A replay and a 409 reserve nothing, so the guard reads the user's windows (one script call)
for their ``RateLimit`` headers: a replay costs three Redis round trips (the key's SET NX and
GET, then the usage read).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

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
    IdempotencyConflict,
    LimiterUnavailableError,
    retry_after_header,
)
from .guard import RequestState, request_state

#: The endpoint argument the wrapper adds to receive the request (never the route's own).
_REQUEST_ARG = "_metered_request"


class MeteredRoute(APIRoute):
    """A FastAPI route whose ``require_tokens`` charge is made after validation."""

    reserves_after_validation = True  # guard.METERED_ROUTE: the guard checks routes by it

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, metered(endpoint), **kwargs)


def metered(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``endpoint`` wrapped to claim the key and reserve the charge just before it runs.

    The wrapper's signature is the endpoint's plus one ``Request`` argument, so FastAPI
    validates exactly what the endpoint declares and hands the wrapper the request.

    Raises:
        InvalidArgument: the endpoint has an argument of the wrapper's own name.
    """
    signature = inspect.signature(endpoint, eval_str=True)
    if _REQUEST_ARG in signature.parameters:
        raise InvalidArgument(f"an endpoint may not take an argument named {_REQUEST_ARG}")
    is_async = inspect.iscoroutinefunction(endpoint)

    @functools.wraps(endpoint)
    async def wrapper(**arguments: Any) -> Any:
        state = request_state(arguments.pop(_REQUEST_ARG))
        if state.meter is not None:
            if state.idempotency is not None:
                answer = await claim_key(state)
                if answer is not None:
                    return answer
            await state.meter(arguments)
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
        IdempotencyConflict: the key's first request is in flight, or the key was used for
            another request.
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
        raise IdempotencyConflict(
            "this Idempotency-Key was used for a different request") from None
    except Exception as exc:  # LimiterUnavailable, or anything else the store raised
        if not isinstance(exc, LimiterUnavailable):
            obs.logger().exception("idempotency store failed")
        raise LimiterUnavailableError("the usage limiter is unavailable; nothing was charged",
                                      headers=retry_after_header(1)) from exc
    if replay is None:
        state.claimed = record
        return None
    await _read_windows(state)
    return Response(replay.body, status_code=replay.status,
                    headers={**dict(replay.headers), idem.REPLAY_HEADER: "true"})


async def _read_windows(state: RequestState) -> None:
    """Read the user's windows for the RateLimit headers of an answer that reserved nothing.

    The answer goes out without those headers when Redis fails now (it answered the key's
    claim a moment ago): the stored answer or the conflict matters more than the headers.
    With entitlements on, a suspended account gets its 403 here too: a replay is a
    metered request, and it is refused like any other.

    Raises:
        AccountSuspended: the account is suspended.
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
    except Exception:
        obs.logger().warning("could not read the usage for the RateLimit headers")
        return
    state.windows = usage.windows
    until = usage.suspended_until_ms
    if charge.entitlements is not None and until is not None:
        raise AccountSuspended("this account is suspended", until=iso(until) if until else None)
