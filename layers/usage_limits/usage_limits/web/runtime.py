"""Per-execution-environment singletons: one Redis client, its ledgers, the entitlements.

A Lambda execution environment handles one request at a time and Mangum runs every
invocation on the same event loop, so one lazily created ``redis.asyncio`` client is reused
across invocations. The client is tied to the loop it was created on: if code ever runs on
another loop (a test, or something calling ``asyncio.run``) a new client is made for it
instead of failing with "attached to a different loop".
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from .settings import settings

if TYPE_CHECKING:
    from ..budget import TokenBudget
    from ..entitlements.cache import EntitlementCache

_client: Any = None
_client_loop: asyncio.AbstractEventLoop | None = None
_injected: Any = None
#: The environment's ledgers, one per plan, over the client they were made for.
_budgets: dict[tuple[tuple[int, int], ...], TokenBudget] = {}
_budgets_client: Any = None
_entitlements: EntitlementCache | None = None


def set_redis(client: Any) -> None:
    """Use ``client`` for every request of this process (tests, custom wiring); None resets."""
    global _injected, _client, _client_loop, _budgets_client, _entitlements
    _injected, _client, _client_loop, _budgets_client = client, None, None, None
    _entitlements = None
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
    few named plans, so one is kept per plan; a new client starts them afresh.

    With the entitlements table configured (``ATTO_ENTITLEMENTS_TABLE``) each ledger knows
    every plan of the deployment (an operator's override names one of them) and applies
    overrides, grants and suspensions; without it, none are read."""
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

    conf = settings()
    catalog = None
    if conf.entitlements:
        catalog = {name: [Window(limit=limit, seconds=seconds) for limit, seconds in p.windows]
                   for name, p in conf.plans.by_name.items()}
    budget = _budgets[windows] = TokenBudget(
        client, windows=[Window(limit=limit, seconds=seconds) for limit, seconds in windows],
        thresholds=configured(), catalog=catalog, entitlements=conf.entitlements,
        credit_low_percent=conf.credit_low_percent)
    return budget


def get_entitlements() -> EntitlementCache | None:
    """The environment's entitlements cache over the store, or None when the entitlements
    table is not configured (the request path then reads no entitlements)."""
    global _entitlements
    if not settings().entitlements:
        return None
    if _entitlements is None:
        from ..entitlements.cache import EntitlementCache
        from ..entitlements.store import default_store

        _entitlements = EntitlementCache(default_store())
        _entitlements.on_forfeit = _publish_expired
    return _entitlements


def _publish_expired(user_id: str, grants: list[Any]) -> None:
    """Publish ``Atto Credit Expired`` for grants a load or read recorded as expired."""
    from . import events

    events.publish_soon(events.expired_events(user_id, grants))
