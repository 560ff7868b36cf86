"""Provisional charges: confirmed by their request's success, else undone by the user's next
request, wherever it runs.

Every charge the guard makes is provisional (``TokenBudget.reserve(hold_ms=...)``) for
the rest of its request's time plus ``HOLD_MARGIN_S`` (``hold_ms``). A request that
succeeds confirms its charge before its answer goes out (``confirm``); one that cannot
(Redis did not answer, or its charge was claimed meanwhile) answers 503 instead and
refunds. A charge never
confirmed (the reservation's reply was lost, the refund after a failure was lost, the
execution environment died) is claimed, once its hold has ended, by the next request of
the same user that confirms a charge, or that the ledger refuses (429) or finds already
charged (409), and refunded there (``undo``): through the record of truth first when it
drew credit, as every refund. So a retry of the same ``Idempotency-Key`` is blocked for at
most the hold, and such a charge is refunded at the user's next request after it, even when
the environment that made it never serves again.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..deadline import request_budget_s
from . import observability as obs
from . import refunds
from .charge import Charge, CreditPending
from .settings import settings

if TYPE_CHECKING:
    from ..budget import Claimed, TokenBudget
    from ..entitlements.cache import EntitlementCache

#: A charge stays provisional this long past its Lambda invocation's end (clock skew
#: between hosts, and the clean-up's last steps).
HOLD_MARGIN_S = 5.0
#: The longest a claim and its refunds may take before a 429 or 409 is answered.
UNDO_BOUND_S = 0.5


def hold_ms(remaining_ms: int) -> int:
    """The hold of a charge made by an invocation with ``remaining_ms`` left: until the
    request's time is up (the Lambda's remaining time, at most API Gateway's limit; its
    answer, and so its confirmation, comes before that), plus ``HOLD_MARGIN_S``."""
    return int(request_budget_s(remaining_ms, 0.0) * 1000) + int(HOLD_MARGIN_S * 1000)


async def confirm(charge: Charge, within_s: float) -> tuple[bool, tuple[Claimed, ...]]:
    """Confirm a successful request's charge within ``within_s``.

    Returns:
        (confirmed, the user's expired charges claimed on the way). Not confirmed: the
        charge is gone or claimed, or Redis did not answer in time (the charge stays
        provisional and is undone after its hold).
    """
    try:
        async with asyncio.timeout(max(0.0, within_s)):
            held = await charge.budget.hold(charge.user_id, charge.request_id,
                                            nonce=charge.nonce)
    except Exception:  # unknown: not confirmed; the hold's end undoes it if it stands
        obs.logger().exception("could not confirm a charge; the request fails")
        return False, ()
    return bool(held.confirmed), held.claimed


async def undo(budget: TokenBudget, entitlements: EntitlementCache | None, user_id: str,
               claimed: tuple[Claimed, ...] | None = None,
               within_s: float = UNDO_BOUND_S) -> set[str]:
    """Refund the user's expired provisional charges (claimed now when ``claimed`` is None).

    Each refund runs by its nonce, so it removes that very charge or nothing; one that
    drew credit returns it in the record of truth first. One that does not finish in time
    is kept (``web.refunds``), and its claim stays in the ledger, so the user's next
    request tries it too. Failures are logged, never raised.

    Returns:
        The request ids whose charge is gone now.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    try:
        if claimed is None:
            async with asyncio.timeout(within_s):
                claimed = (await budget.hold(user_id)).claimed
    except Exception:
        obs.logger().warning("could not claim expired charges", exc_info=True)
        return set()
    done: set[str] = set()
    for item in claimed:
        charge = Charge(budget, user_id, item.request_id, item.cost, item.nonce,
                        entitlements=entitlements,
                        credit="unknown" if item.drew and entitlements is not None else "none")
        try:
            async with asyncio.timeout(max(0.0, end - loop.time())):
                removed = await charge.refund()
        except CreditPending:  # the ledger's part is done
            charge.cost = item.cost
            refunds.keep(charge, settings().plans.longest_s)
            done.add(item.request_id)
            continue
        except Exception:
            obs.logger().warning("could not refund an expired charge; kept", exc_info=True,
                                 extra={"request_id": item.request_id})
            charge.cost = item.cost
            refunds.keep(charge, settings().plans.longest_s)
            continue
        done.add(item.request_id)
        if removed:
            obs.count(obs.TOKENS_REFUNDED, item.cost)
            obs.logger().info("expired provisional charge refunded",
                              extra={"request_id": item.request_id})
    return done
