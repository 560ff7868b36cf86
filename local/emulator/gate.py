"""The gate every provider endpoint passes: count, authenticate, decide, delay, answer.

Order for each arrival: count it (arrival time, in-flight), check credentials (an
unauthenticated request never uses rate capacity), take a queued forced outcome, apply
the request rate and the token rate, draw a random failure, run the handler, wait the
configured latency, count the status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from .dialects import (
    ANSWER_KINDS,
    ApiFault,
    brave_rate_headers,
    forced_fault,
    json_body,
    openai_rate_headers,
    render,
)
from .state import EmulatorState

log = logging.getLogger("local.emulator")

Handler = Callable[[Request], Awaitable[Response]]
AuthCheck = Callable[[Request], Awaitable[ApiFault | None]]
CostFn = Callable[[Request], Awaitable[int]]


async def request_json(request: Request) -> Any:
    """The request's JSON body, parsed once.

    Raises:
        ApiFault: 400 when the body is not JSON.
    """
    if not hasattr(request.state, "json_body"):
        request.state.json_body = json_body(await request.body())
    return request.state.json_body


async def sleep_while_connected(request: Request, seconds: float) -> None:
    """Sleep ``seconds``, or less if the client hangs up (so shutdown need not wait)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        await asyncio.sleep(min(left, 0.05))
        if await request.is_disconnected():
            return


def gated(family: str, dialect: str, route: str, *, auth: AuthCheck | None = None,
          cost: CostFn | None = None) -> Callable[[Handler], Handler]:
    """Wrap a handler of ``family`` whose errors speak ``dialect``; ``route`` names it in stats."""

    def wrap(handler: Handler) -> Handler:
        async def endpoint(request: Request) -> Response:
            emu: EmulatorState = request.app.state.emulator
            fam = emu.families[family]
            stamp = fam.arrive(route)
            status = 500
            try:
                response, delay = await _answer(request, fam, dialect, handler, auth, cost)
                if delay > 0:
                    await sleep_while_connected(request, delay)
                headroom = fam.rate_headroom()
                if headroom and dialect == "openai":
                    response.headers.update(openai_rate_headers(*headroom))
                elif headroom and dialect == "brave":
                    response.headers.update(brave_rate_headers(*headroom))
                status = response.status_code
                return response
            finally:
                fam.finish(status, stamp)

        endpoint.__name__ = getattr(handler, "__name__", route)
        endpoint.__doc__ = handler.__doc__
        return endpoint

    return wrap


async def _answer(request: Request, fam: Any, dialect: str, handler: Handler,
                  auth: AuthCheck | None, cost: CostFn | None) -> tuple[Response, float]:
    model = ""
    try:
        if auth is not None and fam.config.require_auth:
            fault = await auth(request)
            if fault is not None:
                return render(dialect, fault), fam.config.latency_ms / 1000
        weight = 0
        if cost is not None and fam.config.token_rate is not None:
            try:
                weight = await cost(request)
            except ApiFault:
                weight = 0  # the handler reports the malformed body
        decision = fam.decide(weight)
        if decision.kind in ANSWER_KINDS:
            request.state.forced_kind = decision.kind  # the handler shapes this answer
        elif decision.kind:
            fault = forced_fault(decision.kind, decision.retry_after_s, decision.message)
            return render(dialect, fault), decision.delay_s
        elif decision.outcome != "ok":
            if dialect == "openai":
                model = await _model_of(request)
            details = {} if decision.rate is None else {
                "limit": decision.rate.limit, "window_s": decision.rate.window_s}
            fault = ApiFault(decision.status, decision.message, kind=decision.outcome,
                             retry_after_s=decision.retry_after_s, details=details)
            return render(dialect, fault, model=model), decision.delay_s
        try:
            return await handler(request), decision.delay_s
        except ApiFault as fault:
            return render(dialect, fault), decision.delay_s
    except ApiFault as fault:
        return render(dialect, fault), 0.0
    except Exception as exc:  # noqa: BLE001 - an emulator bug must still answer
        log.exception("emulator handler failed")
        bug = ApiFault(500, f"emulator error: {type(exc).__name__}: {exc}", kind="server")
        return render(dialect, bug), 0.0


async def _model_of(request: Request) -> str:
    try:
        body = await request_json(request)
    except ApiFault:
        return ""
    return str(body.get("model", "")) if isinstance(body, dict) else ""
