"""``create_app``: a FastAPI app with the project's error contract and usage limits wired in.

Every function's ``app.py`` starts with ``app = create_app(...)`` and then declares only its
routes and business logic.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from fastapi import FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..exceptions import InvalidArgument, LimiterUnavailable, ProviderBusy
from .errors import REFUNDED, ApiError, error_response, retry_after_header
from .metering import MeteredRoute
from .middleware import UsageLimitsMiddleware

log = logging.getLogger("usage_limits.web")

_STATUS_CODES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden",
                 404: "not_found", 405: "method_not_allowed", 409: "idempotency_conflict",
                 413: "payload_too_large", 415: "invalid_request", 422: "invalid_request",
                 429: "budget_exceeded", 502: "provider_error", 503: "provider_busy"}


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")
    code: str
    message: str


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


def _doc(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


#: Error responses every route may give; metered routes add 409, 429, 502, 503.
COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _doc("invalid_request: malformed input"),
    401: _doc("unauthorized: no authenticated user"),
    413: _doc("payload_too_large: body above the cap"),
    415: _doc("invalid_request: a body sent without Content-Type: application/json"),
    422: _doc("invalid_request: the body failed validation"),
    500: _doc("internal_error"),
    503: _doc("limiter_unavailable (Redis unreachable) or provider_busy"),
}
METERED_RESPONSES: dict[int | str, dict[str, Any]] = {
    409: _doc("idempotency_conflict: the request with this Idempotency-Key is still in "
              "progress (see Retry-After), or a charge for the key stands with no stored "
              "answer (no Retry-After)"),
    422: _doc("invalid_request: the body failed validation; or idempotency_key_reused: the "
              "Idempotency-Key was used for another request; or idempotency_answer_gone: "
              "the key's request was served and charged once, its answer too large to "
              "keep; or cost_exceeds_plan: the "
              "request costs more than a window of the plan allows (cost, limit, window_s "
              "in the body), so it can never be served: do not retry; or schema_rejected "
              "(the provider refused the schema: reason), model_refused (refusal) or "
              "content_filtered: tokens refunded"),
    429: _doc("budget_exceeded: the token budget is spent; see Retry-After"),
    502: _doc("provider_error: the upstream provider failed; or output_truncated: the answer "
              f"hit the model's output limit; {REFUNDED}"),
    503: _doc("limiter_unavailable (Redis unreachable), provider_busy, or "
              "provider_quota_exceeded (the provider account is out of quota); see "
              f"Retry-After; {REFUNDED}"),
}


_original: list[Any] = []  # FastAPI's own check, once replaced


def _check_v1_models_only_once_loaded() -> None:
    """Keep FastAPI from importing ``pydantic.v1`` to build a route.

    FastAPI refuses pydantic.v1 models, and to tell them apart it imports ``pydantic.v1``
    for every field of every route it builds (``fastapi._compat.shared``), which costs a
    cold start 15-20 ms of CPU for a module no handler uses. A class can only be a v1 model
    once ``pydantic.v1`` has been imported, so until then the answer is "no" without the
    import, and after it FastAPI's own check runs: the same answer either way. If FastAPI
    no longer has the function (a newer release), nothing is replaced.
    """
    from fastapi._compat import shared

    check = getattr(shared, "is_pydantic_v1_model_class", None)
    if check is None or check is _only_once_loaded or _original:
        return
    _original.append(check)
    shared.is_pydantic_v1_model_class = _only_once_loaded


def _only_once_loaded(cls: Any) -> bool:
    """FastAPI's ``is_pydantic_v1_model_class``, answered without importing pydantic.v1
    while no module has (then no class can be a v1 model)."""
    return "pydantic.v1" in sys.modules and bool(_original[0](cls))


_check_v1_models_only_once_loaded()


def _is_json(content_type: str | None) -> bool:
    """Whether a Content-Type is JSON (``application/json`` or ``application/*+json``)."""
    if content_type is None:
        return False
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


def create_app(title: str, *, version: str = "1.0.0", **kwargs: Any) -> FastAPI:
    """A FastAPI app whose errors follow the public contract and whose charges are refunded."""
    app = FastAPI(title=title, version=version, responses=COMMON_RESPONSES, **kwargs)
    app.router.route_class = MeteredRoute  # charges after validation, before the route runs
    app.add_middleware(UsageLimitsMiddleware)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
                   for e in exc.errors()]
        content_type = request.headers.get("content-type")
        if not _is_json(content_type) and any(d["loc"][:1] == ["body"] for d in details):
            # FastAPI reads a body sent without a JSON type (curl -d sends a form's) as bytes
            # and reports "Input should be a valid dictionary": say what to change instead.
            sent = "none" if content_type is None else repr(content_type[:64])
            return error_response(
                415, "invalid_request", "the body must be JSON, sent with the header "
                f"Content-Type: application/json (this request's: {sent})")
        return error_response(422, "invalid_request", "the request failed validation",
                              details=jsonable_encoder(details))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, "error")
        return error_response(exc.status_code, code, str(exc.detail),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(LimiterUnavailable)
    async def limiter_unavailable(_: Request, exc: LimiterUnavailable) -> JSONResponse:
        log.warning("limiter unavailable: %s", exc)
        return error_response(503, "limiter_unavailable",
                              "the usage limiter is unavailable; try again shortly",
                              headers=retry_after_header(1))

    @app.exception_handler(ProviderBusy)
    async def provider_busy(_: Request, exc: ProviderBusy) -> JSONResponse:
        return error_response(503, "provider_busy",
                              f"the {exc.provider} provider is at capacity; {REFUNDED}",
                              headers=retry_after_header(exc.retry_after_s),
                              retry_after_s=round(exc.retry_after_s, 3), provider=exc.provider)

    @app.exception_handler(InvalidArgument)
    async def invalid_argument(_: Request, exc: InvalidArgument) -> JSONResponse:
        # Request input is validated by the routes' models and the guard; an
        # InvalidArgument reaching here is a deployment setting (say, LLM_RATE) gone wrong.
        log.error("server misconfiguration: %s", exc)
        return error_response(500, "internal_error", "the server is misconfigured")

    return app
