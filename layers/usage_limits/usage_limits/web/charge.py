"""``Charge``: the tokens held for one request, and the only way to lower or refund them.

A charge remembers the nonce of the reservation that made it, so its refund or settle
touches that very charge and no other, however late it runs: a refund kept after a lost
reply, or one that redis-py re-sends, finds nothing to remove once another call (a
client's retry served by another environment) has charged the same request id.

With entitlements on, a charge may have drawn credit from the user's grants. Lowering it
goes through ``EntitlementCache.lower``: a draw recorded in DynamoDB (or possibly
recorded) gets its credit back there first, conditioned on the charge's own record, and the
ledger's copy then gets exactly that; a draw never recorded gets its credit back in the
copy alone. When DynamoDB cannot be reached the ledger's part is done now and the
lowering is kept (``refunds.keep``) to finish in DynamoDB later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..exceptions import LimiterUnavailable
from . import observability as obs

if TYPE_CHECKING:
    from ..budget import Crossing, Reservation, TokenBudget
    from ..entitlements.cache import CreditState, EntitlementCache


class CreditPending(LimiterUnavailable):
    """The ledger lowered the charge, but the record of truth could not be reached to give
    its credit back: the lowering is kept and finished later (calling again is safe)."""


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
        credit: where the charge's draw stands in the record of truth (``CreditState``);
            None: decided from the reservation (nothing drawn: ``none``; no answer from
            the ledger: ``drawn``; a draw not yet recorded: ``undone``).
        uncross: usage-threshold crossings the charge made and that were never reported;
            undone with its refund.
    """

    budget: TokenBudget = field(repr=False)
    user_id: str
    request_id: str
    cost: int
    nonce: str = field(repr=False)
    reservation: Reservation | None = field(default=None, repr=False)
    entitlements: EntitlementCache | None = field(default=None, repr=False)
    credit: CreditState | None = None
    uncross: tuple[Crossing, ...] = field(default=(), repr=False)

    def credit_state(self) -> CreditState:
        """Where the charge's credit stands in the record of truth."""
        if self.credit is not None:
            return self.credit
        if self.reservation is None:
            return "drawn"
        return "undone" if self.reservation.drawn > 0 else "none"

    async def lower_to(self, new_cost: int) -> bool:
        """Lower the charge to ``new_cost`` and give back the credit that frees.

        Returns:
            True when the ledger lowered it now (False: at or below already, or gone).

        Raises:
            CreditPending: the ledger's part is done; the record of truth's is not (keep
                the lowering and call again).
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        from . import records

        try:
            changed = await self._lower_ledger(new_cost)
        except CreditPending:  # the ledger's part is done: so is the statement's
            records.lowered(self, new_cost)
            raise
        # also when the ledger says it was lowered already (a re-sent script's second
        # reply): the record's lowering is idempotent, and must not be left out
        records.lowered(self, new_cost)
        return changed

    async def _lower_ledger(self, new_cost: int) -> bool:
        """``lower_to`` in the ledger (and the record of truth), without the usage record."""
        if self.entitlements is None:
            if new_cost == 0:
                return await self.budget.refund(self.user_id, self.request_id,
                                                nonce=self.nonce, uncross=self.uncross)
            return await self.budget.settle(self.user_id, self.request_id,
                                            actual_cost=new_cost, nonce=self.nonce)
        done = await self.entitlements.lower(self.budget, self.user_id, self.request_id,
                                             self.nonce, new_cost, state=self.credit_state(),
                                             uncross=self.uncross if new_cost == 0 else ())
        if new_cost == 0:
            self.uncross = ()
        if not done.settled:
            raise CreditPending("the charge's credit could not be returned in the record of "
                                "truth yet; kept")
        return done.lowered.changed

    async def settle(self, actual_cost: int) -> None:
        """Lower the charge to ``actual_cost`` (never raises it).

        When only the record of truth could not be reached, the ledger's part is done and
        the rest is kept to finish later: the request goes on.

        Raises:
            InvalidArgument: ``actual_cost`` is not an integer >= 0.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        if actual_cost < self.cost:
            try:
                await self.lower_to(actual_cost)
            except CreditPending:
                from . import refunds
                from .settings import settings

                obs.logger().warning("a settle's credit is kept to return later")
                refunds.keep(self, settings().plans.longest_s, target=actual_cost)
            obs.count(obs.TOKENS_SETTLED, self.cost - actual_cost)
            self.cost = actual_cost

    async def refund(self) -> bool:
        """Give this charge's tokens back.

        Returns:
            True when this charge was removed; False when it was gone already (or never
            made, or the id is now another call's charge).

        Raises:
            CreditPending: the ledger gave the tokens back; the record of truth has yet to
                give the credit back (keep the refund and call again).
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        refunded = await self.lower_to(0)
        self.cost = 0
        return bool(refunded)
