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
#: The environment's ledger: (client, plan, budget) of the last get_budget, or None.
_budget: tuple[Any, tuple[tuple[int, int], ...], TokenBudget] | None = None


def set_redis(client: Any) -> None:
    """Use ``client`` for every request of this process (tests, custom wiring); None resets."""
    global _injected, _client, _client_loop, _budget
    _injected, _client, _client_loop, _budget = client, None, None, None


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
    """The ledger over the shared client for the given plan, made once per client and plan
    (a TokenBudget encodes its plan's script arguments when it is made); one is kept, since
    an environment has one client and one plan."""
    global _budget
    client = get_redis()
    current = _budget
    if current is not None and current[0] is client and current[1] == windows:
        return current[2]
    from ..budget import TokenBudget, Window
    from ..thresholds import configured

    budget = TokenBudget(client, windows=[Window(limit=limit, seconds=seconds)
                                          for limit, seconds in windows],
                         thresholds=configured())
    _budget = (client, windows, budget)
    return budget
