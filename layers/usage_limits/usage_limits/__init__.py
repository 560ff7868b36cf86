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
    "LiveGrant": "budget",
    "Lowered": "budget",
    "CreditCrossing": "budget",
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
    # ``X as X`` marks each name as re-exported for type checkers and linters, which
    # cannot read ``__all__`` when it is computed from ``_EXPORTS``.
    from .budget import CreditCrossing as CreditCrossing
    from .budget import LiveGrant as LiveGrant
    from .budget import Lowered as Lowered
    from .budget import Reservation as Reservation
    from .budget import SpendEvent as SpendEvent
    from .budget import TokenBudget as TokenBudget
    from .budget import Usage as Usage
    from .budget import Window as Window
    from .budget import WindowUsage as WindowUsage
    from .connection import redis_from_env as redis_from_env
    from .exceptions import CostExceedsLimit as CostExceedsLimit
    from .exceptions import InvalidArgument as InvalidArgument
    from .exceptions import LimiterUnavailable as LimiterUnavailable
    from .exceptions import ProviderBusy as ProviderBusy
    from .exceptions import UsageLimitError as UsageLimitError
    from .throttle import ProviderThrottle as ProviderThrottle
    from .throttle import UpstreamRateLimited as UpstreamRateLimited
    from .throttle import throttled as throttled
