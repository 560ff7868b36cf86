"""Errors raised by usage_limits.

    UsageLimitError
     ├── InvalidArgument          bad input (also a ValueError); nothing was touched
     │    └── CostExceedsLimit    a cost that no window or bucket could ever admit
     ├── LimiterUnavailable       Redis unreachable, timing out or refusing: fail closed
     └── ProviderBusy             no provider slot within the allowed wait (retry_after_s)

Each class is one cause. Redis client errors are re-raised as ``LimiterUnavailable``
``from`` the original, so callers never need to import redis to handle them.
"""

from __future__ import annotations


class UsageLimitError(Exception):
    """Base class of every error this package raises."""


class InvalidArgument(UsageLimitError, ValueError):
    """An argument is out of range or malformed. Nothing in Redis was changed."""


class CostExceedsLimit(InvalidArgument):
    """The cost is larger than a window's limit (or a bucket's burst): it can never fit.

    Attributes:
        cost: the cost asked for.
        limit: the limit of the window (or bucket) it exceeds.
        credit: with entitlements on, when the window is the plan's quota (credit pays the
            part beyond it): the user's live credit, short of ``cost - limit``; else None
            (credit cannot help: a shorter window, or entitlements off).
        window_s: that window's length, seconds, when known.
    """

    def __init__(self, message: str, *, cost: float, limit: float,
                 credit: int | None = None, window_s: float | None = None) -> None:
        super().__init__(message)
        self.cost = cost
        self.limit = limit
        self.credit = credit
        self.window_s = window_s


class LimiterUnavailable(UsageLimitError):
    """Redis could not be reached or did not answer in time. Callers must fail closed."""


class ProviderBusy(UsageLimitError):
    """No provider slot could be had within the allowed wait.

    Attributes:
        provider: the provider's name.
        retry_after_s: seconds after which a request would likely get a slot.
    """

    def __init__(self, provider: str, retry_after_s: float, message: str | None = None) -> None:
        super().__init__(
            message or f"provider {provider!r} is busy; retry after {retry_after_s:.3f}s")
        self.provider = provider
        self.retry_after_s = retry_after_s
