"""The draw's rebase loop is bounded by the request's deadline, not only by its count."""

from __future__ import annotations

import asyncio
from typing import Any

from usage_limits.deadline import deadline_scope
from usage_limits.entitlements import cache as cache_module
from usage_limits.entitlements.cache import EntitlementCache


class _AlwaysStale:
    """A store whose every draw finds a newer load epoch (operator changes keep landing)."""

    def __init__(self) -> None:
        self.draws = 0

    def commit_draw(self, *args: Any, **kwargs: Any) -> str:
        self.draws += 1
        return "stale"


class _Reservation:
    credit_crossings = ()
    epoch, cost, draws = 1, 4, (("g", 4),)


def _commit(seconds: float) -> tuple[str, int, int]:
    store = _AlwaysStale()
    cache = EntitlementCache(store)  # type: ignore[arg-type]
    moves = 0

    async def rebase(*args: Any, **kwargs: Any) -> tuple[int, int]:
        nonlocal moves
        moves += 1
        return 1, 1 + moves

    cache._rebase = rebase  # type: ignore[method-assign]

    async def run() -> str:
        with deadline_scope(seconds):
            return await cache.commit_draw(None, "u", "r", "n", _Reservation())  # type: ignore[arg-type]

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(run()), store.draws, moves
    finally:
        loop.close()


def test_a_draw_near_its_deadline_is_undone_instead_of_moved_again() -> None:
    """With less than REBASE_MIN_LEFT_S left, a stale draw is not moved (answered undone)."""
    assert _commit(cache_module.REBASE_MIN_LEFT_S / 2) == ("undone", 1, 0)


def test_a_draw_with_time_left_is_moved_up_to_its_bound() -> None:
    """With time left, a draw that keeps going stale is moved MAX_REBASES times, then undone."""
    outcome, draws, moves = _commit(30.0)
    assert outcome == "undone"
    assert moves == cache_module.MAX_REBASES + 1 == draws
