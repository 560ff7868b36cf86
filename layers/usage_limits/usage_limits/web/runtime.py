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
#: The environment's ledgers, one per plan, over the client they were made for.
_budgets: dict[tuple[tuple[int, int], ...], TokenBudget] = {}
_budgets_client: Any = None


def set_redis(client: Any) -> None:
    """Use ``client`` for every request of this process (tests, custom wiring); None resets."""
    global _injected, _client, _client_loop, _budgets_client
    _injected, _client, _client_loop, _budgets_client = client, None, None, None
    _budgets.clear()


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
    (a TokenBudget encodes its plan's script arguments when it is made). A deployment has a
    few named plans, so one is kept per plan; a new client starts them afresh."""
    global _budgets_client
    client = get_redis()
    if _budgets_client is not client:
        _budgets.clear()
        _budgets_client = client
    budget = _budgets.get(windows)
    if budget is not None:
        return budget
    from ..budget import TokenBudget, Window
    from ..thresholds import configured
    from .settings import settings

    budget = _budgets[windows] = TokenBudget(
        client, windows=[Window(limit=limit, seconds=seconds) for limit, seconds in windows],
        thresholds=configured(), credit_low_percent=settings().credit_low_percent)
    return budget
