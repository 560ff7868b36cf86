"""What the sync and async clients share: routes, the retry policy, and one call's decisions.

A call is a small state machine (``Call``) that knows nothing about I/O: the client asks it
for the next request, sends it, and hands back the answer or the transport error; the call
answers with a result, an error to raise, or a delay before the next attempt. The sync and
async clients differ only in how they send and sleep.
"""

from __future__ import annotations

import email.utils
import inspect
import json
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, TypeVar

import httpx

from . import exceptions as ex
from .models import (
    CompanyResearch,
    CreditBalance,
    EmbeddingsResult,
    JobListing,
    MarketContext,
    ResponseInfo,
    SalaryResult,
    StructuredResult,
    Usage,
    UsageHistory,
)
from .ratelimit import RateLimitStatus

T = TypeVar("T")

IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
LOCAL_USER_HEADER = "X-Atto-User"
#: The server accepts keys of 1 to 128 printable ASCII characters.
MAX_IDEMPOTENCY_KEY = 128
USER_AGENT = "atto-cloud-client/0.1"

#: Transport failures worth another attempt: the request may or may not have arrived, and
#: the Idempotency-Key makes a second arrival harmless.
RETRYABLE_TRANSPORT = (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError)


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long a call tries again.

    Retried: 503 ``limiter_unavailable``, 503 ``provider_busy`` (any 503) and connection
    errors; never another 4xx. A 429 ``budget_exceeded`` is retried only when
    ``retry_budget_exceeded`` is set and its Retry-After fits in the time left.

    Attributes:
        total_s: the most time a call may take, every attempt and wait included.
        max_attempts: the most attempts per call.
        base_delay_s: the first backoff when the answer has no Retry-After (doubles each time).
        max_delay_s: the longest backoff without a Retry-After.
        jitter: a wait is stretched by a random fraction up to this (0.2 = up to 20% longer),
            so clients told the same Retry-After do not all come back at once. A wait is
            never shorter than the server's Retry-After.
        retry_budget_exceeded: also wait out a 429 ``budget_exceeded`` (off by default).
    """

    total_s: float = 45.0
    max_attempts: int = 5
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0
    jitter: float = 0.2
    retry_budget_exceeded: bool = False

    def __post_init__(self) -> None:
        if self.total_s <= 0 or self.max_attempts < 1:
            raise ValueError("total_s must be > 0 and max_attempts >= 1")
        if self.base_delay_s < 0 or self.max_delay_s < 0 or self.jitter < 0:
            raise ValueError("delays and jitter must not be negative")

    def delay(self, attempt: int, retry_after_s: float | None, rand: float) -> float:
        """The wait before attempt ``attempt + 1``.

        Args:
            attempt: attempts made so far (1 after the first).
            retry_after_s: the server's Retry-After, if any.
            rand: a uniform random number in [0, 1).

        Returns:
            Seconds to wait: Retry-After stretched by jitter, else jittered backoff.
        """
        if retry_after_s is not None:
            return max(0.0, retry_after_s) * (1 + self.jitter * rand)
        backoff = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        return float(backoff * (1 - self.jitter / 2 + self.jitter * rand))


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class Route(Generic[T]):
    """One route of the contract and the class its answer becomes."""

    method: str
    path: str
    result: Callable[[dict[str, Any], ResponseInfo], T]


STRUCTURED = Route("POST", "/v1/structured", StructuredResult.from_json)
EMBEDDINGS = Route("POST", "/v1/embeddings", EmbeddingsResult.from_json)
COMPANY_RESEARCH = Route("POST", "/v1/company-research", CompanyResearch.from_json)
SALARY = Route("GET", "/v1/salary", SalaryResult.from_json)
JOB_EXTRACTION = Route("POST", "/v1/job-extraction", JobListing.from_json)
MARKET_CONTEXT = Route("POST", "/v1/market-context", MarketContext.from_json)
USAGE = Route("GET", "/v1/usage", Usage.from_json)
USAGE_HISTORY = Route("GET", "/v1/usage/history", UsageHistory.from_json)


def history_params(since: datetime | str | None, until: datetime | str | None,
                   cursor: str | None, limit: int) -> dict[str, Any]:
    """The query of ``GET /v1/usage/history``: instants as RFC 3339 (an aware datetime,
    or a string sent as it is).

    Raises:
        ValueError: a naive datetime (its zone is unknown).
    """
    def instant(value: datetime | str | None) -> str | None:
        if isinstance(value, datetime):
            if value.tzinfo is None:
                raise ValueError("since/until must be aware datetimes (with a time zone)")
            return value.isoformat()
        return value

    return drop_none({"from": instant(since), "to": instant(until), "cursor": cursor,
                      "limit": limit})


def new_idempotency_key() -> str:
    """A fresh key: 32 hex digits, unique per call."""
    return uuid.uuid4().hex


def check_idempotency_key(key: str) -> str:
    """Refuse, before sending, a key the server would refuse (400).

    Raises:
        ValueError: empty, longer than 128 characters, or not printable ASCII.
    """
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY or not all(" " <= c <= "~" for c in key):
        raise ValueError(f"an idempotency key is 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII "
                         "characters")
    return key


def key_field(key: str) -> str:
    """The ``Idempotency-Key`` field of ``key``: an RFC 9651 sf-string, as the IETF draft
    defines the field (``"..."``, with ``\\`` and ``"`` escaped). The server takes the bare
    key too, as the same key."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def key_of(field: str) -> str:
    """The key of an ``Idempotency-Key`` field: an sf-string unquoted, a bare key as is."""
    field = field.strip()
    if len(field) >= 2 and field[0] == field[-1] == '"':
        return re.sub(r"\\(.)", r"\1", field[1:-1])
    return field


def drop_none(values: Mapping[str, Any]) -> dict[str, Any]:
    """The mapping without its None values (optional fields the caller did not give)."""
    return {k: v for k, v in values.items() if v is not None}


def accepts_force_refresh(provider: Callable[..., Any]) -> bool:
    """Whether a token provider takes ``force_refresh=True`` (else it is just called again)."""
    try:
        params = inspect.signature(provider).parameters
    except (TypeError, ValueError):
        return False
    return "force_refresh" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def retry_after(headers: Mapping[str, str], body: Mapping[str, Any] | None) -> float | None:
    """Seconds from ``Retry-After`` (seconds or an HTTP date), else the body's value."""
    value = headers.get("retry-after")
    if value:
        value = value.strip()
        try:
            return max(0.0, float(value))
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError):
                when = None
            if when is not None:
                return max(0.0, when.timestamp() - time.time())
    if body is not None:
        seconds = body.get("retry_after_s")
        if isinstance(seconds, int | float) and not isinstance(seconds, bool):
            return max(0.0, float(seconds))
    return None


def api_error(response: httpx.Response, *, request_id: str | None,
              attempts: int) -> ex.ApiError:
    """The typed exception for an error answer (any shape, even not JSON)."""
    try:
        body = response.json()
    except (ValueError, UnicodeDecodeError):
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code = error.get("code") if isinstance(error.get("code"), str) else None
        message = str(error.get("message", ""))
        details = {k: v for k, v in error.items() if k not in ("code", "message")}
    else:
        code, details = None, {}
        message = (str(body.get("message")) if isinstance(body, dict) and "message" in body
                   else response.text[:500] or response.reason_phrase)
    cls = ex.error_class(response.status_code, code)
    return cls(response.status_code, code or f"http_{response.status_code}", message,
               details=details, retry_after_s=retry_after(response.headers, details),
               rate_limit=RateLimitStatus.from_headers(response.headers),
               request_id=request_id, attempts=attempts)


@dataclass
class Step(Generic[T]):
    """What the client does next: return ``result``, raise ``error``, or wait ``delay``."""

    result: T | None = None
    error: BaseException | None = None
    delay: float = 0.0
    refresh_token: bool = False


@dataclass
class Observed:
    """What the client keeps from the answers it has seen (shared by its calls)."""

    last_response: ResponseInfo | None = None
    rate_limit: RateLimitStatus | None = None
    credit: CreditBalance | None = None


@dataclass
class Call(Generic[T]):
    """One call: its request, its attempts so far, and what to do after each answer."""

    route: Route[T]
    policy: RetryPolicy
    key: str
    observed: Observed
    clock: Callable[[], float]
    rand: Callable[[], float] = random.random
    json_body: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    can_refresh: bool = False
    attempts: int = 0
    refreshed: bool = False
    started: float = field(default=0.0)
    last_error: BaseException | None = None

    def __post_init__(self) -> None:
        self.started = self.clock()

    def build(self, http: httpx.Client | httpx.AsyncClient, base_url: str,
              headers: dict[str, str], timeout: float | None) -> httpx.Request:
        """The next attempt's request: the same key, body and query every time."""
        self.attempts += 1
        content = None if self.json_body is None else json.dumps(
            self.json_body, ensure_ascii=False, separators=(",", ":")).encode()
        all_headers = {**headers, IDEMPOTENCY_HEADER: key_field(self.key)}
        if content is not None:
            all_headers["Content-Type"] = "application/json"
        return http.build_request(self.route.method, base_url + self.route.path,
                                  params=self.params,
                                  content=content, headers=all_headers,
                                  timeout=self.attempt_timeout(timeout))

    def attempt_timeout(self, timeout: float | None) -> float | None:
        """The attempt's timeout: the client's, never past the call's total time."""
        left = max(0.5, self.policy.total_s - (self.clock() - self.started))
        return left if timeout is None else min(timeout, left)

    def on_transport_error(self, error: httpx.TransportError) -> Step[T]:
        """A connection error: retry while attempts and time remain, else raise."""
        self.last_error = error
        if not isinstance(error, RETRYABLE_TRANSPORT):
            return Step(error=ex.TransportError(f"{type(error).__name__}: {error}",
                                                attempts=self.attempts))
        step = self._again(None)
        if step is None:
            return Step(error=ex.TransportError(
                f"no answer after {self.attempts} attempt(s): {type(error).__name__}: "
                f"{error}", attempts=self.attempts))
        return step

    def on_response(self, response: httpx.Response) -> Step[T]:
        """An answer: parse a success, retry a 503 (not ``provider_quota_exceeded``), a 409
        "in progress" (it has Retry-After) or one 401 with a new token, else raise."""
        info = ResponseInfo(
            status=response.status_code, request_id=self.key,
            replayed=response.headers.get(REPLAYED_HEADER, "").lower() == "true",
            attempts=self.attempts, rate_limit=RateLimitStatus.from_headers(response.headers),
            retry_after_s=retry_after(response.headers, None))
        self.observed.last_response = info
        if info.rate_limit is not None:
            self.observed.rate_limit = info.rate_limit
            if info.rate_limit.credit is not None:  # every metered answer says it
                self.observed.credit = CreditBalance(remaining=info.rate_limit.credit,
                                                     grants=())
        if response.is_success:
            try:
                body = response.json()
                result = self.route.result(body, info)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                return Step(error=ex.ApiError(
                    response.status_code, "unexpected_response",
                    f"the answer of {self.route.method} {self.route.path} is not the "
                    f"expected shape: {exc!r}", request_id=self.key, attempts=self.attempts))
            credit = getattr(result, "credit", None)
            if isinstance(credit, CreditBalance):
                self.observed.credit = credit
            return Step(result=result)
        error = api_error(response, request_id=self.key, attempts=self.attempts)
        self.last_error = error
        if isinstance(error, ex.BudgetExceeded) and error.credit is not None:
            self.observed.credit = error.credit
        if isinstance(error, ex.Unauthorized) and self.can_refresh and not self.refreshed:
            self.refreshed = True  # one new token per call; a second 401 is raised
            return Step(refresh_token=True)
        if isinstance(error, ex.ServiceUnavailable) or (
                isinstance(error, ex.BudgetExceeded) and self.policy.retry_budget_exceeded) or (
                isinstance(error, ex.IdempotencyConflict) and error.retry_after_s is not None):
            # a 409 with Retry-After: the key's first request is still in progress (a reuse
            # is a 422; a 409 without it, a charge standing for the key, is raised)
            step = self._again(error.retry_after_s)
            if step is not None:
                return step
        return Step(error=error)

    def _again(self, retry_after_s: float | None) -> Step[T] | None:
        """A wait before the next attempt, or None when attempts or time are used up."""
        if self.attempts >= self.policy.max_attempts:
            return None
        delay = self.policy.delay(self.attempts, retry_after_s, self.rand())
        if self.clock() - self.started + delay > self.policy.total_s:
            return None
        return Step(delay=delay)


def request_headers(*, token: str | None, user: str | None,
                    extra: Mapping[str, str]) -> dict[str, str]:
    """The headers every attempt carries besides the key: auth, local user, the app's own."""
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json", **extra}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if user is not None:
        headers[LOCAL_USER_HEADER] = user
    return headers
