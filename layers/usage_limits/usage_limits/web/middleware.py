"""``UsageLimitsMiddleware``: the request boundary of every function.

A small pure-ASGI middleware (no BaseHTTPMiddleware, no extra task) that, per request:

1. sets the request deadline from the Lambda context (``scope["aws.context"]``);
2. caps the body size (413 ``payload_too_large`` before any handler or charge);
3. notes a keyed request's idempotency record (claimed after validation, by
   ``web.metering``), and stores a successful answer for repeats before sending it: an
   answer that cannot be stored is withheld (503, refunded), so every answer a client
   got is one a repeat gets again;
4. records the response status and adds the ``RateLimit-Policy``/``RateLimit`` headers: from
   the reservation, or from the usage read for an answer that reserved nothing (a replay,
   a 409 ``idempotency_conflict``);
5. refunds the request's charge when it did not succeed: the route raised, or the
   response status is 4xx/5xx (a ``yield`` dependency sees raised exceptions but not a
   5xx that a route returns, which is why this lives here);
6. turns any unhandled exception into the public 500 error body;
7. gives every response the request's id in ``X-Request-Id`` (and every error body, through
   ``errors.current_request_id``): the id ``GET /v1/usage`` lists and support refunds by.

Everything after the route shares one clean-up budget (``Cleanup``), which ends
``CLEANUP_SHARE`` of the deadline margin after the request's deadline, so a quarter of
the margin before the Lambda's own timeout (or API Gateway's), whatever Redis does. In
order, each step gets what the earlier ones left:

- the refund: one that does not finish in time is kept and retried before the next request
  (``web.refunds``);
- a keyed success's answer stored (``web.idempotency``) before it is sent, after its
  charge is confirmed: one not stored in time is withheld and refunded, like an
  unconfirmed charge; a failure's claim that is not deleted in time blocks a retry of the
  key (409) until its in-progress expiry (the Lambda's timeout);
- the events still being published: the wait ends, the publications go on in the
  background and are confirmed or counted as failed when the environment runs again.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..deadline import deadline_scope, request_budget_s
from . import events, holds, identity, records, refunds
from . import idempotency as idem
from . import observability as obs
from .errors import (
    LIMITER_UNAVAILABLE_CODE,
    REFUNDED,
    ApiError,
    current_request_id,
    error_response,
)
from .guard import STATE_KEY, RequestState
from .settings import settings

#: The part of the deadline margin that the steps after the route may use; the rest is for
#: the log line, the metrics and handing the response to Mangum.
CLEANUP_SHARE = 0.75


class Cleanup:
    """The time the steps after the route share: until ``end`` (``time.monotonic()``)."""

    def __init__(self) -> None:
        self.end = float("inf")  # set when the request's deadline is known

    def left_s(self) -> float:
        """Seconds left for clean-up (0 when it is spent)."""
        return max(0.0, self.end - time.monotonic())


#: The response header that carries the request's id (``identity.response_id``).
REQUEST_ID_HEADER = b"x-request-id"


class UsageLimitsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        rid = identity.response_id(Request(scope))
        rid_header = (REQUEST_ID_HEADER, rid.encode())

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [h for h in message.get("headers", []) if h[0] != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, rid_header]}
            await send(message)

        cleanup = Cleanup()
        token = current_request_id.set(rid)
        try:
            await self._serve(scope, receive, send_status, cleanup)
        finally:
            current_request_id.reset(token)
            left_s = cleanup.left_s()
            published, written = await asyncio.gather(events.drain(left_s),
                                                      records.drain(left_s))
            if not published:
                obs.logger().warning("events still being published at the clean-up bound")
            if not written:
                obs.logger().warning("usage records kept at the clean-up bound")
            obs.request_done(_route_key(scope), status or 500)
            obs.flush()

    async def _serve(self, scope: Scope, receive: Receive, send: Send,
                     cleanup: Cleanup) -> None:
        conf = settings()
        state = RequestState()
        scope.setdefault("state", {})[STATE_KEY] = state
        context = scope.get("aws.context")
        remaining_ms = (context.get_remaining_time_in_millis() if context is not None
                        else int(conf.request_timeout_s * 1000))
        with deadline_scope(request_budget_s(remaining_ms, conf.deadline_margin_s)) as deadline:
            cleanup.end = deadline + conf.deadline_margin_s * CLEANUP_SHARE
            body = await _read_body(scope, receive, conf.max_body_bytes)
            if body is None:
                await error_response(413, "payload_too_large",
                                     f"request body is larger than {conf.max_body_bytes} bytes",
                                     limit_bytes=conf.max_body_bytes)(scope, receive, send)
                return
            state.idempotency = _idempotency_record(scope, body)
            state.remaining_ms = remaining_ms
            await self._run(scope, _replay(body, receive), send, state, cleanup)

    async def _run(self, scope: Scope, receive: Receive, send: Send,
                   state: RequestState, cleanup: Cleanup) -> None:
        started = time.perf_counter()
        log = obs.logger()
        log.append_keys(request_id=_request_id(scope), x_request_id=current_request_id.get(),
                        route=f"{scope.get('method')} {scope.get('path')}", user=None)
        if refunds.pending() or records.pending():  # each bounded, both at once
            await asyncio.gather(refunds.retry(), records.retry())
        status = 0
        response_headers: list[tuple[bytes, bytes]] = []
        response_body: list[bytes] = []
        held: list[Message] = []  # a failed request's answer, sent once its refund is done
        refund: _Refund | None = None
        withheld = False  # a success whose charge could not be confirmed: answered 503
        claimed: tuple[Any, ...] = ()  # the user's expired charges, claimed by the confirm
        keyed_start: Message | None = None  # a keyed success's start, sent once it is stored
        stored = False  # the keyed success's answer is stored for repeats

        async def refund_once() -> _Refund:
            nonlocal refund
            if refund is None:
                refund = await _refund(state, cleanup)
            return refund

        async def send_held() -> None:
            done = await refund_once()
            start, body = held[0], _telling(b"".join(m.get("body", b"") for m in held[1:]),
                                            done.landed)
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            if state.reservation is not None or state.windows:
                headers += _ratelimit_headers(state, done.landed)
            held.clear()
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        async def send_stored(start: Message) -> None:
            """Store a keyed success's answer, then send it; withhold it when not stored."""
            nonlocal withheld, status, stored
            body = b"".join(response_body)
            try:
                async with asyncio.timeout(cleanup.left_s()):
                    await idem.complete(state.claimed or {}, status, response_headers, body)
            except Exception:  # an answer sent must be one a repeat gets: withhold it
                log.exception("could not store the answer for its Idempotency-Key")
                withheld, status = True, 503
                held.extend(_withheld(UNSTORED))
                await send_held()
                return
            stored = True
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})

        async def send_with_headers(message: Message) -> None:
            nonlocal status, response_headers, withheld, claimed, keyed_start
            if withheld:
                return  # the success's body: its answer was replaced
            if message["type"] == "http.response.start":
                status = message["status"]
                response_headers = list(message.get("headers", []))
                charge = state.charge
                if charge is not None and status < 400 and charge.cost > 0:
                    # a success stands only with its charge confirmed (web.holds)
                    confirmed, claimed = await holds.confirm(charge, cleanup.left_s())
                    if not confirmed:
                        withheld, status = True, 503
                        held.extend(_withheld(UNCONFIRMED))
                        await send_held()
                        return
                if state.charge is not None and status >= 400:
                    held.append(message)  # refund first, so that the answer tells the truth
                    return
                if state.reservation is not None or state.windows:
                    message = {**message, "headers": response_headers
                               + _ratelimit_headers(state, False)}
                if state.claimed is not None and 200 <= status < 300:
                    keyed_start = message  # sent once its answer is stored
                    return
            elif message["type"] == "http.response.body":
                if keyed_start is not None:
                    response_body.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        await send_stored(keyed_start)
                    return
                if held:
                    held.append(message)
                    if not message.get("more_body", False):
                        await send_held()
                    return
            await send(message)

        try:
            tracer = obs.tracer()
            if tracer is None:
                await self.app(scope, receive, send_with_headers)
            else:
                async with tracer.provider.in_subsegment_async(f"## {scope.get('path')}"):
                    await self.app(scope, receive, send_with_headers)
        except Exception:
            log.exception("unhandled error")
            if status == 0 or (keyed_start is not None and not stored):
                keyed_start = None  # a keyed success cut short was never sent: a 500 instead
                await error_response(500, "internal_error", "internal error")(
                    scope, receive, send_with_headers)
            status = status or 500
        finally:
            charge = state.charge
            if charge is not None and (status >= 400 or status == 0):
                await refund_once()
            if held:  # the route stopped sending half way
                await send_held()
            if claimed and charge is not None:  # the user's charges never confirmed
                await holds.undo(charge.budget, charge.entitlements, charge.user_id, claimed,
                                 cleanup.left_s())
            refunded = refund.tokens if refund is not None else 0
            record = state.claimed
            if record is not None and not stored:  # failed or withheld: free the key
                try:
                    async with asyncio.timeout(cleanup.left_s()):
                        await idem.abandon(record)
                except Exception:  # the claim expires on its own (see the docstring)
                    log.exception("could not delete the idempotency claim")
            log.info("request", extra={
                "status": status, "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                "tokens_charged": charge.cost if charge is not None else 0,
                "tokens_refunded": refunded})


#: The answer of a success whose charge could not be confirmed (``web.holds``).
UNCONFIRMED = ("the usage limiter could not confirm this request's charge, so its answer is "
               "withheld; tokens refunded")
#: The answer of a keyed success whose answer could not be stored (``web.idempotency``).
UNSTORED = ("the answer could not be stored for this Idempotency-Key, so it is withheld; "
            "tokens refunded")


def _withheld(message: str) -> list[Message]:
    """The 503 that replaces a success that cannot stand (its charge not confirmed, or its
    answer not stored): start and body.

    Sent through the failed-request path: the charge is refunded first, and the message
    says so when that refund did not finish.
    """
    body = json.dumps({"error": {"code": LIMITER_UNAVAILABLE_CODE, "message": message,
                                 "request_id": current_request_id.get()}}).encode()
    obs.count(obs.LIMITER_UNAVAILABLE)
    return [{"type": "http.response.start", "status": 503,
             "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]},
            {"type": "http.response.body", "body": body, "more_body": False}]


@dataclass(frozen=True)
class _Refund:
    """How a failed request's refund went.

    Attributes:
        landed: the refund finished: the charge is gone (or was never made).
        tokens: tokens it gave back.
    """

    landed: bool
    tokens: int


async def _refund(state: RequestState, cleanup: Cleanup) -> _Refund:
    """Refund the request's charge within the clean-up budget; kept for later if it fails."""
    charge = state.charge
    if charge is None:
        return _Refund(True, 0)
    cost = charge.cost
    try:
        async with asyncio.timeout(cleanup.left_s()):
            removed = await charge.refund()
    except Exception:  # retried before the next request
        obs.logger().exception("refund failed; kept to retry before the next request")
        charge.cost = cost
        refunds.keep(charge, settings().plans.longest_s)
        return _Refund(False, 0)
    if not removed:
        return _Refund(True, 0)
    obs.count(obs.TOKENS_REFUNDED, cost)
    return _Refund(True, cost)


#: Said in a failed request's error body when its refund did not finish.
REFUND_KEPT = ("this request may still be charged: the refund of its charge did not finish "
               "and will be retried")


def _telling(body: bytes, landed: bool) -> bytes:
    """A failed request's error body, saying so when its charge may not be refunded yet."""
    if landed:
        return body
    try:
        answer = json.loads(body)
    except ValueError:
        return body
    error = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(error, dict):
        return body
    message = str(error.get("message", "")).removesuffix("; tokens refunded") \
        .removesuffix(f"; {REFUNDED}")  # a 502's or a 503's (ProviderError, provider_busy)
    error.update(message=f"{message}; {REFUND_KEPT}", charged="unknown")
    return json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode()


def _route_key(scope: Scope) -> str | None:
    """The request's API route key (``"POST /v1/structured"``), None when it matched none.

    In Lambda it is API Gateway's ``routeKey`` (only configured routes reach a function);
    elsewhere the method and the path template of the route FastAPI matched.
    """
    event = scope.get("aws.event") or {}
    key = event.get("routeKey")
    if isinstance(key, str) and key and key != "$default":
        return key
    path = getattr(scope.get("route"), "path", None)
    return f"{scope.get('method')} {path}" if isinstance(path, str) else None


def _idempotency_record(scope: Scope, body: bytes) -> dict[str, Any] | None:
    """The idempotency record of a request with a valid key from an identified user (None
    when answers are not stored: no ``ATTO_IDEMPOTENCY_TABLE``)."""
    if not idem.enabled():
        return None
    request = Request(scope)
    try:
        user = identity.user_id(request)
        key = identity.request_id(request)
    except ApiError:
        return None  # the route answers 401/400 itself
    if not key.startswith("k:"):
        return None
    return idem.record_data(user, key, scope.get("method", ""), scope.get("path", ""),
                            scope.get("query_string", b""), body)


async def _read_body(scope: Scope, receive: Receive, cap: int) -> bytes | None:
    """The whole request body, or None when it is larger than ``cap`` bytes."""
    for name, value in scope.get("headers", []):
        if name == b"content-length" and value.isdigit() and int(value) > cap:
            return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _request_id(scope: Scope) -> str | None:
    context = scope.get("aws.context")
    if context is not None:
        return getattr(context, "aws_request_id", None)
    event = scope.get("aws.event") or {}
    return (event.get("requestContext") or {}).get("requestId")


def _label(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


@lru_cache(maxsize=32)
def _window_fields(limit: int, window_s: float) -> tuple[str, str]:
    """A window's label and its ``RateLimit-Policy`` item: the same for every request.

    The quotas count tokens. The draft's ``qu`` takes only the units of its registry
    (``requests``, the default, ``content-bytes``, ``concurrent-requests``), so the unit
    goes in a vendor-prefixed parameter, as the draft asks of service-specific ones.
    """
    label = _label(int(window_s))
    return label, f'"{label}";q={limit};w={int(window_s)};{UNIT_PARAM}="tokens"'


#: The vendor-prefixed parameters of the RateLimit fields: the quota unit (on every policy
#: item) and the live credit (on the quota's item in ``RateLimit``).
UNIT_PARAM, CREDIT_PARAM = "atto-qu", "atto-credit"


def _ratelimit_headers(state: RequestState, refunding: bool) -> list[tuple[bytes, bytes]]:
    """IETF ``RateLimit-Policy`` and ``RateLimit`` fields, one item per window, in tokens.

    The windows are as the reservation left them; ``r`` also counts what the request gave
    back since: a settle's difference, and when the request failed, the refund about to be
    made, so the client sees what it really has left. ``t`` is 0 for a window that holds
    nothing (after that refund).

    With entitlements on, credit pays what the quota (the longest window) cannot, so the
    quota's ``r`` is what that window admits with credit: its own room plus the live
    credit, and its item carries the credit alone as ``atto-credit``. A separate policy
    item for credit would wrongly cap a client that obeys every item's ``r`` at the credit.
    """
    reservation = state.reservation
    windows = reservation.windows if reservation is not None else state.windows
    if not windows:
        return []
    credit = reservation.credit if reservation is not None else state.credit
    charge = state.charge
    give_back = drawn = 0
    if charge is not None and charge.reservation is not None:
        give_back = charge.reservation.cost - (0 if refunding else charge.cost)
        drawn = charge.reservation.drawn
    now = time.time()
    policies, limits = [], []
    quota = len(windows) - 1
    for i, w in enumerate(windows):
        label, policy = _window_fields(w.limit, w.window_s)
        policies.append(policy)
        back, extra = give_back, ""
        remaining = min(w.limit, w.remaining + back)
        if i == quota and credit is not None:
            returned = min(give_back, drawn)  # a lowering gives drawn credit back first
            back = give_back - returned
            credit_left = credit + returned
            remaining = min(w.limit, w.remaining + back) + credit_left
            extra = f";{CREDIT_PARAM}={credit_left}"
        # an empty window (nothing counted, or only this request's refunded charge) has
        # nothing to wait for: t=0, as /v1/usage shows resets_at null
        resets_at = w.resets_at
        empty = resets_at is None or w.used <= back
        reset = 0 if resets_at is None or empty else max(0, round(resets_at - now))
        limits.append(f'"{label}";r={remaining};t={reset}{extra}')
    return [(b"ratelimit-policy", ", ".join(policies).encode()),
            (b"ratelimit", ", ".join(limits).encode())]
