"""The public error contract: ``{"error": {"code": ..., "message": ..., ...}}``.

Every error response of every function goes through ``error_response``, so the codes and
the shape are defined once:

    ApiError
     ├── Unauthorized          401 unauthorized
     ├── Forbidden             403 forbidden
     ├── AccountSuspended      403 account_suspended      (until, when the suspension ends)
     ├── InvalidRequest        400 invalid_request (422 for body validation)
     ├── PayloadTooLarge       413 payload_too_large
     ├── IdempotencyConflict   409 idempotency_conflict   (the key's request is in flight)
     ├── IdempotencyKeyReused  422 idempotency_key_reused (the key served another request)
     ├── IdempotencyAnswerGone 422 idempotency_answer_gone (served, charged, answer not kept)
     ├── CostExceedsPlan       422 cost_exceeds_plan      (cost, limit, window_s; never retry)
     ├── SchemaRejected        422 schema_rejected        (reason: the provider's, about the schema)
     ├── ModelRefused          422 model_refused          (refusal: the model's own words)
     ├── ContentFiltered       422 content_filtered       (the provider's content filter)
     ├── BudgetExceeded        429 budget_exceeded        (+ Retry-After)
     ├── ProviderBusyError     503 provider_busy          (+ Retry-After)
     ├── ProviderQuotaExceeded 503 provider_quota_exceeded (+ Retry-After; the operator must pay)
     ├── LimiterUnavailableError 503 limiter_unavailable
     └── ProviderError         502 provider_error
          └── OutputTruncated  502 output_truncated       (the answer hit the output limit)

Every one of them answered by a metered route is refunded (the middleware refunds any
status >= 400).
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import Any

from starlette.responses import JSONResponse

from . import observability as obs

#: The id of the request being answered (set by the middleware for the request's whole
#: run): every error body carries it as ``request_id``, as the ``X-Request-Id`` header does.
current_request_id: ContextVar[str | None] = ContextVar("current_request_id", default=None)

#: The code of the 503 answered when Redis is unreachable (counted as a metric).
LIMITER_UNAVAILABLE_CODE = "limiter_unavailable"


class ApiError(Exception):
    """An error with a status and a public code; ``extra`` goes into the error body."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.extra = extra

    def response(self) -> JSONResponse:
        return error_response(self.status, self.code, self.message, headers=self.headers,
                              **self.extra)


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class AccountSuspended(ApiError):
    """The account is suspended: nothing is charged and no provider is called.

    The body carries ``until`` (RFC 3339) when the suspension ends by itself, else null;
    the operator's reason is never shown to the user.
    """

    status, code = 403, "account_suspended"


class InvalidRequest(ApiError):
    status, code = 400, "invalid_request"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class IdempotencyConflict(ApiError):
    """The key's first request is still in flight: retry after ``Retry-After``.

    The IETF draft (draft-ietf-httpapi-idempotency-key-header, "Error Scenarios") keeps 409
    for a request still outstanding: the client may simply retry the same request. The
    ledger's own 409 (a charge for the id stands, no stored answer: an unconfirmed charge
    until its hold ends, or one past ``IDEMPOTENCY_TTL_S``) carries no ``Retry-After``.
    """

    status, code = 409, "idempotency_conflict"


class IdempotencyKeyReused(ApiError):
    """The key was used for another request (method, path, query or body): the client must
    change the request (a new key) before retrying; the draft's 422."""

    status, code = 422, "idempotency_key_reused"


class IdempotencyAnswerGone(ApiError):
    """The key's request was served and charged once, and its answer is not kept (too
    large to store): never served (nor charged) again under this key; a new request needs a
    new key."""

    status, code = 422, "idempotency_answer_gone"


class CostExceedsPlan(ApiError):
    """The request costs more than a window of the caller's plan allows: it can never fit.

    Not retryable, so there is no Retry-After; the body carries ``cost``, ``limit`` and
    ``window_s`` (the first window whose limit is below the cost). Nothing was charged.
    """

    status, code = 422, "cost_exceeds_plan"


class BudgetExceeded(ApiError):
    status, code = 429, "budget_exceeded"


class ProviderBusyError(ApiError):
    status, code = 503, "provider_busy"


class ProviderQuotaExceeded(ApiError):
    """The provider refused because the operator's account is out of quota or credit.

    Not a rate limit: retrying soon does not help, so it is not retried and pauses no
    instance; the operator is alerted (metric ``UpstreamQuota``). The body names the
    ``provider`` only, never the provider's own message.
    """

    status, code = 503, "provider_quota_exceeded"


class SchemaRejected(ApiError):
    """The provider refused the caller's JSON Schema; ``reason`` is the provider's, trimmed."""

    status, code = 422, "schema_rejected"


class ModelRefused(ApiError):
    """The model declined to answer; ``refusal`` carries its message, trimmed."""

    status, code = 422, "model_refused"


class ContentFiltered(ApiError):
    """The provider's content filter stopped the answer."""

    status, code = 422, "content_filtered"


class LimiterUnavailableError(ApiError):
    status, code = 503, "limiter_unavailable"


#: How an upstream failure's message (502 provider_error, 503 provider_busy) says that the
#: request cost nothing: the same words on every such answer.
REFUNDED = "the tokens charged for this request were refunded"


class ProviderError(ApiError):
    """An upstream provider failed, timed out or answered something unusable.

    Its message ends with ``REFUNDED``: the middleware refunds every failed request.
    """

    status, code = 502, "provider_error"

    def response(self) -> JSONResponse:
        return error_response(self.status, self.code, f"{self.message}; {REFUNDED}",
                              headers=self.headers, **self.extra)


class OutputTruncated(ProviderError):
    """The answer reached the provider's output limit before it was complete."""

    status, code = 502, "output_truncated"


def retry_after_header(seconds: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds, rounded up, at least 1."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def error_response(status: int, code: str, message: str, *,
                   headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    """The one place that shapes an error body; it carries the request's id, when known."""
    if code == LIMITER_UNAVAILABLE_CODE:
        obs.count(obs.LIMITER_UNAVAILABLE)
    error: dict[str, Any] = {"code": code, "message": message, **extra}
    rid = current_request_id.get()
    if rid is not None:
        error.setdefault("request_id", rid)
    return JSONResponse({"error": error}, status_code=status, headers=headers)
