"""``AttoClient`` (sync) and ``AsyncAttoClient``: one typed method per route of Atto Cloud.

Every call carries an ``Idempotency-Key`` (the caller's, or a new one) and keeps it across
its own retries, so a call the server already ran is answered from its store and never
charged twice. 503s and connection errors are retried within the policy's total time,
honouring ``Retry-After``; every other error is raised at once as its typed exception.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

import httpx

from . import _core
from ._core import Call, Observed, RetryPolicy, Route
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
    UsageHistoryRecord,
)
from .ratelimit import RateLimitStatus

T = TypeVar("T")

#: The default per-attempt timeout: above API Gateway's 30 s, so the server ends first.
DEFAULT_TIMEOUT_S = 35.0
LOCAL_URL = "http://127.0.0.1:8000"

TokenProvider = Callable[..., str]
AsyncTokenProvider = Callable[..., "str | Awaitable[str]"]


class _Base:
    """Settings and observations shared by the sync and async clients."""

    def __init__(self, base_url: str, *, token_provider: Callable[..., Any] | None,
                 user: str | None, retry: RetryPolicy | None, timeout: float | None,
                 headers: Mapping[str, str] | None, clock: Callable[[], float],
                 rand: Callable[[], float] | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self._token_provider = token_provider
        self._force_refresh = (token_provider is not None
                               and _core.accepts_force_refresh(token_provider))
        self._user = user
        self._headers = dict(headers or {})
        self._clock = clock
        self._rand = rand
        self._observed = Observed()

    @property
    def last_response(self) -> ResponseInfo | None:
        """Metadata of the last answer of any call (status, key, replayed, headers)."""
        return self._observed.last_response

    @property
    def rate_limit(self) -> RateLimitStatus | None:
        """The ``RateLimit`` headers of the last answer that carried them (for a budget bar)."""
        return self._observed.rate_limit

    @property
    def credit(self) -> CreditBalance | None:
        """The last credit balance seen in a usage answer or a 429, if the server sends one."""
        return self._observed.credit

    def _call(self, route: Route[T], *, idempotency_key: str | None,
              json_body: dict[str, Any] | None = None,
              params: dict[str, Any] | None = None) -> Call[T]:
        key = (_core.check_idempotency_key(idempotency_key) if idempotency_key is not None
               else _core.new_idempotency_key())
        extra: dict[str, Any] = {} if self._rand is None else {"rand": self._rand}
        return Call(route=route, policy=self.retry, key=key, observed=self._observed,
                    clock=self._clock, json_body=json_body, params=params,
                    can_refresh=self._token_provider is not None, **extra)

    def _provider_args(self, refresh: bool) -> dict[str, Any]:
        return {"force_refresh": True} if refresh and self._force_refresh else {}

    def _headers_with(self, token: str | None) -> dict[str, str]:
        return _core.request_headers(token=token, user=self._user, extra=self._headers)


def _structured_body(prompt: str, schema: Mapping[str, Any], model: str | None) -> dict[str, Any]:
    return _core.drop_none({"prompt": prompt, "schema": dict(schema), "model": model})


def _embeddings_body(texts: Sequence[str], model: str | None,
                     dimensions: int | None) -> dict[str, Any]:
    if isinstance(texts, str):
        raise TypeError("texts is a list of strings, not one string")
    return _core.drop_none({"input": list(texts), "model": model, "dimensions": dimensions})


class AttoClient(_Base):
    """The synchronous client.

    Args:
        base_url: the API's URL (the stack's ``ApiUrl`` output, or ``make serve``'s).
        token_provider: returns the bearer token for each attempt; after a 401 it is called
            once more (with ``force_refresh=True`` when it takes that argument) and the call
            repeated once; a second 401 raises ``Unauthorized``.
        user: local mode only (``make serve``): the ``X-Atto-User`` header naming the user.
        retry: the retry policy (``RetryPolicy()`` by default; ``NO_RETRY`` for none).
        timeout: seconds per attempt (capped by the policy's time left).
        headers: extra headers for every request.
        transport: an httpx transport (e.g. ``atto_cloud_client.testing.MockApi().transport``).
        http_client: an ``httpx.Client`` of your own (requests go to ``base_url`` anyway).
        sleep, clock, rand: injectable for tests: ``time.sleep``, ``time.monotonic``,
            ``random.random``.

    Attributes:
        rate_limit: the parsed ``RateLimit`` headers of the last answer that had them.
        last_response: metadata of the last answer.
        credit: the last credit balance seen, if any.
    """

    def __init__(self, base_url: str = LOCAL_URL, *,
                 token_provider: TokenProvider | None = None, user: str | None = None,
                 retry: RetryPolicy | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                 headers: Mapping[str, str] | None = None,
                 transport: httpx.BaseTransport | None = None,
                 http_client: httpx.Client | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 rand: Callable[[], float] | None = None) -> None:
        super().__init__(base_url, token_provider=token_provider, user=user, retry=retry,
                         timeout=timeout, headers=headers, clock=clock, rand=rand)
        self._sleep = sleep
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(base_url=self.base_url, transport=transport)

    def close(self) -> None:
        """Close the connection pool (only one the client made itself)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> AttoClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _token(self, refresh: bool) -> str | None:
        if self._token_provider is None:
            return None
        return str(self._token_provider(**self._provider_args(refresh)))

    def _run(self, call: Call[T]) -> T:
        refresh = False
        while True:
            headers = self._headers_with(self._token(refresh))
            request = call.build(self._http, self.base_url, headers, self.timeout)
            try:
                response = self._http.send(request)
            except httpx.TransportError as exc:
                step = call.on_transport_error(exc)
            else:
                try:
                    response.read()
                    step = call.on_response(response)
                except httpx.TransportError as exc:
                    step = call.on_transport_error(exc)
                finally:
                    response.close()
            if step.error is not None:
                raise step.error
            if step.result is not None:
                return step.result
            refresh = step.refresh_token
            if step.delay > 0:
                self._sleep(step.delay)

    # --- routes --------------------------------------------------------------------------

    def structured(self, prompt: str, schema: Mapping[str, Any], *, model: str | None = None,
                   idempotency_key: str | None = None) -> StructuredResult:
        """``POST /v1/structured`` (8 tokens): a JSON value valid for ``schema``.

        Args:
            prompt: what to answer (1 to 32,000 characters).
            schema: the JSON Schema of the answer.
            model: a model the deployment offers; its default if None.
            idempotency_key: your own key (1-128 printable ASCII); a new one if None.

        Returns:
            The answer, its model and the provider's token counts.

        Raises:
            ApiError: a subclass per error code (see ``atto_cloud_client.exceptions``).
            TransportError: no answer within the retry policy.
        """
        return self._run(self._call(_core.STRUCTURED, idempotency_key=idempotency_key,
                                    json_body=_structured_body(prompt, schema, model)))

    def embeddings(self, texts: Sequence[str], *, model: str | None = None,
                   dimensions: int | None = None,
                   idempotency_key: str | None = None) -> EmbeddingsResult:
        """``POST /v1/embeddings`` (1 token): one vector per text (1 to 64 texts).

        Raises:
            TypeError: ``texts`` is a single string.
            ApiError, TransportError: as for ``structured``.
        """
        return self._run(self._call(_core.EMBEDDINGS, idempotency_key=idempotency_key,
                                    json_body=_embeddings_body(texts, model, dimensions)))

    def company_research(self, company: str, *, website: str | None = None,
                         idempotency_key: str | None = None) -> CompanyResearch:
        """``POST /v1/company-research`` (20 tokens): a sourced brief about ``company``.

        Raises:
            ApiError, TransportError: as for ``structured``.
        """
        return self._run(self._call(
            _core.COMPANY_RESEARCH, idempotency_key=idempotency_key,
            json_body=_core.drop_none({"company": company, "website": website})))

    def salary(self, title: str, *, location: str | None = None, country: str | None = None,
               idempotency_key: str | None = None) -> SalaryResult:
        """``GET /v1/salary`` (2 tokens): advertised salaries for ``title`` (and place).

        Args:
            title: job title or keywords.
            location: town, city or region; the whole country if None.
            country: lower-case Adzuna country code; the server's default (gb) if None.
            idempotency_key: as for ``structured``.

        Raises:
            ApiError, TransportError: as for ``structured``.
        """
        return self._run(self._call(
            _core.SALARY, idempotency_key=idempotency_key,
            params=_core.drop_none({"title": title, "location": location, "country": country})))

    def job_extraction(self, *, url: str | None = None, html: str | None = None,
                       text: str | None = None, source_url: str | None = None,
                       idempotency_key: str | None = None) -> JobListing:
        """``POST /v1/job-extraction`` (10 tokens): a listing from exactly one of
        ``url``, ``html`` or ``text`` (``source_url`` only with pasted html or text).

        Raises:
            ApiError, TransportError: as for ``structured``.
        """
        return self._run(self._call(
            _core.JOB_EXTRACTION, idempotency_key=idempotency_key,
            json_body=_core.drop_none({"url": url, "html": html, "text": text,
                                       "source_url": source_url})))

    def market_context(self, role: str, *, location: str | None = None,
                       country: str | None = None,
                       idempotency_key: str | None = None) -> MarketContext:
        """``POST /v1/market-context`` (30 tokens): demand, salary trend and a narrative.

        Raises:
            ApiError, TransportError: as for ``structured``.
        """
        return self._run(self._call(
            _core.MARKET_CONTEXT, idempotency_key=idempotency_key,
            json_body=_core.drop_none({"role": role, "location": location,
                                       "country": country})))

    def usage(self, *, idempotency_key: str | None = None) -> Usage:
        """``GET /v1/usage`` (free): windows, recent charges, prices (and credit, if any).

        Raises:
            ApiError, TransportError: as for ``structured``.
        """
        return self._run(self._call(_core.USAGE, idempotency_key=idempotency_key))

    def usage_history(self, *, since: datetime | str | None = None,
                      until: datetime | str | None = None, cursor: str | None = None,
                      limit: int = 50) -> UsageHistory:
        """``GET /v1/usage/history`` (free): one page of the caller's statement, newest
        first; the first page (no ``cursor``) carries the span's per-day totals.

        Args:
            since: the span's start, inclusive (an aware datetime or RFC 3339); default 30
                days before ``until``.
            until: its end, exclusive; default now.
            cursor: the previous page's ``cursor``.
            limit: records per page, 1 to 500.

        Raises:
            ValueError: a naive datetime.
            ApiError, TransportError: as for ``structured`` (400 ``InvalidRequest`` for a
                bad span or cursor).
        """
        return self._run(self._call(_core.USAGE_HISTORY, idempotency_key=None,
                                    params=_core.history_params(since, until, cursor, limit)))

    def iter_usage_history(self, *, since: datetime | str | None = None,
                           until: datetime | str | None = None,
                           limit: int = 100) -> Iterator[UsageHistoryRecord]:
        """Every record of the span, newest first, fetching page after page.

        Raises:
            As ``usage_history``.
        """
        cursor: str | None = None
        while True:
            page = self.usage_history(since=since, until=until, cursor=cursor, limit=limit)
            yield from page.records
            if page.cursor is None:
                return
            cursor = page.cursor


class AsyncAttoClient(_Base):
    """The asyncio client: the same arguments and methods as ``AttoClient``, awaited.

    ``token_provider`` may be a plain or an ``async`` callable; ``sleep`` defaults to
    ``asyncio.sleep``; ``transport`` is an ``httpx.AsyncBaseTransport``.
    """

    def __init__(self, base_url: str = LOCAL_URL, *,
                 token_provider: AsyncTokenProvider | None = None, user: str | None = None,
                 retry: RetryPolicy | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                 headers: Mapping[str, str] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 http_client: httpx.AsyncClient | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 rand: Callable[[], float] | None = None) -> None:
        super().__init__(base_url, token_provider=token_provider, user=user, retry=retry,
                         timeout=timeout, headers=headers, clock=clock, rand=rand)
        self._sleep = sleep
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(base_url=self.base_url,
                                                      transport=transport)

    async def aclose(self) -> None:
        """Close the connection pool (only one the client made itself)."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncAttoClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _token(self, refresh: bool) -> str | None:
        if self._token_provider is None:
            return None
        token = self._token_provider(**self._provider_args(refresh))
        if inspect.isawaitable(token):
            token = await token
        return str(token)

    async def _run(self, call: Call[T]) -> T:
        refresh = False
        while True:
            headers = self._headers_with(await self._token(refresh))
            request = call.build(self._http, self.base_url, headers, self.timeout)
            try:
                response = await self._http.send(request)
            except httpx.TransportError as exc:
                step = call.on_transport_error(exc)
            else:
                try:
                    await response.aread()
                    step = call.on_response(response)
                except httpx.TransportError as exc:
                    step = call.on_transport_error(exc)
                finally:
                    await response.aclose()
            if step.error is not None:
                raise step.error
            if step.result is not None:
                return step.result
            refresh = step.refresh_token
            if step.delay > 0:
                await self._sleep(step.delay)

    async def structured(self, prompt: str, schema: Mapping[str, Any], *,
                         model: str | None = None,
                         idempotency_key: str | None = None) -> StructuredResult:
        """``POST /v1/structured`` (8 tokens); see ``AttoClient.structured``."""
        return await self._run(self._call(_core.STRUCTURED, idempotency_key=idempotency_key,
                                          json_body=_structured_body(prompt, schema, model)))

    async def embeddings(self, texts: Sequence[str], *, model: str | None = None,
                         dimensions: int | None = None,
                         idempotency_key: str | None = None) -> EmbeddingsResult:
        """``POST /v1/embeddings`` (1 token); see ``AttoClient.embeddings``."""
        return await self._run(self._call(_core.EMBEDDINGS, idempotency_key=idempotency_key,
                                          json_body=_embeddings_body(texts, model, dimensions)))

    async def company_research(self, company: str, *, website: str | None = None,
                               idempotency_key: str | None = None) -> CompanyResearch:
        """``POST /v1/company-research`` (20 tokens); see ``AttoClient.company_research``."""
        return await self._run(self._call(
            _core.COMPANY_RESEARCH, idempotency_key=idempotency_key,
            json_body=_core.drop_none({"company": company, "website": website})))

    async def salary(self, title: str, *, location: str | None = None,
                     country: str | None = None,
                     idempotency_key: str | None = None) -> SalaryResult:
        """``GET /v1/salary`` (2 tokens); see ``AttoClient.salary``."""
        return await self._run(self._call(
            _core.SALARY, idempotency_key=idempotency_key,
            params=_core.drop_none({"title": title, "location": location, "country": country})))

    async def job_extraction(self, *, url: str | None = None, html: str | None = None,
                             text: str | None = None, source_url: str | None = None,
                             idempotency_key: str | None = None) -> JobListing:
        """``POST /v1/job-extraction`` (10 tokens); see ``AttoClient.job_extraction``."""
        return await self._run(self._call(
            _core.JOB_EXTRACTION, idempotency_key=idempotency_key,
            json_body=_core.drop_none({"url": url, "html": html, "text": text,
                                       "source_url": source_url})))

    async def market_context(self, role: str, *, location: str | None = None,
                             country: str | None = None,
                             idempotency_key: str | None = None) -> MarketContext:
        """``POST /v1/market-context`` (30 tokens); see ``AttoClient.market_context``."""
        return await self._run(self._call(
            _core.MARKET_CONTEXT, idempotency_key=idempotency_key,
            json_body=_core.drop_none({"role": role, "location": location,
                                       "country": country})))

    async def usage(self, *, idempotency_key: str | None = None) -> Usage:
        """``GET /v1/usage`` (free); see ``AttoClient.usage``."""
        return await self._run(self._call(_core.USAGE, idempotency_key=idempotency_key))

    async def usage_history(self, *, since: datetime | str | None = None,
                            until: datetime | str | None = None, cursor: str | None = None,
                            limit: int = 50) -> UsageHistory:
        """``GET /v1/usage/history`` (free); see ``AttoClient.usage_history``."""
        return await self._run(self._call(
            _core.USAGE_HISTORY, idempotency_key=None,
            params=_core.history_params(since, until, cursor, limit)))

    async def iter_usage_history(self, *, since: datetime | str | None = None,
                                 until: datetime | str | None = None,
                                 limit: int = 100) -> AsyncIterator[UsageHistoryRecord]:
        """Every record of the span, newest first; see ``AttoClient.iter_usage_history``."""
        cursor: str | None = None
        while True:
            page = await self.usage_history(since=since, until=until, cursor=cursor,
                                            limit=limit)
            for record in page.records:
                yield record
            if page.cursor is None:
                return
            cursor = page.cursor
