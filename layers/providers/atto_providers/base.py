"""What every provider client shares: one HTTP client, the throttle, deadlines and errors.

A call goes: wait for a shared provider slot (``ProviderThrottle``, Redis) within the
request's deadline, send the request with a timeout that ends before the deadline, and
map the answer:

- 2xx: the JSON body;
- 429: pause the provider for every instance for its ``Retry-After``, then try again if
  the deadline allows (else 503 ``provider_busy``). The pause is bounded: a Retry-After
  longer than ``<NAME>_MAX_PAUSE_S`` (default 60 s) pauses for that long, and one that is
  not a finite number of seconds or an HTTP date in the future (``inf``, ``nan``, ``-3``,
  text) pauses for ``DEFAULT_PAUSE_S`` (1 s);
- anything else, a timeout or a network error: 502 ``provider_error``.

The whole call (connecting, sending, every byte of the answer) is bounded by the request's
deadline with ``asyncio.timeout``: httpx's own timeouts are per phase, so an answer that
trickles in a byte at a time would never trip them. The web layer refunds the user's tokens
for both 502 and 503.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import httpx

from usage_limits.deadline import remaining_s
from usage_limits.exceptions import ProviderBusy
from usage_limits.web import observability as obs
from usage_limits.web import runtime
from usage_limits.web.errors import ProviderError

log = logging.getLogger("atto_providers")

#: Longest single upstream call, whatever the deadline allows.
DEFAULT_TIMEOUT_S = 25.0
#: Do not start an upstream call with less time than this left.
MIN_CALL_S = 0.2
#: Upstream 429s honoured per call before giving up with provider_busy.
MAX_RATE_LIMITED_RETRIES = 3

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
    """The ``Retry-After`` of a response in seconds, or None when it says nothing usable.

    Both forms are read: delta seconds (``120``, ``1.5``) and an HTTP date. A value that is
    not a finite number >= 0 (``inf``, ``nan``, ``-3``), an unreadable one, or a date in the
    past gives None, which ``ProviderThrottle.bounded_pause_s`` turns into the default pause;
    it also bounds the result by the provider's maximum pause.
    """
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - time.time()
        return seconds if seconds > 0 else None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


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

    def __init__(self, base_url: str, *, env: Mapping[str, str] | None = None,
                 redis: Any = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.env = os.environ if env is None else env
        self._redis = redis
        self._throttle: Any = None
        self._throttle_redis: Any = None

    @property
    def throttle(self) -> Any:
        """The provider's shared throttle (created on first use).

        It is rebuilt when the Redis client changes: ``runtime.get_redis()`` gives each
        event loop its own client, and a throttle must not keep one from a closed loop.
        """
        redis = self._redis or runtime.get_redis()
        if self._throttle is None or self._throttle_redis is not redis:
            from usage_limits.throttle import ProviderThrottle

            self._throttle = ProviderThrottle.from_env(
                redis, self.name,
                default_rate=self.default_rate, default_burst=self.default_burst,
                default_concurrency=self.default_concurrency, env=self.env)
            self._throttle_redis = redis
        return self._throttle

    async def request(self, method: str, path: str, *, cost: float = 1,
                      json: Any = None, params: Mapping[str, Any] | None = None,
                      headers: Mapping[str, str] | None = None) -> Any:
        """Send one throttled request and return its JSON body.

        Raises:
            ProviderBusy: no slot (or no end to upstream 429s) within the deadline.
            ProviderError: the provider failed, timed out or sent something unusable.
        """
        url = path if path.startswith("http") else f"{self.base_url}{path}"
        try:
            return await self._request(method, url, cost=cost, json=json, params=params,
                                       headers=headers)
        except ProviderBusy:
            obs.provider_count(self.name, obs.PROVIDER_BUSY)
            raise
        except ProviderError:
            obs.provider_count(self.name, obs.UPSTREAM_ERROR)
            raise

    async def _request(self, method: str, url: str, *, cost: float, json: Any,
                       params: Mapping[str, Any] | None, headers: Mapping[str, str] | None) -> Any:
        # Everything that can be done before the slot is done before it (client, TLS
        # context, body encoding): a call should leave as soon as its slot comes, or the
        # provider sees calls bunched together.
        client = http_client()
        request = client.build_request(method, url, json=json, params=params, headers=headers)
        for _ in range(MAX_RATE_LIMITED_RETRIES + 1):
            async with self.throttle.slot(cost=cost) as waited_s:
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
            if response.status_code == 429:
                obs.provider_count(self.name, obs.UPSTREAM_429)
                wait = self.throttle.bounded_pause_s(retry_after_s(response))
                log.warning("%s answered 429; pausing every instance for %.2fs", self.name, wait)
                await self.throttle.pause(wait)
                if wait >= remaining_s() - MIN_CALL_S:
                    raise ProviderBusy(self.name, wait)
                continue
            if response.is_success:
                try:
                    return response.json()
                except ValueError as exc:
                    raise ProviderError(f"the {self.name} provider sent a body that is not JSON",
                                        provider=self.name) from exc
            raise ProviderError(
                f"the {self.name} provider answered {response.status_code}",
                provider=self.name, upstream_status=response.status_code)
        raise ProviderBusy(self.name, 1.0, f"the {self.name} provider keeps rate limiting")
