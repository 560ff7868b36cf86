"""Per-execution-environment singletons: one Redis client and one ledger.

A Lambda execution environment handles one request at a time and Mangum runs every
invocation on the same event loop, so one lazily created ``redis.asyncio`` client is reused
across invocations. The client is tied to the loop it was created on: if code ever runs on
another loop (a test, or something calling ``asyncio.run``) a new client is made for it
instead of failing with "attached to a different loop".
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..budget import TokenBudget

_client: Any = None
_client_loop: asyncio.AbstractEventLoop | None = None
_injected: Any = None


def set_redis(client: Any) -> None:
    """Use ``client`` for every request of this process (tests, custom wiring); None resets."""
    global _injected, _client, _client_loop
    _injected, _client, _client_loop = client, None, None


def get_redis() -> Any:
    """The process's async Redis client, created on first use from the environment."""
    global _client, _client_loop
    if _injected is not None:
        return _injected
    loop = asyncio.get_running_loop()
    if _client is None or _client_loop is not loop:
        from ..connection import redis_from_env
        from ..exceptions import InvalidArgument, LimiterUnavailable

        try:
            _client, _client_loop = redis_from_env(), loop
        except InvalidArgument as exc:  # a deployment mistake, not the caller's: fail closed
            raise LimiterUnavailable(f"redis is misconfigured: {exc}") from exc
    return _client


def get_budget(windows: tuple[tuple[int, int], ...]) -> TokenBudget:
    """A ledger over the shared client for the given plan (cheap: no I/O)."""
    from ..budget import TokenBudget, Window

    return TokenBudget(get_redis(), windows=[Window(limit=limit, seconds=seconds)
                                             for limit, seconds in windows])
