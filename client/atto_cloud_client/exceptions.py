"""Every error the client raises, one class per cause, under one base:

    AttoError
     ├── TransportError              the API could not be reached (after the retries)
     ├── SignInError                 the loopback sign-in or a token refresh failed
     └── ApiError                    the API answered an error (status, code, message, body)
          ├── InvalidRequest         400/422 invalid_request
          │    └── CostExceedsPlan   422 cost_exceeds_plan (the cost can never fit the plan)
          ├── Unauthorized           401 unauthorized
          ├── AccountSuspended       403 account_suspended
          ├── IdempotencyConflict    409 idempotency_conflict (the key's request is in flight;
          │                              retried when it has Retry-After)
          ├── IdempotencyKeyReused   422 idempotency_key_reused (the key served another request)
          ├── IdempotencyAnswerGone  422 idempotency_answer_gone (served and charged once; its
          │                              answer is not kept: too large)
          ├── SchemaRejected         422 schema_rejected (reason: the provider's)
          ├── ModelRefused           422 model_refused (refusal: the model's words)
          ├── ContentFiltered        422 content_filtered
          ├── PayloadTooLarge        413 payload_too_large
          ├── BudgetExceeded         429 budget_exceeded (retry_after_s, limit, remaining, window_s)
          ├── InternalError          500 internal_error
          ├── ProviderError          502 provider_error
          │    └── OutputTruncated   502 output_truncated (the answer hit the output limit)
          ├── ProviderQuotaExceeded  503 provider_quota_exceeded (never retried: the operator
          │                              must pay the provider; provider)
          └── ServiceUnavailable     503, retried by the client until its time is up
               ├── ProviderBusy      503 provider_busy (retry_after_s, provider)
               └── LimiterUnavailable 503 limiter_unavailable

An answer whose code the client does not know is an ``ApiError`` of the nearest class by
status where the status has one meaning (API Gateway's own 401 is ``Unauthorized``), else
a plain ``ApiError``: new server codes never break an old client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .models import CreditBalance
    from .ratelimit import RateLimitStatus, RateLimitWindow


class AttoError(Exception):
    """The base of every error this package raises."""


class TransportError(AttoError):
    """The API could not be reached, or the connection broke, on every attempt.

    Attributes:
        attempts: how many attempts were made.
    """

    def __init__(self, message: str, *, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


class SignInError(AttoError):
    """The sign-in flow or a token refresh failed (denied, wrong state, bad token answer)."""


class ApiError(AttoError):
    """An error answer in the contract's shape ``{"error": {"code", "message", ...}}``.

    Attributes:
        status: the HTTP status.
        code: the error code (``http_<status>`` when the body has none, e.g. API Gateway's
            own answers).
        message: the server's message.
        details: every field of the error object besides ``code`` and ``message``.
        retry_after_s: the ``Retry-After`` header (or the body's ``retry_after_s``), if any.
        rate_limit: the parsed ``RateLimit`` headers of the answer, if any.
        request_id: the ``Idempotency-Key`` the call carried.
        attempts: how many attempts the call made.
    """

    status_code: int | None = None
    error_code: str | None = None

    def __init__(self, status: int, code: str, message: str, *,
                 details: dict[str, Any] | None = None, retry_after_s: float | None = None,
                 rate_limit: RateLimitStatus | None = None, request_id: str | None = None,
                 attempts: int = 1) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}
        self.retry_after_s = retry_after_s
        self.rate_limit = rate_limit
        self.request_id = request_id
        self.attempts = attempts


class InvalidRequest(ApiError):
    """400/422 ``invalid_request``: the input was refused; nothing was charged."""

    error_code = "invalid_request"


class CostExceedsPlan(InvalidRequest):
    """422 ``cost_exceeds_plan``: this request costs more than the plan can ever hold."""

    status_code, error_code = 422, "cost_exceeds_plan"


class Unauthorized(ApiError):
    """401 ``unauthorized``: no valid bearer token (after one refresh of the token)."""

    status_code, error_code = 401, "unauthorized"


class AccountSuspended(ApiError):
    """403 ``account_suspended``: the operator suspended this account; nothing was charged."""

    status_code, error_code = 403, "account_suspended"


class IdempotencyConflict(ApiError):
    """409 ``idempotency_conflict``: the key's first request is still in flight; retried
    after its ``Retry-After`` (the same key, so never charged twice). One without
    ``Retry-After`` (a charge for the key stands, no stored answer) is raised at once."""

    status_code, error_code = 409, "idempotency_conflict"


class IdempotencyKeyReused(ApiError):
    """422 ``idempotency_key_reused``: the key was used for another request (method, path,
    query or body); not retried: send the new request with a new key."""

    status_code, error_code = 422, "idempotency_key_reused"


class IdempotencyAnswerGone(ApiError):
    """422 ``idempotency_answer_gone``: the key's request was served and charged once, and
    its answer is not kept (too large); not retried (it would never be served again)."""

    status_code, error_code = 422, "idempotency_answer_gone"


class SchemaRejected(ApiError):
    """422 ``schema_rejected``: the provider refused the JSON Schema; refunded.

    Attributes:
        reason: the provider's words about the schema, trimmed.
    """

    status_code, error_code = 422, "schema_rejected"

    @property
    def reason(self) -> str | None:
        return _str(self.details.get("reason"))


class ModelRefused(ApiError):
    """422 ``model_refused``: the model declined to answer; refunded.

    Attributes:
        refusal: the model's own message, trimmed.
    """

    status_code, error_code = 422, "model_refused"

    @property
    def refusal(self) -> str | None:
        return _str(self.details.get("refusal"))


class ContentFiltered(ApiError):
    """422 ``content_filtered``: the provider's content filter stopped the answer; refunded."""

    status_code, error_code = 422, "content_filtered"


class PayloadTooLarge(ApiError):
    """413 ``payload_too_large``: the body is above the server's limit (``limit_bytes``)."""

    status_code, error_code = 413, "payload_too_large"


class BudgetExceeded(ApiError):
    """429 ``budget_exceeded``: the request does not fit a window of the user's budget.

    Not retried by the client: waiting ``retry_after_s`` (often an hour) is the app's call.

    Attributes:
        limit: tokens the refusing window allows.
        remaining: tokens left in it.
        window_s: its length in seconds.
        window: that window in the answer's RateLimit headers (name, reset), if present.
        cost: what the refused request costs.
        credit: the credit balance, when the server reports one.
    """

    status_code, error_code = 429, "budget_exceeded"

    @property
    def limit(self) -> int | None:
        return _int(self.details.get("limit"))

    @property
    def remaining(self) -> int | None:
        return _int(self.details.get("remaining"))

    @property
    def window_s(self) -> int | None:
        return _int(self.details.get("window_s"))

    @property
    def cost(self) -> int | None:
        return _int(self.details.get("cost"))

    @property
    def window(self) -> RateLimitWindow | None:
        """The refusing window as the answer's RateLimit headers describe it (its name,
        e.g. ``"1h"``, and its reset), matched by length; None without the headers."""
        if self.rate_limit is None:
            return None
        return next((w for w in self.rate_limit.windows if w.window_s == self.window_s), None)

    @property
    def credit(self) -> CreditBalance | None:
        from .models import CreditBalance

        return CreditBalance.from_json(self.details)


class InternalError(ApiError):
    """500 ``internal_error``: a server bug or misconfiguration; the charge was refunded."""

    status_code, error_code = 500, "internal_error"


class ProviderError(ApiError):
    """502 ``provider_error``: the upstream failed or answered nonsense; refunded."""

    status_code, error_code = 502, "provider_error"


class OutputTruncated(ProviderError):
    """502 ``output_truncated``: the answer reached the model's output limit; refunded."""

    error_code = "output_truncated"


class ProviderQuotaExceeded(ApiError):
    """503 ``provider_quota_exceeded``: Atto Cloud's account at the provider is out of quota
    or credit; refunded. Not a ``ServiceUnavailable``: retrying soon does not help (the
    operator must pay the provider), so the client never retries it.

    Attributes:
        provider: the provider's name.
    """

    status_code, error_code = 503, "provider_quota_exceeded"

    @property
    def provider(self) -> str | None:
        return _str(self.details.get("provider"))


class ServiceUnavailable(ApiError):
    """503: the service cannot take the request now; the client retries these."""

    status_code = 503


class ProviderBusy(ServiceUnavailable):
    """503 ``provider_busy``: no provider slot in time; refunded. ``provider`` names it."""

    error_code = "provider_busy"

    @property
    def provider(self) -> str | None:
        return _str(self.details.get("provider"))


class LimiterUnavailable(ServiceUnavailable):
    """503 ``limiter_unavailable``: the budget store is unreachable; nothing ran."""

    error_code = "limiter_unavailable"


#: Error code -> class. Every public code of the contract has one.
BY_CODE: dict[str, type[ApiError]] = {
    cls.error_code: cls for cls in (
        InvalidRequest, CostExceedsPlan, Unauthorized, AccountSuspended, IdempotencyConflict,
        IdempotencyKeyReused, IdempotencyAnswerGone, SchemaRejected, ModelRefused,
        ContentFiltered, PayloadTooLarge, BudgetExceeded, InternalError, ProviderError,
        OutputTruncated, ProviderQuotaExceeded, ProviderBusy, LimiterUnavailable)
    if cls.error_code
}
#: Status -> class, for answers without a known code (API Gateway's own 401 or 413).
BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidRequest, 401: Unauthorized, 409: IdempotencyConflict,
    413: PayloadTooLarge, 500: InternalError, 502: ProviderError, 503: ServiceUnavailable,
}


def error_class(status: int, code: str | None) -> type[ApiError]:
    """The class for an error answer: by its code, else by its status, else ``ApiError``."""
    if code and code in BY_CODE:
        return BY_CODE[code]
    return BY_STATUS.get(status, ApiError)


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
