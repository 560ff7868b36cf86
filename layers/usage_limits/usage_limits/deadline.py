"""One deadline per request, shared by everything that waits on its behalf.

The FastAPI glue sets it when a request starts: min(Lambda remaining time, API Gateway's
29 s) minus a safety margin. Provider throttles and clients read ``remaining_s()`` so that
no wait or upstream call starts that could not finish before the Lambda is killed (a timed
out Lambda runs no ``finally``: refunds must happen before the deadline).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

#: API Gateway HTTP APIs give up on an integration after 30 s; stay under it.
API_GATEWAY_LIMIT_S = 29.0
#: Time kept back for refunds and writing the response.
DEFAULT_MARGIN_S = 0.5

_deadline: ContextVar[float | None] = ContextVar("usage_limits_deadline", default=None)


def remaining_s(default: float = API_GATEWAY_LIMIT_S) -> float:
    """Seconds left before the current request's deadline (``default`` outside a request)."""
    deadline = _deadline.get()
    if deadline is None:
        return default
    return max(0.0, deadline - time.monotonic())


def deadline_at() -> float | None:
    """The current deadline as a ``time.monotonic()`` value, or None outside a request."""
    return _deadline.get()


def request_budget_s(lambda_remaining_ms: int | None, margin_s: float = DEFAULT_MARGIN_S) -> float:
    """min(Lambda remaining time, API Gateway's limit) minus ``margin_s``, never negative."""
    limit = API_GATEWAY_LIMIT_S
    if lambda_remaining_ms is not None:
        limit = min(limit, lambda_remaining_ms / 1000.0)
    return max(0.0, limit - margin_s)


@contextlib.contextmanager
def deadline_scope(seconds: float) -> Iterator[float]:
    """Set the deadline ``seconds`` from now for the code inside the block.

    A nested scope can only shorten the deadline, never extend it.
    """
    new = time.monotonic() + max(0.0, seconds)
    outer = _deadline.get()
    if outer is not None:
        new = min(new, outer)
    token = _deadline.set(new)
    try:
        yield new
    finally:
        _deadline.reset(token)
