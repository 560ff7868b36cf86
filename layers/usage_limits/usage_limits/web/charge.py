"""``Charge``: the tokens held for one request, and the only way to lower or refund them.

A charge remembers the nonce of the reservation that made it, so its refund or settle
touches that very charge and no other, however late it runs: a refund kept after a lost
reply, or one that redis-py re-sends, finds nothing to remove once another call (a
client's retry served by another environment) has charged the same request id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import observability as obs

if TYPE_CHECKING:
    from ..budget import Reservation, TokenBudget


@dataclass
class Charge:
    """Tokens held for one request: refunded by the middleware unless the request succeeds.

    Attributes:
        user_id: whose budget was charged.
        request_id: the id the charge is tied to.
        cost: tokens currently charged (lowered by ``settle``).
        nonce: the nonce of the reservation that made (or may have made) the charge.
        reservation: the ledger's answer at reservation time (None when Redis never
            answered the reservation).
    """

    budget: TokenBudget = field(repr=False)
    user_id: str
    request_id: str
    cost: int
    nonce: str = field(repr=False)
    reservation: Reservation | None = field(default=None, repr=False)

    async def settle(self, actual_cost: int) -> None:
        """Lower the charge to ``actual_cost`` (never raises it).

        Raises:
            InvalidArgument: ``actual_cost`` is not an integer >= 0.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        if actual_cost < self.cost:
            await self.budget.settle(self.user_id, self.request_id, actual_cost=actual_cost,
                                     nonce=self.nonce)
            obs.count(obs.TOKENS_SETTLED, self.cost - actual_cost)
            self.cost = actual_cost

    async def refund(self) -> bool:
        """Give this charge's tokens back.

        Returns:
            True when this charge was removed; False when it was gone already (or never
            made, or the id is now another call's charge).

        Raises:
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        refunded = await self.budget.refund(self.user_id, self.request_id, nonce=self.nonce)
        self.cost = 0
        return bool(refunded)
