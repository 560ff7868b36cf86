"""``Charge``: the tokens held for one request, and the only way to lower or refund them.

A charge remembers the nonce of the reservation that made it, so its refund or settle
touches that very charge and no other, however late it runs: a refund kept after a lost
reply, or one that redis-py re-sends, finds nothing to remove once another call (a
client's retry served by another environment) has charged the same request id.

With entitlements on, a charge may have drawn credit from the user's grants. Lowering it
gives that credit back in Redis first (the ledger's ``lower``), then in DynamoDB through
``EntitlementCache.give_back``; a draw that was never recorded there gets its credit
back by a reload of the user's copy instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import observability as obs

if TYPE_CHECKING:
    from ..budget import Reservation, TokenBudget
    from ..entitlements.cache import EntitlementCache


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
        entitlements: the entitlements cache when the request path applies grants (None:
            no credit can have been drawn, and lowering is the ledger's alone).
        recorded: the charge's draws from grants are recorded in DynamoDB.
    """

    budget: TokenBudget = field(repr=False)
    user_id: str
    request_id: str
    cost: int
    nonce: str = field(repr=False)
    reservation: Reservation | None = field(default=None, repr=False)
    entitlements: EntitlementCache | None = field(default=None, repr=False)
    recorded: bool = False

    async def _lower(self, new_cost: int) -> bool:
        """Lower the charge to ``new_cost`` and give back the credit that frees."""
        if self.entitlements is None:
            if new_cost == 0:
                return await self.budget.refund(self.user_id, self.request_id,
                                                nonce=self.nonce)
            return await self.budget.settle(self.user_id, self.request_id,
                                            actual_cost=new_cost, nonce=self.nonce)
        lowered = await self.budget.lower(self.user_id, self.request_id, new_cost,
                                          nonce=self.nonce)
        await self.entitlements.give_back(self.budget, self.user_id, self.request_id,
                                          self.nonce, new_cost, lowered,
                                          recorded=self.recorded)
        return lowered.changed

    async def settle(self, actual_cost: int) -> None:
        """Lower the charge to ``actual_cost`` (never raises it).

        Raises:
            InvalidArgument: ``actual_cost`` is not an integer >= 0.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        if actual_cost < self.cost:
            await self._lower(actual_cost)
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
        refunded = await self._lower(0)
        self.cost = 0
        return bool(refunded)
