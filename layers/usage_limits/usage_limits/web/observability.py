"""Structured logs, EMF metrics and (in Lambda only) X-Ray tracing, all created lazily.

- Logs: one JSON logger (``web.jsonlog``, lines shaped as Powertools' Logger writes them) per
  execution environment. Each request appends its request id, route and the caller's id
  *hashed* (``user`` is never logged in clear) and nothing secret.
- Metrics: CloudWatch embedded metric format (EMF), written at the end of every request
  (``web.emf``, lines shaped as Powertools' Metrics writes them). Two groups, each with
  the dimension sets it is published under (declared below, so
  that the template's alarms and dashboard can be checked against them):

  * request metrics (``REQUEST_METRICS``), one EMF line per request, under
    ``(env, service, route)`` and ``(env,)``: requests and 4xx/5xx answers, tokens
    reserved, refunded and settled, budget rejections, ``limiter_unavailable`` answers,
    refunds kept for later and refunds lost, credit drawn, events that failed to publish;
  * provider metrics (``PROVIDER_METRICS``), one EMF line per provider the request
    called, under ``(env, provider, service)`` and ``(env, provider)``: calls sent (in
    throttle units), wait for a slot, provider busy, upstream 429s and upstream errors,
    quota or billing refusals (``UpstreamQuota``) and refusals of the operator's setup
    (``UpstreamRejected``: key, permission, model).

  ``env`` is ``ATTO_ENV`` (the stage), ``service`` the function
  (``POWERTOOLS_SERVICE_NAME``), ``route`` the API route key (``"POST /v1/structured"``).
- Tracing: a Powertools ``Tracer`` only inside Lambda (``AWS_LAMBDA_FUNCTION_NAME`` set)
  and only when ``POWERTOOLS_TRACE_DISABLED`` is not true. Creating one costs ~0.3 s, so
  it is made on first use, never at import.

Environment: ``POWERTOOLS_SERVICE_NAME`` (default ``atto-cloud``),
``POWERTOOLS_METRICS_NAMESPACE`` (default ``AttoCloud``), ``POWERTOOLS_METRICS_DISABLED``,
``POWERTOOLS_TRACE_DISABLED``, ``LOG_LEVEL`` (default INFO).
"""

from __future__ import annotations

import hashlib
import os
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .emf import MetricSet
    from .jsonlog import JsonLogger

SERVICE = "atto-cloud"
NAMESPACE = "AttoCloud"
#: Environment variables read here.
NAMESPACE_ENV = "POWERTOOLS_METRICS_NAMESPACE"
SERVICE_ENV = "POWERTOOLS_SERVICE_NAME"
STAGE_ENV = "ATTO_ENV"
#: ``env`` when ``ATTO_ENV`` is unset.
DEFAULT_STAGE = "unset"

# Metric names (one place, so the template's alarms and dashboard and the tests agree).
# Request metrics:
REQUESTS = "Requests"
CLIENT_ERRORS = "ClientErrors"          # answers 400-499
SERVER_ERRORS = "ServerErrors"          # answers 500-599
TOKENS_RESERVED = "TokensReserved"
TOKENS_REFUNDED = "TokensRefunded"
TOKENS_SETTLED = "TokensSettled"
BUDGET_REJECTED = "BudgetRejected"
LIMITER_UNAVAILABLE = "LimiterUnavailable"  # 503 limiter_unavailable answers
REFUNDS_KEPT = "RefundsKept"            # a refund failed and is kept to retry later
REFUNDS_LOST = "RefundsLost"            # a kept refund was dropped or expired, never made
CREDIT_DRAWN = "CreditDrawn"            # tokens drawn from credit grants
EVENTS_FAILED = "EventsFailed"          # events not published within their bound
LEDGER_DIVERGENCE = "LedgerDivergence"  # divergences one audit run found (0: balanced)
LEDGER_DIVERGENCE_TOKENS = "LedgerDivergenceTokens"  # tokens off, summed over them
USERS_NOT_AUDITED = "UsersNotAudited"   # users a run chose but could not audit (0: none)
RECORDS_KEPT = "RecordsKept"            # a usage record's write failed; kept to retry
RECORDS_LOST = "RecordsLost"            # a kept usage record's write was dropped or expired
# Provider metrics:
PROVIDER_CALLS = "ProviderCalls"        # calls sent upstream, in throttle units
PROVIDER_WAIT_MS = "ProviderWaitMs"
PROVIDER_BUSY = "ProviderBusy"
UPSTREAM_429 = "Upstream429"
UPSTREAM_ERROR = "UpstreamError"
UPSTREAM_QUOTA = "UpstreamQuota"        # the provider refused: account out of quota or credit
UPSTREAM_REJECTED = "UpstreamRejected"  # the provider refused our request: key, model, ...

# Dimension names and the dimension sets each group is published under.
ENV = "env"
SERVICE_DIMENSION = "service"
ROUTE = "route"
PROVIDER = "provider"
#: ``route`` of a request that matched no route.
UNMATCHED_ROUTE = "unmatched"

REQUEST_METRICS = frozenset({
    REQUESTS, CLIENT_ERRORS, SERVER_ERRORS, TOKENS_RESERVED, TOKENS_REFUNDED, TOKENS_SETTLED,
    BUDGET_REJECTED, LIMITER_UNAVAILABLE, REFUNDS_KEPT, REFUNDS_LOST, CREDIT_DRAWN,
    EVENTS_FAILED, RECORDS_KEPT, RECORDS_LOST, LEDGER_DIVERGENCE, LEDGER_DIVERGENCE_TOKENS,
    USERS_NOT_AUDITED})
REQUEST_DIMENSION_SETS: tuple[tuple[str, ...], ...] = ((ENV, SERVICE_DIMENSION, ROUTE), (ENV,))
PROVIDER_METRICS = frozenset({
    PROVIDER_CALLS, PROVIDER_WAIT_MS, PROVIDER_BUSY, UPSTREAM_429, UPSTREAM_ERROR,
    UPSTREAM_QUOTA, UPSTREAM_REJECTED})
PROVIDER_DIMENSION_SETS: tuple[tuple[str, ...], ...] = (
    (ENV, PROVIDER, SERVICE_DIMENSION), (ENV, PROVIDER))

_logger: JsonLogger | None = None
_metrics: MetricSet | None = None
_provider_metrics: dict[str, MetricSet] = {}
_route: str | None = None
_tracer: Any = None
_tracer_checked = False


def logger() -> JsonLogger:
    """The execution environment's JSON logger."""
    global _logger
    if _logger is None:
        from .jsonlog import JsonLogger

        _logger = JsonLogger(service=os.environ.get(SERVICE_ENV, SERVICE),
                             level=os.environ.get("LOG_LEVEL", "INFO"))
    return _logger


def _stage() -> str:
    return os.environ.get(STAGE_ENV, "").strip() or DEFAULT_STAGE


def metrics() -> MetricSet:
    """The execution environment's EMF metrics of requests (``REQUEST_METRICS``)."""
    global _metrics
    if _metrics is None:
        from .emf import MetricSet

        _metrics = MetricSet(os.environ.get(NAMESPACE_ENV, NAMESPACE),
                             os.environ.get(SERVICE_ENV, SERVICE), {ENV: _stage()},
                             extra_sets=((ENV,),))
    return _metrics


def _provider_set(provider: str) -> MetricSet:
    """The EMF metrics of one provider (``PROVIDER_METRICS``), made on first use."""
    found = _provider_metrics.get(provider)
    if found is None:
        from .emf import MetricSet

        found = MetricSet(os.environ.get(NAMESPACE_ENV, NAMESPACE),
                          os.environ.get(SERVICE_ENV, SERVICE),
                          {ENV: _stage(), PROVIDER: provider}, extra_sets=((ENV, PROVIDER),))
        _provider_metrics[provider] = found
    return found


def count(name: str, value: float = 1, unit: str = "Count") -> None:
    """Add ``value`` to request metric ``name`` for this request (nothing when metrics are off).

    Raises:
        ValueError: ``name`` is not one of ``REQUEST_METRICS``.
    """
    if name not in REQUEST_METRICS:
        raise ValueError(f"{name!r} is not a request metric")
    if _metrics_disabled():
        return
    metrics().add(name, value, unit)


def provider_count(provider: str, name: str, value: float = 1, unit: str = "Count") -> None:
    """Add ``value`` to provider metric ``name`` of ``provider`` for this request.

    Raises:
        ValueError: ``name`` is not one of ``PROVIDER_METRICS``.
    """
    if name not in PROVIDER_METRICS:
        raise ValueError(f"{name!r} is not a provider metric")
    if _metrics_disabled():
        return
    _provider_set(provider).add(name, value, unit)


def request_done(route: str | None, status: int) -> None:
    """Count one answered request of ``route`` (an API route key) with HTTP ``status``."""
    global _route
    _route = route or UNMATCHED_ROUTE
    count(REQUESTS)
    if 400 <= status < 500:
        count(CLIENT_ERRORS)
    elif status >= 500:
        count(SERVER_ERRORS)


@cache
def _metrics_disabled() -> bool:
    # Nothing is collected while metrics are off.
    return os.environ.get("POWERTOOLS_METRICS_DISABLED", "").lower() in {"1", "true"}


def flush(route: str | None = None) -> None:
    """Write this request's metrics (one EMF line per group) and start afresh.

    Args:
        route: the ``route`` dimension's value, for work that is no request (a scheduled
            run); default the route of the request answered.
    """
    global _route
    if _metrics is not None and _metrics.values:
        _metrics.flush({ENV: _stage(), ROUTE: route or _route or UNMATCHED_ROUTE})
    for provider, found in _provider_metrics.items():
        if found.values:
            found.flush({ENV: _stage(), PROVIDER: provider})
    _route = None


def reset() -> None:
    """Forget the metrics made so far and their settings (a new execution environment)."""
    global _metrics, _route
    _metrics, _route = None, None
    _provider_metrics.clear()
    _metrics_disabled.cache_clear()


def tracer() -> Any:
    """A Powertools Tracer inside Lambda with tracing on; None elsewhere."""
    global _tracer, _tracer_checked
    if not _tracer_checked:
        _tracer_checked = True
        in_lambda = bool(os.environ.get("AWS_LAMBDA_FUNCTION_NAME"))
        disabled = os.environ.get("POWERTOOLS_TRACE_DISABLED", "").lower() in {"1", "true"}
        if in_lambda and not disabled:
            try:
                from aws_lambda_powertools import Tracer

                _tracer = Tracer(service=os.environ.get(SERVICE_ENV, SERVICE),
                                 patch_modules=["httpx"])
            except Exception:  # X-Ray SDK missing: run untraced rather than fail requests
                logger().warning("tracing unavailable; continuing without it")
    return _tracer


@lru_cache(maxsize=1024)
def hashed_user(user_id: str) -> str:
    """A stable, non-reversible tag for a user id, safe to log (kept for the environment's
    recent users: one is hashed once, not on every request)."""
    return hashlib.sha256(b"atto-user:" + user_id.encode()).hexdigest()[:16]
