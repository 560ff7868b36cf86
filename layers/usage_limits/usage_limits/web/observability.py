"""Structured logs, EMF metrics and (in Lambda only) X-Ray tracing, all created lazily.

- Logs: one Powertools ``Logger`` (JSON) per execution environment. Each request appends
  its request id, route and the caller's id *hashed* (``user`` is never logged in clear)
  and nothing secret.
- Metrics: one Powertools ``Metrics`` (CloudWatch embedded metric format) flushed at the end
  of every request: tokens reserved, refunded and settled, budget rejections, provider
  wait time, provider busy, upstream 429s and upstream errors.
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
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aws_lambda_powertools import Logger, Metrics

SERVICE = "atto-cloud"
NAMESPACE = "AttoCloud"

# Metric names (one place, so dashboards and tests agree).
TOKENS_RESERVED = "TokensReserved"
TOKENS_REFUNDED = "TokensRefunded"
TOKENS_SETTLED = "TokensSettled"
BUDGET_REJECTED = "BudgetRejected"
PROVIDER_WAIT_MS = "ProviderWaitMs"
PROVIDER_BUSY = "ProviderBusy"
UPSTREAM_429 = "Upstream429"
UPSTREAM_ERROR = "UpstreamError"

_logger: Logger | None = None
_metrics: Metrics | None = None
_tracer: Any = None
_tracer_checked = False


def logger() -> Logger:
    """The execution environment's JSON logger."""
    global _logger
    if _logger is None:
        from aws_lambda_powertools import Logger

        _logger = Logger(service=os.environ.get("POWERTOOLS_SERVICE_NAME", SERVICE),
                         level=os.environ.get("LOG_LEVEL", "INFO"))
    return _logger


def metrics() -> Metrics:
    """The execution environment's EMF metrics."""
    global _metrics
    if _metrics is None:
        from aws_lambda_powertools import Metrics

        _metrics = Metrics(namespace=os.environ.get("POWERTOOLS_METRICS_NAMESPACE", NAMESPACE),
                           service=os.environ.get("POWERTOOLS_SERVICE_NAME", SERVICE))
    return _metrics


def count(name: str, value: float = 1, unit: str = "Count") -> None:
    """Add ``value`` to metric ``name`` for this request (nothing when metrics are off)."""
    if _metrics_disabled():
        return
    metrics().add_metric(name=name, unit=unit, value=value)


@cache
def _metrics_disabled() -> bool:
    # Powertools stops printing when disabled but keeps collecting, and prints anyway once
    # 100 values pile up: skip collecting instead.
    return os.environ.get("POWERTOOLS_METRICS_DISABLED", "").lower() in {"1", "true"}


def flush() -> None:
    """Write this request's metrics (one EMF line) and start afresh."""
    if _metrics is not None and _metrics.metric_set:
        _metrics.flush_metrics()


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

                _tracer = Tracer(service=os.environ.get("POWERTOOLS_SERVICE_NAME", SERVICE),
                                 patch_modules=["httpx"])
            except Exception:  # X-Ray SDK missing: run untraced rather than fail requests
                logger().warning("tracing unavailable; continuing without it")
    return _tracer


def hashed_user(user_id: str) -> str:
    """A stable, non-reversible tag for a user id, safe to log."""
    return hashlib.sha256(b"atto-user:" + user_id.encode()).hexdigest()[:16]
