"""Per-user token budgets: a sliding-window spend ledger in Redis.

Each user has three keys sharing one hash tag (see ``keys.user_keys``):

    log   sorted set   request id -> time of the charge (ms since the epoch)
    ev    hash         request id -> "<cost> <nonce> <route>"
    meta  hash         one field m: the key's clock, and per window of W ms a running
                       total and a cursor (events scored <= the cursor are out of the
                       total); ``meta_fields`` reads it

A reservation checks and charges every window of the plan in one Lua script
(``lua/budget_reserve.lua``). Windows keep running totals: each call subtracts only the
events that left a window since the previous call, so a call costs O(log N) plus the
expired events, never a sum over the window. Charges are tied to the request id: the same
id is charged once, a refund removes it once, and ``settle`` may lower it afterwards.

Things worth knowing:

- Time is the caller's clock in ms, clamped per user so it never runs backwards (meta clk).
- Each reservation carries a random nonce (``new_nonce()``, or the caller's own) stored with
  the charge: when redis-py re-sends a reservation whose reply was lost, the ledger
  recognises its own call and reports the original success; a different call with the same
  id gets ``duplicate=True``.
- A refund or settle names the nonce of the reservation that made the charge, and lowers
  only that charge: a refund kept for later, or one that runs twice, can never remove the
  charge another call made under the same id since (a client's retry served elsewhere).
- A refund or settle that is re-sent finds nothing left to lower and returns False.
- A window a user never had (a plan change) is counted once from the log, which costs
  O(events in it) for that one call and cannot see events older than the windows kept so
  far. Windows a user had stay maintained (cheaply) until the keys expire, so switching
  plans back and forth stays exact; the log keeps events for the longest of them.
- An event that leaves the longest window has left every window: it is no longer counted,
  refunded or listed, and it is deleted with the next batch of 8 such events (or when the
  keys' expiry is renewed, or by a usage read), not one at a time on every call.
- Keys outlive the longest window by at least ``key_margin_s`` after every call, and by at
  most an hour more (their expiry is renewed only when it would fall short): an idle user
  costs nothing.

Entitlements (``TokenBudget(..., entitlements=True)``) add two keys in the same hash tag:

    ent   hash         epoch (the load's; its presence means loaded), want (an invalidated
                       ent's least next epoch), plan (an operator's override), susp (the end
                       of a suspension, ms; 0 = until lifted), g:<reference> per live grant
                       "<remaining> <expires_ms or 0> <kind> <created_ms> <tokens>[ <flags>]"
    dr    hash         request id -> "#<epoch> <ref>=<n> ..." (the draws of one charge)

and meta keeps d:W, the tokens drawn from grants by the events window W counts. The plan's
longest window is the included quota: a charge that fits every shorter window but not the
quota draws the difference from live grants (earliest expiry first, promo before paid),
refunds and settles give drawn credit back to its grant (never to an expired or voided one,
nor across a reload), a suspended user is refused (``status="suspended"``) and a user whose
ent is not loaded gets ``status="not_loaded"`` (load, then call again). Off, the scripts
read none of it and cost what they always did.

Typical use::

    budget = TokenBudget(redis, windows=[Window(limit=100, seconds=3600),
                                         Window(limit=1000, seconds=30 * 86400)])
    d = await budget.reserve("alice", "req-1", cost=8, route="/v1/structured")
    if not d.allowed:
        ...  # 429 with Retry-After: d.retry_after_s
    try:
        ...  # call the provider
    except Exception:
        await budget.refund("alice", "req-1", nonce=d.nonce)
        raise
"""

from __future__ import annotations

import math
import re
import secrets
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ._scripts import script
from .exceptions import CostExceedsLimit, InvalidArgument
from .keys import user_keys

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    from .thresholds import Thresholds

    AnyRedis = Redis | RedisCluster

#: Longest request id or route accepted, in characters.
MAX_ID_LENGTH = 256
#: Largest cost or limit, in tokens. Lua numbers are doubles: integers are exact below 2**53.
MAX_TOKENS = 2**50
#: Longest window accepted (ten years), seconds.
MAX_WINDOW_S = 10 * 366 * 86400.0
#: Default time every key outlives the longest window, seconds.
DEFAULT_KEY_MARGIN_S = 60.0
#: Longest nonce accepted, in characters (``new_nonce`` makes 16).
MAX_NONCE_LENGTH = 64
#: Random bytes in a nonce made by ``new_nonce``: two calls of one id collide with
#: probability 2**-64.
NONCE_BYTES = 8
#: Longest hold of a provisional charge accepted (``reserve(hold_ms=...)``): a day, ms.
MAX_HOLD_MS = 86_400_000
#: Expired provisional charges one ``hold`` call claims, by default.
HOLD_CLAIM = 8
#: Default and largest number of spend events returned by ``usage``.
DEFAULT_EVENTS = 50
MAX_EVENTS = 1000
#: Default credit "low" threshold, percent of a grant's tokens.
DEFAULT_CREDIT_LOW_PERCENT = 20
#: Re-arming margin of credit reports when the budget has no thresholds, percentage points.
DEFAULT_CREDIT_MARGIN = 5
#: A plan name of the catalog, and a grant reference (no spaces, no ``#``, ``;`` or ``=``
#: where the scripts would read them as separators).
_PLAN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_REFERENCE = re.compile(r"[A-Za-z0-9_.:@/+=-]{1,128}")
#: Largest grant or remaining amount, tokens.
MAX_GRANT_TOKENS = 10**12

#: What a reservation did.
Status = Literal["charged", "duplicate", "rejected", "suspended", "not_loaded"]
GrantKind = Literal["paid", "promo"]
CreditKind = Literal["low", "exhausted"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Window:
    """One sliding window of a plan: at most ``limit`` tokens within any ``seconds``.

    Attributes:
        limit: tokens allowed in the window (integer >= 1).
        seconds: the window's length; Redis keeps it in whole milliseconds (>= 1 ms).

    Raises:
        InvalidArgument: a non-positive or non-integer limit, or a non-positive length.
    """

    limit: int
    seconds: float

    def __post_init__(self) -> None:
        if not _is_int(self.limit) or not 1 <= self.limit <= MAX_TOKENS:
            raise InvalidArgument(f"window limit must be an integer >= 1, not {self.limit!r}")
        s = self.seconds
        if (isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s)
                or not 0 < s <= MAX_WINDOW_S or round(s * 1000) < 1):
            raise InvalidArgument(f"window seconds must be at least 0.001, not {s!r}")

    @property
    def ms(self) -> int:
        """The window's length in milliseconds, as stored in Redis."""
        return round(self.seconds * 1000)


@dataclass(frozen=True)
class WindowUsage:
    """One window's state.

    Attributes:
        limit: tokens allowed in the window.
        used: tokens counted in the window (after the request, for a reservation).
        remaining: ``limit - used``, never below 0.
        window_s: the window's length, seconds.
        resets_at_ms: when the oldest counted charge leaves the window and ``remaining``
            next grows, ms since the epoch on the ledger's clock; None when the window
            holds no charge (nothing to wait for).
    """

    limit: int
    used: int
    remaining: int
    window_s: float
    resets_at_ms: int | None

    @property
    def resets_at(self) -> float | None:
        """``resets_at_ms`` as seconds since the epoch (None when the window is empty)."""
        return None if self.resets_at_ms is None else self.resets_at_ms / 1000.0


@dataclass(frozen=True)
class Reservation:
    """The outcome of ``TokenBudget.reserve``.

    Attributes:
        allowed: the request may go ahead. True also for a duplicate request id.
        remaining: the smallest number of tokens left across the windows after this call.
        retry_after_s: 0.0 when allowed; else seconds until enough of the oldest charges
            leave every window that rejected the request for ``cost`` to fit.
        duplicate: the id was already charged by an earlier call; nothing was charged now.
            A client re-send of the very same call reports ``duplicate=False``.
        cost: tokens this call asked for (charged only when allowed and not duplicate).
        limit: limit of the binding window: the rejecting window with the longest wait, or
            when allowed the window with the least remaining (the shortest one on a tie).
        window_s: length of the binding window, seconds.
        windows: every window of the plan, shortest first.
        nonce: this call's nonce; ``refund`` and ``settle`` of the charge it made need it.
        crossings: the usage thresholds this charge crossed (a budget made with
            ``thresholds`` only), each reported once (see ``usage_limits.thresholds``).
        status: ``charged`` (now, or by this very call before a re-send), ``duplicate``,
            ``rejected``, and with entitlements on ``suspended`` or ``not_loaded`` (load
            the user's entitlements, then call again); nothing is charged for the last
            three. A re-send of a call that charged is ``charged`` whatever changed since.
        plan_name: the plan used: an operator's override naming a catalog plan, else the
            ``plan_name`` passed ('' when none).
        drawn: tokens of this charge drawn from grants (0 when none).
        draws: (reference, tokens) drawn, in draw order; a re-send reports the first run's.
        credit: the live credit left after the call (a charge, a re-send, a rejection);
            None when it was not read (a duplicate, a suspension, not loaded, or
            entitlements off).
        epoch: the entitlements epoch the draws were made under (the one read when none
            were); 0 when entitlements are off or not loaded.
        suspended_until_ms: for ``suspended``, when it ends, ms (0 = until lifted).
        credit_crossings: grants this charge took to low or exhausted credit, once each.
    """

    allowed: bool
    remaining: int
    retry_after_s: float
    duplicate: bool
    cost: int
    limit: int
    window_s: float
    windows: tuple[WindowUsage, ...]
    nonce: str = ""
    crossings: tuple[Crossing, ...] = ()
    status: Status = "charged"
    plan_name: str = ""
    drawn: int = 0
    draws: tuple[tuple[str, int], ...] = ()
    credit: int | None = None
    epoch: int = 0
    suspended_until_ms: int | None = None
    credit_crossings: tuple[CreditCrossing, ...] = ()


@dataclass(frozen=True)
class CreditCrossing:
    """A charge took a grant's remaining credit across "low" or to "exhausted" (once each).

    Attributes:
        reference: the grant's reference.
        kind: ``low`` (remaining went from above the low share of its tokens to at or below
            it) or ``exhausted`` (remaining reached 0).
        remaining: tokens left in the grant after the charge.
        tokens: the grant's amount.
        grant_kind: the grant's kind, ``promo`` or ``paid``.
    """

    reference: str
    kind: CreditKind
    remaining: int
    tokens: int
    grant_kind: str = ""


@dataclass(frozen=True)
class LiveGrant:
    """A grant as the hot path holds it (``load_entitlements`` writes them, ``usage`` reads).

    Attributes:
        reference: the grant's idempotency reference (``[A-Za-z0-9_.:@/+=-]{1,128}``).
        remaining: tokens it can still give (0..tokens).
        tokens: the amount granted.
        expires_at_ms: when it stops covering requests, ms since the epoch (None: never).
        kind: ``paid`` or ``promo`` (promo is drawn first at equal expiry).
        created_ms: when it was created, ms (older first at equal expiry and kind).
        reported: the credit reports already made for it and not re-armed since, a subset
            of ``lx`` (``l`` low, ``x`` exhausted): they are not made again.

    Raises:
        InvalidArgument: a malformed reference, kind, amount or flags.
    """

    reference: str
    remaining: int
    tokens: int
    expires_at_ms: int | None
    kind: GrantKind
    created_ms: int = 0
    reported: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.reference, str) or not _REFERENCE.fullmatch(self.reference):
            raise InvalidArgument(f"grant reference {self.reference!r} is malformed")
        if self.kind not in ("paid", "promo"):
            raise InvalidArgument(f"grant kind must be paid or promo, not {self.kind!r}")
        if not _is_int(self.tokens) or not 1 <= self.tokens <= MAX_GRANT_TOKENS:
            raise InvalidArgument(f"grant tokens must be an integer >= 1, not {self.tokens!r}")
        if not _is_int(self.remaining) or not 0 <= self.remaining <= self.tokens:
            raise InvalidArgument(f"grant remaining must be in 0..tokens, not {self.remaining!r}")
        if not isinstance(self.reported, str) or set(self.reported) - set("lx"):
            raise InvalidArgument(f"grant reported must be a subset of 'lx', not "
                                  f"{self.reported!r}")
        for name, value in (("expires_at_ms", self.expires_at_ms),
                            ("created_ms", self.created_ms)):
            if value is not None and (not _is_int(value) or not 0 <= value < 2**52):
                raise InvalidArgument(f"grant {name} must be ms since the epoch, not {value!r}")


@dataclass(frozen=True)
class Lowered:
    """What a refund or settle did (``TokenBudget.lower``).

    Attributes:
        changed: the charge was lowered or removed.
        returned: credit given back to live grants, (reference, tokens) in the order given
            back (reverse draw order); drawn credit of an expired or voided grant, or drawn
            under an older load epoch, is not in it: it is gone.
        epoch: the entitlements epoch the credit went back under (0 when none went back or
            entitlements are off).
        stale: credit was to go back, but the copy is not the one the charge drew from (a
            load since), or a grant of it is gone or expired: the copy got none of it and
            holds less than the record of truth; drop it (it reloads).
    """

    changed: bool
    returned: tuple[tuple[str, int], ...] = ()
    epoch: int = 0
    stale: bool = False


@dataclass(frozen=True)
class Claimed:
    """A provisional charge never confirmed, claimed to be refunded (``TokenBudget.hold``).

    Attributes:
        request_id: the charge's id.
        nonce: the nonce of the reservation that made it: refund it with this one.
        cost: tokens it holds.
        drew: it drew credit from grants (refund it through the record of truth first).
    """

    request_id: str
    nonce: str
    cost: int
    drew: bool


@dataclass(frozen=True)
class Held:
    """What ``TokenBudget.hold`` did.

    Attributes:
        confirmed: True: the charge is confirmed and stands; False: it is gone or claimed
            (its request must answer that it failed); None: no charge was named.
        claimed: the user's expired provisional charges to refund now.
    """

    confirmed: bool | None
    claimed: tuple[Claimed, ...] = ()


@dataclass(frozen=True)
class Crossing:
    """A charge took a window's usage across a threshold.

    Attributes:
        window_s: the window's length, seconds.
        threshold: the threshold crossed, percent of ``limit``.
        used: tokens in the window after the charge.
        limit: the window's limit in tokens.
    """

    window_s: float
    threshold: int
    used: int
    limit: int


@dataclass(frozen=True)
class SpendEvent:
    """One charge in the ledger (the audit trail).

    Attributes:
        request_id: the request's id.
        cost: tokens currently charged (after any settle).
        route: the route recorded with the charge ('' when none was given).
        at_ms: when the charge was made, ms since the epoch on the ledger's clock.
        nonce: the nonce of the reservation that made the charge (what ``refund`` and
            ``settle`` name; an operator's support refund reads it here).
        draws: how much of ``cost`` came from which grant, (reference, tokens) in draw
            order (entitlements on; empty when nothing was drawn).
    """

    request_id: str
    cost: int
    route: str
    at_ms: int
    nonce: str = ""
    draws: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Usage:
    """A user's current spend.

    Attributes:
        windows: every window of the plan used, shortest first (with entitlements on, the
            quota window, the longest, counts only what grants did not cover).
        events: the most recent charges still in the log, most recent first.
        now_ms: the ledger's clock for this call.
        plan_name: the plan used: the operator's override when it names a plan of the
            catalog, else the one asked about ('' when none was named).
        loaded: the user's entitlements are loaded (always False when off).
        epoch: their load epoch (0 when not loaded).
        suspended_until_ms: end of a suspension in force, ms (0 = until lifted); None when
            not suspended.
        grants: the live grants, in draw order.
        last_charge: (ms, plan name) of the user's last charge as the ledger recorded it
            (entitlements on); None when unknown (none yet, or the cache lost it).
    """

    windows: tuple[WindowUsage, ...]
    events: tuple[SpendEvent, ...]
    now_ms: int
    plan_name: str = ""
    loaded: bool = False
    epoch: int = 0
    suspended_until_ms: int | None = None
    grants: tuple[LiveGrant, ...] = ()
    last_charge: tuple[int, str] | None = None


class TokenBudget:
    """Token budgets of every user, checked and recorded atomically in Redis.

    Args:
        redis: a ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``, with
            its own timeouts and retry policy.
        windows: the default plan; each call may pass its own (plans differ per user).
        key_margin_s: how long every key outlives the longest window at least, seconds
            (renewals add up to min(longest window, 1 h) more).
        thresholds: usage thresholds whose crossing a reservation reports
            (``Reservation.crossings``); None reports none.
        catalog: the deployment's plans by name; an operator's override that names one of
            them replaces the caller's plan (entitlements on). None: no plan by name.
        entitlements: read the user's entitlements on every call (overrides, grants,
            suspensions); False costs exactly what the ledger always did.
        credit_low_percent: a grant's "low" credit report fires when its remaining falls to
            this share of its tokens or below (0..100).

    Raises:
        InvalidArgument: an empty plan, two windows of the same length, a bad margin, a
            malformed catalog or low percent.
    """

    def __init__(self, redis: AnyRedis, windows: Sequence[Window], *,
                 key_margin_s: float = DEFAULT_KEY_MARGIN_S,
                 thresholds: Thresholds | None = None,
                 catalog: Mapping[str, Sequence[Window]] | None = None,
                 entitlements: bool = False,
                 credit_low_percent: int = DEFAULT_CREDIT_LOW_PERCENT) -> None:
        if (isinstance(key_margin_s, bool) or not isinstance(key_margin_s, int | float)
                or not 0 <= key_margin_s <= MAX_WINDOW_S):
            raise InvalidArgument(f"key_margin_s must be >= 0, not {key_margin_s!r}")
        if not _is_int(credit_low_percent) or not 0 <= credit_low_percent <= 100:
            raise InvalidArgument(
                f"credit_low_percent must be an integer 0..100, not {credit_low_percent!r}")
        self.redis = redis
        self.windows = _plan(windows)
        self.key_margin_ms = round(key_margin_s * 1000)
        self._default_args = _plan_args(self.windows)
        self._thresholds = () if thresholds is None or not thresholds.percents else (
            thresholds.script_arg,)
        self._threshold_percents = tuple(thresholds.percents) if thresholds else ()
        self.entitlements = bool(entitlements)
        self.catalog: dict[str, tuple[Window, ...]] = {}
        for name, plan in (catalog or {}).items():
            if not isinstance(name, str) or not _PLAN_NAME.fullmatch(name):
                raise InvalidArgument(f"plan name {name!r} must be 1..64 of A-Z a-z 0-9 _ . -")
            self.catalog[name] = _plan(plan)
        # ";<name>=<plan>;<name>=<plan>": the scripts find ";<name>=" with one plain search
        self._catalog_arg = "".join(f";{name}={_plan_text(plan)}"
                                    for name, plan in self.catalog.items()).encode()
        margin = thresholds.margin if thresholds is not None else DEFAULT_CREDIT_MARGIN
        self._credit_args = (credit_low_percent, margin)
        self._ent_args = (credit_low_percent, margin, self._catalog_arg)
        self._ent_arg: dict[str, bytes] = {}  # ARGV[9] of the reserve script, per plan name
        self._threshold_arg = self._thresholds[0] if self._thresholds else b""
        #: the largest cost some plan could serve (the scripts check the plan used): with
        #: entitlements on credit pays beyond the quota, so only shorter windows bound it
        self._any_plan_smallest = max(
            [_plan_cap(p) for p in self.catalog.values()] + [_plan_cap(self.windows)])
        longest = max(w.ms for p in [self.windows, *self.catalog.values()] for w in p)
        #: how long ent outlives a load or invalidation by default, ms (as the other keys)
        self.ent_ttl_ms = longest + self.key_margin_ms + min(longest, 3_600_000)

    @property
    def credit_levels(self) -> tuple[int, int]:
        """(low percent, re-arming margin in points) of the credit reports."""
        low, margin = self._credit_args
        return low, margin

    async def reserve(self, user_id: str, request_id: str, cost: int, *, route: str = "",
                      windows: Sequence[Window] | None = None, plan_name: str = "",
                      now_ms: int | None = None, nonce: str | None = None,
                      hold_ms: int = 0) -> Reservation:
        """Charge ``cost`` tokens for ``request_id`` if it fits every window.

        Args:
            user_id: whose budget (any non-empty string; hashed into the key if unsafe).
            request_id: the charge's id; the same id is charged once per user.
            cost: tokens (integer >= 1).
            route: recorded with the charge for the audit trail.
            windows: this user's plan; the catalog's plan named ``plan_name``, else the
                budget's default plan, when None.
            plan_name: the name of that plan (the JWT claim's or the default), reported
                back; with entitlements on, an operator's override replaces it.
            now_ms: the caller's clock, ms since the epoch; ``time.time()`` when None.
            nonce: this call's nonce (``new_nonce()`` when None). A caller that may have to
                refund a charge whose reply it never got draws it first and keeps it.
            hold_ms: > 0: the charge is provisional: unless ``hold`` confirms it, any
                request of the user may undo it from ``hold_ms`` after now on (0: it is
                not, and no earlier provisional charge of the id can claim it).

        Returns:
            A ``Reservation``; ``allowed`` is False when any window lacks room (nothing is
            charged then), and for ``status`` ``suspended`` or ``not_loaded``. ``nonce``
            is this call's; ``draws`` what it took from grants (a re-send reports the
            first run's draws and draws nothing).

        Raises:
            InvalidArgument: a malformed argument (checked before Redis is touched).
            CostExceedsLimit: ``cost`` is larger than a window's limit and can never fit
                (with entitlements on, of the plan the script used).
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        if windows is None and not plan_name:
            plan = self.windows  # the common call: nothing to look up or check
        else:
            plan = self._caller_plan(windows, plan_name)
        nonce = new_nonce() if nonce is None else _check_nonce(nonce)
        keys, args = self._reserve_call(user_id, request_id, cost, route, plan, now_ms, nonce,
                                        plan_name, hold_ms)
        reply = await script("budget_reserve")(self.redis, keys, args)
        if not self.entitlements:
            return _decode_reservation(reply, cost, plan, nonce, plan_name=plan_name)
        return _decode_reservation(reply, cost, plan, nonce, plan_name=plan_name,
                                   catalog=self.catalog)

    def _caller_plan(self, windows: Sequence[Window] | None, plan_name: str) -> tuple[Window, ...]:
        if plan_name not in self.catalog and plan_name != "" and (
                not isinstance(plan_name, str) or not _PLAN_NAME.fullmatch(plan_name)):
            raise InvalidArgument(f"plan_name {plan_name!r} must be 1..64 of A-Z a-z 0-9 _ . -")
        if windows is not None:
            return _plan(windows)
        return self.catalog.get(plan_name, self.windows)

    def _plan_used(self, name: str, caller: tuple[Window, ...]) -> tuple[Window, ...]:
        """The windows of the plan a script reports it used (the caller's unless overridden)."""
        return self.catalog.get(name, caller)

    async def refund(self, user_id: str, request_id: str, *, nonce: str,
                     now_ms: int | None = None, uncross: Sequence[Crossing] = ()) -> bool:
        """Give back the whole charge that the reservation with ``nonce`` made for ``request_id``.

        Each window that still counts the charge gets its tokens back; a window the charge
        has already left gives nothing back. A charge of the same id made by another call
        (another nonce) is left alone. With entitlements on, the ledger's own draw record
        says what credit goes back to the copy (``lower(credit="drawn")``): the request
        path, whose draws the record of truth holds, lowers through
        ``EntitlementCache.lower`` instead.

        Args:
            nonce: the ``Reservation.nonce`` (or the nonce passed to ``reserve``) of the call
                that made the charge.
            now_ms: the caller's clock (entitlements on: a grant expired by then gets no
                credit back); ``time.time()`` when None.
            uncross: usage-threshold crossings of this charge never reported (``lower``).

        Returns:
            True when a charge was removed; False when there was none of this caller
            (already refunded, unknown or expired id, or another call's charge). A repeated
            refund returns False.

        Raises:
            InvalidArgument: a malformed user or request id or nonce.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        return (await self.lower(user_id, request_id, 0, nonce=nonce, now_ms=now_ms,
                                 credit="drawn", uncross=uncross)).changed

    async def settle(self, user_id: str, request_id: str, actual_cost: int, *,
                     nonce: str, now_ms: int | None = None) -> bool:
        """Lower the charge that the reservation with ``nonce`` made to ``actual_cost``.

        Never raises a charge, and never touches another call's charge of the same id.

        Args:
            actual_cost: tokens really used (integer >= 0); 0 removes the charge.
            nonce: the nonce of the reservation that made the charge.
            now_ms: the caller's clock; ``time.time()`` when None.

        Returns:
            True when the charge was lowered (or removed); False when there was no charge
            of this caller or ``actual_cost`` is not below it. Settling twice to the same
            cost returns False the second time.

        Raises:
            InvalidArgument: a malformed argument.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        lowered = await self.lower(user_id, request_id, actual_cost, nonce=nonce, now_ms=now_ms,
                                   credit="drawn")
        return lowered.changed

    async def lower(self, user_id: str, request_id: str, new_cost: int, *, nonce: str,
                    now_ms: int | None = None,
                    credit: Sequence[tuple[str, int]] | Literal["drawn"] = "drawn",
                    uncross: Sequence[Crossing] = ()) -> Lowered:
        """Lower the charge that the reservation with ``nonce`` made to ``new_cost``.

        What ``refund`` (``new_cost`` 0) and ``settle`` do. With entitlements on, the drawn
        part of the charge is lowered first (``min(lowered by, drawn)``, in reverse draw
        order, as ``entitlements.charges.split_return`` computes it), and ``credit`` goes
        back to the copy's grants: what the record of truth gave back (or, for a draw it
        never recorded, the draw itself). The copy gets it only when it is the one the
        charge drew from and each grant is still in it and not expired at ``now_ms``;
        else it gets none of it (``Lowered.stale``). A re-sent call changes nothing more.

        Args:
            new_cost: tokens really used (integer >= 0); 0 removes the charge.
            nonce: the nonce of the reservation that made the charge.
            now_ms: the caller's clock, ms since the epoch; ``time.time()`` when None.
            credit: (grant reference, tokens) to give back to the copy (entitlements on);
                ``"drawn"`` (the default, the ledger alone): the drawn part the lowering
                takes off the charge, as the ledger's own draw record says.
            uncross: the usage-threshold crossings this very charge made and that were never
                reported (its draw could not be recorded): each window's level goes back to
                what it was before, so the next charge that crosses reports it.

        Returns:
            A ``Lowered``: ``changed`` as ``settle`` returns it, the credit ``returned`` to
            the copy, the entitlements ``epoch`` and whether the copy was ``stale``.

        Raises:
            InvalidArgument: a malformed argument.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        _check_request_id(request_id)
        if not _is_int(new_cost) or not 0 <= new_cost <= MAX_TOKENS:
            raise InvalidArgument(f"actual_cost must be an integer >= 0, not {new_cost!r}")
        args: list[Any] = [request_id, new_cost, _check_nonce(nonce)]
        if not self.entitlements:
            keys = _user_keys(user_id)
            if now_ms is not None:
                _now_ms(now_ms)
            if uncross:
                args += [0, 0, 0, "", self._restore_arg(uncross)]
            return Lowered(int(await script("budget_refund")(self.redis, keys, args)) == 1)
        if credit == "drawn":
            credit_arg = "*"
        else:
            for reference, tokens in credit:
                if not isinstance(reference, str) or not _REFERENCE.fullmatch(reference) \
                        or not _is_int(tokens) or tokens <= 0:
                    raise InvalidArgument(f"credit must be (reference, tokens > 0) pairs, "
                                          f"not {(reference, tokens)!r}")
            credit_arg = " ".join(f"{r}={n}" for r, n in credit)
        keys = _user_keys(user_id, entitlements=True)
        args += [_now_ms(now_ms), *self._credit_args, credit_arg, self._restore_arg(uncross)]
        reply = await script("budget_refund")(self.redis, keys, args)
        flat = reply[2]
        returned = tuple((_text(flat[i]), int(flat[i + 1])) for i in range(0, len(flat) - 1, 2))
        return Lowered(int(reply[0]) == 1, returned, int(reply[1]) if returned else 0,
                       int(reply[3]) == 1)

    async def hold(self, user_id: str, request_id: str = "", *, nonce: str = "",
                   now_ms: int | None = None, claim: int = HOLD_CLAIM) -> Held:
        """Confirm a provisional charge, and claim the user's expired ones to refund.

        A request that reserved with ``hold_ms`` confirms its charge here when it succeeds,
        before its answer goes out (``budget_hold.lua``). Expired charges of the user that
        were never confirmed are claimed: their own requests can no longer confirm them,
        and the caller refunds each with its nonce (``Claimed``).

        Args:
            request_id: the charge to confirm ('' : only claim).
            nonce: the nonce of the reservation that made it.
            now_ms: the caller's clock; ``time.time()`` when None.
            claim: claim at most this many expired charges (0: none).

        Returns:
            A ``Held``.

        Raises:
            InvalidArgument: a malformed argument.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        if request_id:
            _check_request_id(request_id)
            _check_nonce(nonce)
        if not _is_int(claim) or not 0 <= claim <= 100:
            raise InvalidArgument(f"claim must be an integer 0..100, not {claim!r}")
        keys = _user_keys(user_id, *(("ev", "pv", "dr") if self.entitlements else ("ev", "pv")))
        reply = await script("budget_hold")(self.redis, keys,
                                            [_now_ms(now_ms), request_id, nonce, claim])
        flag = int(reply[0])
        claimed = tuple(Claimed(_text(reply[i]), _text(reply[i + 1]), int(reply[i + 2]),
                                int(reply[i + 3]) == 1) for i in range(1, len(reply) - 3, 4))
        return Held(None if flag < 0 else flag == 1, claimed)

    def _restore_arg(self, crossings: Sequence[Crossing]) -> str:
        """budget_refund.lua's ``uncross``: per window, the level before its lowest crossing
        (the threshold below it, else 0)."""
        lowest: dict[int, int] = {}
        for c in crossings:
            w = round(c.window_s * 1000)
            lowest[w] = min(lowest.get(w, c.threshold), c.threshold)
        below = {w: max((p for p in self._threshold_percents if p < t), default=0)
                 for w, t in lowest.items()}
        return " ".join(f"{w}={level}" for w, level in below.items())

    async def charge(self, user_id: str, request_id: str) -> SpendEvent | None:
        """One charge still counted by a window, by its request id (however old); None
        when there is none.

        Raises:
            InvalidArgument: a malformed id.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        _check_request_id(request_id)
        keys = _user_keys(user_id, *(("log", "ev", "meta", "dr") if self.entitlements
                                     else _LEDGER_KEYS))
        reply = await script("budget_charge")(self.redis, keys, [request_id])
        if not reply:
            return None
        cost, nonce, route = (_text(reply[1]).split(" ", 2) + ["", ""])[:3]
        return SpendEvent(request_id=request_id, cost=int(cost), route=route,
                          at_ms=int(float(_text(reply[0]))), nonce=nonce,
                          draws=_draws_record(reply[2]))

    async def rebase_draw(self, user_id: str, request_id: str, *, nonce: str,
                          now_ms: int | None = None,
                          reported: Mapping[str, str] | None = None) -> tuple[int, int]:
        """Take the charge's draws from the user's current copy, when a load replaced the
        one it drew from (budget_draw_rebase.lua).

        Returns:
            (status, epoch): 1 moved (or already on the current copy), 0 not loaded, -1 no
            such charge of this nonce, -2 the copy lacks the credit (nothing changed); the
            copy's epoch.

        Raises:
            InvalidArgument: a malformed argument.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        _check_request_id(request_id)
        keys = _user_keys(user_id, "ev", "ent", "dr")
        flags = " ".join(f"{r}={f}" for r, f in (reported or {}).items() if f)
        reply = await script("budget_draw_rebase")(
            self.redis, keys, [request_id, _check_nonce(nonce), _now_ms(now_ms), flags])
        return int(reply[0]), int(reply[1])

    async def usage(self, user_id: str, *, windows: Sequence[Window] | None = None,
                    plan_name: str = "", now_ms: int | None = None,
                    events: int = DEFAULT_EVENTS) -> Usage:
        """The user's spend in every window and the most recent charges.

        Args:
            windows: the user's plan; the catalog's plan named ``plan_name``, else the
                budget's default plan, when None.
            plan_name: that plan's name; with entitlements on an override replaces it.
            now_ms: the caller's clock, ms since the epoch; ``time.time()`` when None.
            events: how many recent charges to return (0..1000).

        Raises:
            InvalidArgument: a malformed argument.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        plan = self._caller_plan(windows, plan_name)
        keys = _user_keys(user_id, entitlements=self.entitlements)
        now = _now_ms(now_ms)
        if not _is_int(events) or not 0 <= events <= MAX_EVENTS:
            raise InvalidArgument(f"events must be an integer in 0..{MAX_EVENTS}, not {events!r}")
        args: list[Any] = [now, events, self.key_margin_ms]
        if not self.entitlements:
            args += [w.ms for w in plan]
            reply = await script("budget_usage")(self.redis, keys, args)
            return _decode_usage(reply, plan, plan_name=plan_name)
        args += [plan_name, self._catalog_arg, *(w.ms for w in plan)]
        reply = await script("budget_usage")(self.redis, keys, args)
        return _decode_usage(reply, self._plan_used(_text(reply[1][0]), plan), entitled=True)

    async def load_entitlements(self, user_id: str, *, epoch: int, plan: str | None,
                                suspended_until_ms: int | None, grants: Sequence[LiveGrant],
                                ttl_s: float | None = None, marked: bool = False) -> bool:
        """Write the user's entitlements (ent) as loaded from the record of truth at ``epoch``.

        Writes only when ent holds no epoch and ``epoch`` is at least the one an
        invalidation asked for, or when ent holds a smaller epoch (the whole of ent is then
        replaced; a grant whose remaining did not change keeps its credit-report flags).
        ent already at ``epoch`` is left alone and counts as loaded: running it twice is
        harmless.

        Args:
            epoch: the load epoch (integer >= 1), from the record of truth's counter.
            plan: the operator's plan override (a plan name), None for none.
            suspended_until_ms: end of a suspension, ms (0 = until lifted); None for none.
            grants: the live (not voided) grants, remaining = tokens - consumed.
            ttl_s: how long ent lives without calls, seconds; as the ledger's keys when None.
            marked: the loader marked ent (``mark_entitlements``) before it took ``epoch``:
                write only into an ent that still exists (one gone was lost with the cache
                while the load ran, and any invalidation with it).

        Returns:
            True when ent now holds ``epoch``; False when it was refused as stale (ent
            holds, or an invalidation wants, a newer epoch; or, marked, ent is gone): load
            again.

        Raises:
            InvalidArgument: a malformed argument (nothing is written).
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        if not _is_int(epoch) or not 1 <= epoch < 2**52:
            raise InvalidArgument(f"epoch must be an integer >= 1, not {epoch!r}")
        if plan is not None and (not isinstance(plan, str) or not _PLAN_NAME.fullmatch(plan)):
            raise InvalidArgument(f"plan {plan!r} must be 1..64 of A-Z a-z 0-9 _ . -")
        if suspended_until_ms is not None and (not _is_int(suspended_until_ms)
                                               or not 0 <= suspended_until_ms < 2**52):
            raise InvalidArgument("suspended_until_ms must be ms since the epoch (0 = until "
                                  f"lifted), not {suspended_until_ms!r}")
        if isinstance(grants, LiveGrant) or not all(isinstance(g, LiveGrant) for g in grants):
            raise InvalidArgument("grants must be a sequence of LiveGrant")
        if len({g.reference for g in grants}) != len(grants):
            raise InvalidArgument("two grants have the same reference")
        lines = "\n".join(f"{g.reference} {g.remaining} {g.expires_at_ms or 0} {g.kind} "
                          f"{g.created_ms} {g.tokens}" + (f" {g.reported}" if g.reported else "")
                          for g in grants)
        args = [epoch, self._ttl_ms(ttl_s), plan or "",
                "" if suspended_until_ms is None else suspended_until_ms, lines,
                "1" if marked else ""]
        reply = await script("budget_ent_load")(self.redis, _user_keys(user_id, "ent"), args)
        return int(reply[0]) == 1

    async def mark_entitlements(self, user_id: str, *, ttl_s: float | None = None) -> bool:
        """Mark the user's ent before a load begins (budget_ent_mark.lua): a marked load
        is refused when the cache lost ent meanwhile.

        Returns:
            True when the mark was made now; False when ent existed (a copy, a marker).

        Raises:
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        reply = await script("budget_ent_mark")(self.redis, _user_keys(user_id, "ent"),
                                                [self._ttl_ms(ttl_s)])
        return int(reply) == 1

    async def invalidate_entitlements(self, user_id: str, *, epoch: int,
                                      ttl_s: float | None = None) -> None:
        """Mark the user's entitlements stale after a change recorded at ``epoch``.

        ent becomes ``{want: epoch}`` (reservations answer ``not_loaded`` until a load of at
        least ``epoch``) unless it already holds that epoch or a newer one. Idempotent.

        Args:
            epoch: the record of truth's epoch after the change (integer >= 1).
            ttl_s: how long the marker lives, seconds; as the ledger's keys when None.

        Raises:
            InvalidArgument: a malformed argument.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        if not _is_int(epoch) or not 1 <= epoch < 2**52:
            raise InvalidArgument(f"epoch must be an integer >= 1, not {epoch!r}")
        await script("budget_ent_invalidate")(self.redis, _user_keys(user_id, "ent"),
                                              [epoch, self._ttl_ms(ttl_s)])

    def _ttl_ms(self, ttl_s: float | None) -> int:
        if ttl_s is None:
            return self.ent_ttl_ms
        if (isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float)
                or not 0.001 <= ttl_s <= 2 * MAX_WINDOW_S):
            raise InvalidArgument(f"ttl_s must be at least 0.001 s, not {ttl_s!r}")
        return max(1, round(ttl_s * 1000))

    def _reserve_call(self, user_id: str, request_id: str, cost: int, route: str,
                      plan: tuple[Window, ...], now_ms: int | None,
                      nonce: str, plan_name: str = "",
                      hold_ms: int = 0) -> tuple[list[str], list[Any]]:
        """Validate a reservation and build the script's keys and arguments.

        Benchmarks and tests use this to pipeline many reservations through the real script.
        """
        keys = _user_keys(user_id, *(_ENTITLED_KEYS if self.entitlements else ()))
        if not _is_int(hold_ms) or not 0 <= hold_ms <= MAX_HOLD_MS:
            raise InvalidArgument(f"hold_ms must be an integer 0..{MAX_HOLD_MS}, not {hold_ms!r}")
        keys = [*keys, *_user_keys(user_id, "pv")]  # a new charge always sets its pv entry
        _check_request_id(request_id)
        if not _is_int(cost) or not 1 <= cost <= MAX_TOKENS:
            raise InvalidArgument(f"cost must be an integer >= 1, not {cost!r}")
        if not isinstance(route, str) or len(route) > MAX_ID_LENGTH or not route.isprintable():
            raise InvalidArgument("route must be a printable string of at most 256 characters")
        now = _now_ms(now_ms)
        smallest, tail = self._default_args if plan is self.windows else _plan_args(plan)
        # with entitlements on an override may change the plan: the script checks the plan
        # it uses, and only a cost no plan could admit is refused here
        cap = smallest
        if self.entitlements:  # credit pays beyond the quota: shorter windows bound it
            cap = self._any_plan_smallest if plan is self.windows else max(
                self._any_plan_smallest, _plan_cap(plan))
        if cost > cap:
            w = next(w for w in plan if cost > w.limit)
            raise CostExceedsLimit(
                f"cost {cost} exceeds the limit {w.limit} of the {w.seconds:g} s window",
                cost=cost, limit=w.limit, window_s=float(w.seconds))
        numbers = (struct.pack("<4d", now, cost, self.key_margin_ms, hold_ms) if hold_ms
                   else struct.pack("<3d", now, cost, self.key_margin_ms))
        record = f"{cost} {nonce} {route}"
        if not self.entitlements:
            return keys, [numbers, request_id, record, *tail, *self._thresholds]
        entitled = self._ent_arg.get(plan_name)
        if entitled is None:
            if len(self._ent_arg) >= 64:  # plan names come from the catalog or a claim
                self._ent_arg.clear()
            low, margin, catalog = self._ent_args
            entitled = self._ent_arg[plan_name] = (
                f"{plan_name} {low} {margin} ".encode() + catalog)
        return keys, [numbers, request_id, record, *tail, self._threshold_arg, entitled]


def new_nonce() -> str:
    """A fresh random nonce for one reservation (hex, no spaces)."""
    return secrets.token_hex(NONCE_BYTES)


def _check_nonce(nonce: str) -> str:
    # printable ASCII without spaces ("!" to "~"), checked by str's own C loops
    if (not isinstance(nonce, str) or not 0 < len(nonce) <= MAX_NONCE_LENGTH
            or not nonce.isascii() or not nonce.isprintable() or " " in nonce):
        raise InvalidArgument(
            f"nonce must be 1..{MAX_NONCE_LENGTH} printable ASCII characters without spaces")
    return nonce


def _plan(windows: Sequence[Window]) -> tuple[Window, ...]:
    """The windows sorted shortest first, after checking them."""
    if isinstance(windows, Window) or not isinstance(windows, Sequence | set | frozenset):
        raise InvalidArgument("windows must be a sequence of Window")
    plan = tuple(sorted(windows, key=lambda w: w.ms if isinstance(w, Window) else 0))
    if not plan:
        raise InvalidArgument("a plan needs at least one window")
    if not all(isinstance(w, Window) for w in plan):
        raise InvalidArgument("windows must be Window instances")
    if len({w.ms for w in plan}) != len(plan):
        raise InvalidArgument("two windows of a plan have the same length")
    return plan


@lru_cache(maxsize=64)
def _plan_args(plan: tuple[Window, ...]) -> tuple[int, tuple[bytes]]:
    """The plan's smallest limit and its one argument of the reserve script (per window its
    length in ms and its limit, little-endian doubles), encoded once."""
    encoded = struct.pack(f"<{2 * len(plan)}d", *(v for w in plan for v in (w.ms, w.limit)))
    return min(w.limit for w in plan), (encoded,)


def _plan_cap(plan: tuple[Window, ...]) -> int:
    """The largest cost the plan can serve with credit: its shorter windows' smallest
    limit (credit pays beyond the quota, the longest window), or MAX_TOKENS."""
    return min((w.limit for w in plan[:-1]), default=MAX_TOKENS)


def _plan_text(plan: tuple[Window, ...]) -> str:
    """The plan as the catalog names it: "<window_ms>:<limit> ...", shortest first."""
    return " ".join(f"{w.ms}:{w.limit}" for w in plan)


@lru_cache(maxsize=1024)
def _key_names(user_id: str, parts: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(user_keys(user_id, *parts))


_LEDGER_KEYS = ("log", "ev", "meta")
_ENTITLED_KEYS = ("log", "ev", "meta", "ent", "dr")


def _user_keys(user_id: str, *only: str, entitlements: bool = False) -> list[str]:
    """The user's ledger keys (with ent and dr when ``entitlements``), or ``only`` those."""
    if not isinstance(user_id, str) or not user_id:
        raise InvalidArgument("user_id must be a non-empty string")
    parts = only or (_ENTITLED_KEYS if entitlements else _LEDGER_KEYS)
    return list(_key_names(user_id, parts))


def _check_request_id(request_id: str) -> None:
    if (not isinstance(request_id, str) or not request_id or len(request_id) > MAX_ID_LENGTH
            or not request_id.isprintable()):
        raise InvalidArgument("request_id must be a printable string of 1..256 characters")


def _now_ms(now_ms: int | None) -> int:
    if now_ms is None:
        return int(time.time() * 1000)
    if not _is_int(now_ms) or not 0 <= now_ms < 2**52:
        raise InvalidArgument(f"now_ms must be a non-negative integer, not {now_ms!r}")
    return now_ms


# budget_reserve.lua's status codes
_REJECTED, _CHARGED, _DUPLICATE, _SUSPENDED, _NOT_LOADED, _TOO_BIG = 0, 1, 2, 3, 4, 5
_STATUS: dict[int, Status] = {_REJECTED: "rejected", _CHARGED: "charged",
                              _DUPLICATE: "duplicate", _SUSPENDED: "suspended",
                              _NOT_LOADED: "not_loaded"}


def meta_fields(packed: bytes) -> dict[str, int]:
    """A user's meta record (field ``m`` of the meta hash) as named integers.

    ``clk`` (the key's clock, ms) and ``dead`` (events out of every window, not yet
    deleted), then per window of ``W`` ms: ``t:W`` (tokens counted), ``lo:W`` (cursor, ms),
    ``f:W`` (first counted event, ms; -1 none, -2 unknown), ``d:W`` (tokens drawn from
    grants) and ``n:W`` (highest usage threshold reported, percent). The record is
    little-endian doubles (``lua/_budget_meta.lua``). For checks and tools; the scripts read
    it themselves.

    Raises:
        ValueError: ``packed`` is not a meta record.
    """
    if not isinstance(packed, bytes) or len(packed) < 16 or (len(packed) - 16) % 48:
        raise ValueError(f"not a meta record: {packed!r}")
    values = [int(v) for v in struct.unpack(f"<{len(packed) // 8}d", packed)]
    out = {"clk": values[0], "dead": values[1]}
    for i in range(2, len(values), 6):
        w = values[i]
        for name, value in zip(("t", "lo", "f", "d", "n"), values[i + 1:i + 6], strict=True):
            out[f"{name}:{w}"] = value
    return out


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _resets(value: Any) -> int | None:
    """A script's resets_at_ms: -1 means the window holds no charge."""
    at = int(value)
    return None if at < 0 else at


def _window(w: Window, used: int, resets_at_ms: int | None) -> WindowUsage:
    return WindowUsage(limit=w.limit, used=used, remaining=max(0, w.limit - used),
                       window_s=float(w.seconds), resets_at_ms=resets_at_ms)


def _draw_items(text: str) -> tuple[tuple[str, int], ...]:
    """``"<ref>=<n> <ref>=<n>"`` as ((ref, n), ...); a reference may hold ``=`` itself."""
    out = []
    for item in text.split(" "):
        ref, _, n = item.rpartition("=")
        out.append((ref, int(n)))
    return tuple(out)


def _draws_record(record: Any) -> tuple[tuple[str, int], ...]:
    """The draws of a dr record ``"#<epoch> <ref>=<n> ..."`` (none for a missing one)."""
    if not record:
        return ()
    parts = _text(record).split(" ", 1)
    return _draw_items(parts[1]) if len(parts) > 1 else ()


def _credit_crossing(item: str) -> CreditCrossing:
    """One ``"<kind> <remaining> <tokens> <grant kind> <ref>"`` of the reserve script's ent
    string."""
    kind, left, tokens, grant_kind, ref = item.split(" ", 4)
    return CreditCrossing(ref, kind, int(left), int(tokens), grant_kind)  # type: ignore[arg-type]


def _decode_reservation(reply: list[Any], cost: int, plan: tuple[Window, ...],
                        nonce: str, *, plan_name: str = "",
                        catalog: Mapping[str, tuple[Window, ...]] | None = None) -> Reservation:
    """A ``Reservation`` from the reply of budget_reserve.lua (see its header).

    ``plan`` is the caller's; with entitlements on, the plan the script names is looked up
    in ``catalog`` (an override).

    Raises:
        CostExceedsLimit: the script found the cost above a window of the plan it used.
    """
    status = int(reply[0])
    ent = _text(reply[3]) if len(reply) > 3 and isinstance(reply[3], (bytes, str)) else None
    first = 4 if ent is not None else 3
    if ent is not None:
        head, draws, events = ent.split("|")
        epoch, drawn, credit, susp, plan_name = head.split(" ", 4)
        plan = (catalog or {}).get(plan_name, plan)
        if status == _TOO_BIG:
            at = int(reply[2])
            w = plan[at - 1]
            quota = at == len(plan)  # credit could pay beyond it, but is short
            raise CostExceedsLimit(
                f"cost {cost} exceeds the limit {w.limit} of the {w.seconds:g} s window"
                + (f" and the credit {credit} is short of {cost - w.limit}" if quota else ""),
                cost=cost, limit=w.limit, credit=int(credit) if quota else None,
                window_s=float(w.seconds))
    counted = status in (_REJECTED, _CHARGED, _DUPLICATE)
    states = []
    least, tightest = -1, plan[0]  # when allowed, the window with least room binds
    for i, w in enumerate(plan if counted else ()):
        limit, used = w.limit, int(reply[first + 2 * i])
        left = limit - used if used < limit else 0
        states.append(_made(WindowUsage, {
            "limit": limit, "used": used, "remaining": left, "window_s": float(w.seconds),
            "resets_at_ms": _resets(reply[first + 1 + 2 * i])}))
        if least < 0 or left < least:
            least, tightest = left, w
    bind = plan[int(reply[2]) - 1] if status == _REJECTED else tightest
    extra = reply[first + 2 * len(states):]  # thresholds crossed: window position, percent
    crossings = tuple(Crossing(states[int(extra[i]) - 1].window_s, int(extra[i + 1]),
                               states[int(extra[i]) - 1].used, states[int(extra[i]) - 1].limit)
                      for i in range(0, len(extra) - 1, 2))
    allowed, retry_s = status in (_CHARGED, _DUPLICATE), int(reply[1]) / 1000.0
    if ent is None:
        return _made(Reservation, {
            "allowed": allowed, "remaining": max(least, 0), "retry_after_s": retry_s,
            "duplicate": status == _DUPLICATE, "cost": cost, "limit": bind.limit,
            "window_s": float(bind.seconds), "windows": tuple(states), "nonce": nonce,
            "crossings": crossings, "status": _STATUS[status], "plan_name": plan_name})
    return _made(Reservation, {
        "allowed": allowed, "remaining": max(least, 0), "retry_after_s": retry_s,
        "duplicate": status == _DUPLICATE, "cost": cost, "limit": bind.limit,
        "window_s": float(bind.seconds), "windows": tuple(states), "nonce": nonce,
        "crossings": crossings, "status": _STATUS[status], "plan_name": plan_name,
        "drawn": int(drawn), "draws": _draw_items(draws) if draws else (),
        "credit": None if credit[0] == "-" else int(credit), "epoch": int(epoch),
        "suspended_until_ms": None if susp[0] == "-" else int(susp),
        "credit_crossings": tuple(_credit_crossing(item) for item in events.split(";"))
        if events else ()})


_Result = TypeVar("_Result")
_DEFAULTS: dict[type, dict[str, Any]] = {}


def _made(cls: type[_Result], values: dict[str, Any]) -> _Result:
    """A frozen result dataclass with ``values`` (and the defaults of the fields not given).

    The hot path's results are filled in directly: a frozen dataclass's ``__init__`` sets
    every field through ``object.__setattr__``, which for a ``Reservation`` (19 fields) costs
    several µs per call. Only for dataclasses without ``__post_init__`` or slots.
    """
    defaults = _DEFAULTS.get(cls)
    if defaults is None:
        defaults = _DEFAULTS[cls] = {f.name: f.default for f in fields(cls)  # type: ignore[arg-type]
                                     if f.default is not MISSING}
    made = object.__new__(cls)
    state = made.__dict__
    state.update(defaults)
    state.update(values)
    return made


def _decode_usage(reply: list[Any], plan: tuple[Window, ...], *, plan_name: str = "",
                  entitled: bool = False) -> Usage:
    """A ``Usage`` from the reply of budget_usage.lua (see its header)."""
    now = int(reply[0])
    first = 2 if entitled else 1
    states = tuple(_window(w, int(reply[first + 2 * i]), _resets(reply[first + 1 + 2 * i]))
                   for i, w in enumerate(plan))
    events = []
    rest = reply[first + 2 * len(plan):]
    step = 4 if entitled else 3
    for i in range(0, len(rest), step):
        request_id, at_ms, record = rest[i: i + 3]
        cost, route, nonce = 0, "", ""
        if record is not None:
            parts = _text(record).split(" ", 2)
            cost = int(parts[0])
            nonce = parts[1] if len(parts) > 1 else ""
            route = parts[2] if len(parts) > 2 else ""
        draws = _draws_record(rest[i + 3]) if entitled else ()
        events.append(SpendEvent(request_id=_text(request_id), cost=cost, route=route,
                                 at_ms=int(float(_text(at_ms))), nonce=nonce, draws=draws))
    if not entitled:
        return Usage(windows=states, events=tuple(events), now_ms=now, plan_name=plan_name)
    name, epoch, susp, flat, last = reply[1]
    at, _, charged_plan = _text(last).partition(" ")
    grants = tuple(
        LiveGrant(reference=_text(flat[i]), remaining=int(flat[i + 1]),
                  tokens=int(flat[i + 2]), expires_at_ms=int(flat[i + 3]) or None,
                  kind=_text(flat[i + 4]))  # type: ignore[arg-type]
        for i in range(0, len(flat) - 4, 5))
    return Usage(windows=states, events=tuple(events), now_ms=now, plan_name=_text(name),
                 loaded=int(epoch) > 0, epoch=int(epoch),
                 suspended_until_ms=None if int(susp) < 0 else int(susp), grants=grants,
                 last_charge=(int(at), charged_plan) if at else None)
