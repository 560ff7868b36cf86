"""What every provider client shares: one HTTP client, the throttle, deadlines and errors.

A call goes: wait for a shared provider slot (``ProviderThrottle``, Redis) within the
request's deadline, send the request with a timeout that ends before the deadline, and
map the answer:

- 2xx: the JSON body;
- 429 for a rate limit: pause the provider for every instance for as long as the answer
  says (``retry_after_s``: ``retry-after-ms``, ``Retry-After``, or OpenAI's
  ``x-ratelimit-reset-*``), then try again if the deadline allows (else 503
  ``provider_busy``). The pause is bounded: one longer than ``<NAME>_MAX_PAUSE_S``
  (default 60 s) pauses for that long, and an answer with no usable wait pauses for
  ``DEFAULT_PAUSE_S`` (1 s);
- a quota or billing refusal (a 429 with ``error.code`` ``insufficient_quota`` or
  ``x-should-retry: false``, or a status the client lists in ``quota_statuses``, such as
  Tavily's 432/433): no retry and no pause (waiting does not help; the operator must pay),
  503 ``provider_quota_exceeded``, logged with the provider's code and counted
  (``UpstreamQuota``, which has an alarm of its own);
- a refusal the caller can fix (``caller_error``, e.g. OpenAI rejecting the caller's
  schema): that error (422), with the provider's reason;
- any other 4xx (key, permission, model, a request the provider finds malformed): the
  operator's problem: logged with the provider's code, counted (``UpstreamRejected``), and
  502 ``provider_error`` without the provider's message;
- 5xx, a timeout or a network error: 502 ``provider_error``.

The whole call (connecting, sending, every byte of the answer) is bounded by the request's
deadline with ``asyncio.timeout``: httpx's own timeouts are per phase, so an answer that
trickles in a byte at a time would never trip them. The web layer refunds the user's tokens
for every error answer.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from usage_limits.deadline import remaining_s
from usage_limits.exceptions import ProviderBusy
from usage_limits.web import observability as obs
from usage_limits.web import runtime
from usage_limits.web.errors import ApiError, ProviderError, ProviderQuotaExceeded

log = logging.getLogger("atto_providers")

#: Longest single upstream call, whatever the deadline allows.
DEFAULT_TIMEOUT_S = 25.0
#: Do not start an upstream call with less time than this left.
MIN_CALL_S = 0.2
#: Upstream 429s honoured per call before giving up with provider_busy.
MAX_RATE_LIMITED_RETRIES = 3

#: ``error.code`` (or ``type``) values of a 429 that no wait cures: the account is out of
#: quota or credit (OpenAI's documented codes).
QUOTA_CODES = frozenset({"insufficient_quota", "billing_hard_limit_reached",
                         "billing_not_active"})
#: Retry-After of a 503 provider_quota_exceeded: the operator has to act, so not soon.
QUOTA_RETRY_AFTER_S = 60.0
#: Characters of a provider's error message kept (logs, and a caller's ``reason``).
MAX_REASON_CHARS = 300
#: Anything shaped like an API key in a provider's message is cut out before it is logged
#: (OpenAI's 401 quotes a masked key).
_KEYLIKE = re.compile(r"\b(?:sk|tvly|pk|key)[-_][A-Za-z0-9*_-]{4,}", re.IGNORECASE)
#: One part of a Go duration as OpenAI writes ``x-ratelimit-reset-*`` (``6m0s``, ``105ms``).
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                    "h": 3600.0}

_http: httpx.AsyncClient | None = None
_http_loop: asyncio.AbstractEventLoop | None = None


def http_client() -> httpx.AsyncClient:
    """One pooled HTTP client per execution environment (per event loop)."""
    global _http, _http_loop
    loop = asyncio.get_running_loop()
    if _http is None or _http_loop is not loop:
        _http = httpx.AsyncClient(
            timeout=DEFAULT_TIMEOUT_S, follow_redirects=False,
            limits=httpx.Limits(max_connections=20, max_keepalive_connections=10))
        _http_loop = loop
    return _http


def retry_after_s(response: httpx.Response) -> float | None:
    """How long a 429 asks to wait, in seconds, or None when it says nothing usable.

    Read in this order, the first usable one wins: ``retry-after-ms`` (milliseconds, as
    OpenAI sends it), ``Retry-After`` (delta seconds such as ``120`` or ``1.5``, or an HTTP
    date), then OpenAI's ``x-ratelimit-reset-requests``/``-tokens`` (Go durations such as
    ``6m0s`` or ``105ms``): the reset of the limit whose ``x-ratelimit-remaining-*`` is 0,
    else the sooner of the two. A value that is not a finite number >= 0 (``inf``, ``nan``,
    ``-3``), an unreadable one, or a date in the past is skipped; None is turned into the
    default pause by ``ProviderThrottle.bounded_pause_s``, which also bounds the result by
    the provider's maximum pause.
    """
    headers = response.headers
    millis = _seconds(headers.get("retry-after-ms", ""))
    if millis is not None:
        return millis / 1000
    value = headers.get("retry-after", "").strip()
    if value:
        seconds = _seconds(value)
        if seconds is not None:
            return seconds
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            when = None
        if when is not None and (left := when.timestamp() - time.time()) > 0:
            return left
    resets = {kind: duration_s(headers.get(f"x-ratelimit-reset-{kind}", ""))
              for kind in ("requests", "tokens")}
    known = {kind: s for kind, s in resets.items() if s is not None}
    if not known:
        return None
    spent = [s for kind, s in known.items()
             if headers.get(f"x-ratelimit-remaining-{kind}", "").strip() == "0"]
    return max(spent) if spent else min(known.values())


def _seconds(value: str) -> float | None:
    """A finite number >= 0 written in ``value``, else None."""
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def duration_s(value: str) -> float | None:
    """Seconds of a Go duration (``6m0s``, ``1h2m3.5s``, ``105ms``, ``0s``), else None."""
    text = value.strip()
    if not text or _DURATION_PART.sub("", text):
        return None
    return sum(float(n) * _DURATION_UNIT_S[unit] for n, unit in _DURATION_PART.findall(text))


@dataclass(frozen=True)
class UpstreamFault:
    """An upstream's error answer, as far as its body says.

    Attributes:
        status: the HTTP status.
        code: the provider's error code (OpenAI ``error.code``, Adzuna ``exception``), or None.
        type: the provider's error type (OpenAI ``error.type``), or None.
        param: the request parameter the provider blames (OpenAI ``error.param``), or None.
        message: the provider's message, trimmed to ``MAX_REASON_CHARS``, keys cut out.
        should_retry: the provider's ``x-should-retry`` header, or None without one.
    """

    status: int
    code: str | None = None
    type: str | None = None
    param: str | None = None
    message: str = ""
    should_retry: bool | None = None

    @classmethod
    def read(cls, response: httpx.Response) -> UpstreamFault:
        """The fault of ``response``; a body that is not one of the known shapes gives
        only the status (and ``x-should-retry``)."""
        hint = response.headers.get("x-should-retry", "").strip().lower()
        should_retry = {"true": True, "false": False}.get(hint)
        try:
            body = response.json()
        except ValueError:
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        detail = body.get("detail") if isinstance(body, dict) else None
        if isinstance(error, dict):                       # OpenAI (and compatibles)
            fields = (error.get("code"), error.get("type"), error.get("param"),
                      error.get("message"))
        elif isinstance(detail, dict):                    # Tavily: {"detail": {"error"}}
            fields = (None, None, None, detail.get("error"))
        elif isinstance(body, dict) and "exception" in body:  # Adzuna
            fields = (body.get("exception"), None, None, body.get("display"))
        else:
            fields = (None, None, None, error if isinstance(error, str) else detail)
        code, kind, param, message = (str(f) if isinstance(f, str | int) and
                                      not isinstance(f, bool) else None for f in fields)
        return cls(response.status_code, code, kind, param, _clean(message or ""),
                   should_retry)

    def is_quota(self) -> bool:
        """A 429 that no wait cures: a quota code, or ``x-should-retry: false``."""
        return self.status == 429 and (self.code in QUOTA_CODES or self.type in QUOTA_CODES
                                       or self.should_retry is False)


def _clean(message: str) -> str:
    """``message`` without what looks like a key, on one line, at most MAX_REASON_CHARS."""
    text = " ".join(_KEYLIKE.sub("[key]", message).split())
    return text[:MAX_REASON_CHARS]


class ProviderClient:
    """Base of every provider client.

    Subclasses set ``name`` (also the prefix of their environment variables) and their
    documented default limits; ``<NAME>_RATE``, ``<NAME>_BURST`` and ``<NAME>_CONCURRENCY``
    override them per environment.
    """

    name: ClassVar[str]
    default_rate: ClassVar[str] = "10/s"
    default_burst: ClassVar[int] = 1
    default_concurrency: ClassVar[int | None] = None
    #: Statuses that mean "the account is out of quota or credit" (Tavily: 432, 433).
    quota_statuses: ClassVar[frozenset[int]] = frozenset()

    def __init__(self, base_url: str, *, env: Mapping[str, str] | None = None,
                 redis: Any = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.env = os.environ if env is None else env
        self._redis = redis
        self._throttles: dict[str | None, Any] = {}
        self._throttle_redis: Any = None

    @property
    def throttle(self) -> Any:
        """The provider's shared throttle (created on first use); see ``throttle_for``."""
        return self.throttle_for(None)

    def throttle_for(self, key: str | None) -> Any:
        """The shared throttle of ``key`` within this provider (None: the provider's own).

        Every key gets a throttle of its own, named ``<name>|<key>`` in Redis, with the
        provider's settings (``<NAME>_RATE``, ...): an upstream whose limits are per model
        limits, and pauses, each model apart. Throttles are rebuilt when the Redis client
        changes: ``runtime.get_redis()`` gives each event loop its own client, and a
        throttle must not keep one from a closed loop.
        """
        redis = self._redis or runtime.get_redis()
        if self._throttle_redis is not redis:
            self._throttles = {}
            self._throttle_redis = redis
        found = self._throttles.get(key)
        if found is None:
            from usage_limits.throttle import ProviderThrottle

            found = ProviderThrottle.from_env(
                redis, self.name,
                default_rate=self.default_rate, default_burst=self.default_burst,
                default_concurrency=self.default_concurrency, env=self.env)
            if key is not None:
                found = ProviderThrottle(
                    redis, f"{self.name}|{key}", rate=found.rate, per_s=found.per_s,
                    burst=found.burst, max_concurrency=found.max_concurrency,
                    lease_s=found.lease_s, jitter_s=found.jitter_s,
                    max_pause_s=found.max_pause_s)
            self._throttles[key] = found
        return found

    async def request(self, method: str, path: str, *, cost: float = 1,
                      json: Any = None, params: Mapping[str, Any] | None = None,
                      headers: Mapping[str, str] | None = None,
                      throttle_key: str | None = None) -> Any:
        """Send one throttled request and return its JSON body.

        Args:
            throttle_key: the throttle to take a slot of and to pause on a 429
                (``throttle_for``); None for the provider's own.

        Raises:
            ProviderBusy: no slot (or no end to upstream 429s) within the deadline.
            ProviderError: the provider failed, timed out or sent something unusable.
            ProviderQuotaExceeded: the provider's account is out of quota or credit.
            ApiError: what ``caller_error`` makes of a refusal the caller can fix.
        """
        url = path if path.startswith("http") else f"{self.base_url}{path}"
        try:
            return await self._request(method, url, cost=cost, json=json, params=params,
                                       headers=headers, throttle=self.throttle_for(throttle_key))
        except ProviderBusy:
            obs.provider_count(self.name, obs.PROVIDER_BUSY)
            raise
        except ProviderError:
            obs.provider_count(self.name, obs.UPSTREAM_ERROR)
            raise

    async def _request(self, method: str, url: str, *, cost: float, json: Any,
                       params: Mapping[str, Any] | None, headers: Mapping[str, str] | None,
                       throttle: Any) -> Any:
        # Everything that can be done before the slot is done before it (client, TLS
        # context, body encoding): a call should leave as soon as its slot comes, or the
        # provider sees calls bunched together.
        client = http_client()
        request = client.build_request(method, url, json=json, params=params, headers=headers)
        for _ in range(MAX_RATE_LIMITED_RETRIES + 1):
            async with throttle.slot(cost=cost) as waited_s:
                left = remaining_s()
                if left < MIN_CALL_S:
                    raise ProviderBusy(self.name, 1.0, f"no time left to call {self.name}")
                limit_s = min(DEFAULT_TIMEOUT_S, left)
                request.extensions["timeout"] = httpx.Timeout(limit_s).as_dict()
                obs.provider_count(self.name, obs.PROVIDER_CALLS, cost)
                try:
                    # The whole exchange, not each phase: a trickling body resets httpx's
                    # read timeout with every byte.
                    async with asyncio.timeout(limit_s):
                        response = await client.send(request)
                except (httpx.TimeoutException, TimeoutError) as exc:
                    raise ProviderError(f"the {self.name} provider timed out",
                                        provider=self.name) from exc
                except httpx.HTTPError as exc:
                    raise ProviderError(f"the {self.name} provider could not be reached",
                                        provider=self.name) from exc
            obs.provider_count(self.name, obs.PROVIDER_WAIT_MS, round(waited_s * 1000, 3),
                               unit="Milliseconds")
            if response.is_success:
                try:
                    return response.json()
                except ValueError as exc:
                    raise ProviderError(f"the {self.name} provider sent a body that is not JSON",
                                        provider=self.name) from exc
            fault = UpstreamFault.read(response)
            if fault.is_quota() or fault.status in self.quota_statuses:
                raise self._quota_exceeded(fault)
            if response.status_code == 429:
                obs.provider_count(self.name, obs.UPSTREAM_429)
                wait = throttle.bounded_pause_s(retry_after_s(response))
                log.warning("%s answered 429; pausing %s for every instance for %.2fs",
                            self.name, throttle.provider, wait)
                await throttle.pause(wait)
                if wait >= remaining_s() - MIN_CALL_S:
                    raise ProviderBusy(self.name, wait)
                continue
            raise self._refused(fault)
        raise ProviderBusy(self.name, 1.0, f"the {self.name} provider keeps rate limiting")

    def caller_error(self, fault: UpstreamFault) -> ApiError | None:
        """The error to answer when ``fault`` is the caller's to fix, else None.

        The base knows of none; a client overrides it (the LLM's rejected schema). What it
        returns may quote the provider's reason: it is about the caller's own input.
        """
        return None

    def _quota_exceeded(self, fault: UpstreamFault) -> ProviderQuotaExceeded:
        """Log and count a quota or billing refusal; the caller's 503 (no provider text)."""
        obs.provider_count(self.name, obs.UPSTREAM_QUOTA)
        log.error("%s refused for quota or billing: status %s code %s type %s: %s",
                  self.name, fault.status, fault.code, fault.type, fault.message)
        return ProviderQuotaExceeded(
            f"the {self.name} provider's account is out of quota; the operator has been "
            "alerted; tokens refunded", provider=self.name,
            headers={"Retry-After": str(math.ceil(QUOTA_RETRY_AFTER_S))})

    def _refused(self, fault: UpstreamFault) -> ApiError:
        """The error for a non-2xx, non-rate-limit answer (see the module's docstring)."""
        caller = self.caller_error(fault)
        if caller is not None:
            return caller
        if 400 <= fault.status < 500 and fault.status not in (408, 409):
            obs.provider_count(self.name, obs.UPSTREAM_REJECTED)
            log.error("%s refused the request: status %s code %s type %s param %s: %s",
                      self.name, fault.status, fault.code, fault.type, fault.param,
                      fault.message)
            return ProviderError(f"the {self.name} provider refused the request; the operator "
                                 "has been alerted", provider=self.name,
                                 upstream_status=fault.status)
        log.warning("%s failed: status %s code %s: %s", self.name, fault.status, fault.code,
                    fault.message)
        return ProviderError(f"the {self.name} provider answered {fault.status}",
                             provider=self.name, upstream_status=fault.status)
