"""Per-user token budgets and distributed provider throttling on Redis.

Public names are imported lazily, so ``import usage_limits`` costs nothing at cold start
until a name is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # token budget ledger
    "TokenBudget": "budget",
    "Window": "budget",
    "Reservation": "budget",
    "Usage": "budget",
    "WindowUsage": "budget",
    "SpendEvent": "budget",
    # provider throttle
    "ProviderThrottle": "throttle",
    "throttled": "throttle",
    "UpstreamRateLimited": "throttle",
    # redis connection
    "redis_from_env": "connection",
    # errors
    "UsageLimitError": "exceptions",
    "InvalidArgument": "exceptions",
    "CostExceedsLimit": "exceptions",
    "LimiterUnavailable": "exceptions",
    "ProviderBusy": "exceptions",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'usage_limits' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .budget import Reservation, SpendEvent, TokenBudget, Usage, Window, WindowUsage
    from .connection import redis_from_env
    from .exceptions import (
        CostExceedsLimit,
        InvalidArgument,
        LimiterUnavailable,
        ProviderBusy,
        UsageLimitError,
    )
    from .throttle import ProviderThrottle, UpstreamRateLimited, throttled
