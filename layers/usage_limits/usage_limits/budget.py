"""Per-user token budgets: a sliding-window spend ledger in Redis.

Each user has three keys sharing one hash tag (see ``keys.user_keys``):

    log   sorted set   request id -> time of the charge (ms since the epoch)
    ev    hash         request id -> "<cost> <nonce> <route>"
    meta  hash         clk (the key's clock), and per window of W ms a running total
                       t:W and a cursor lo:W (events scored <= lo:W are out of t:W)

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
- Keys outlive the longest window by at least ``key_margin_s`` after every call, and by at
  most an hour more (their expiry is renewed only when it would fall short): an idle user
  costs nothing.

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
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

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
#: Default and largest number of spend events returned by ``usage``.
DEFAULT_EVENTS = 50
MAX_EVENTS = 1000


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
    """

    request_id: str
    cost: int
    route: str
    at_ms: int
    nonce: str = ""


@dataclass(frozen=True)
class Usage:
    """A user's current spend.

    Attributes:
        windows: every window asked about, shortest first.
        events: the most recent charges still in the log, most recent first.
        now_ms: the ledger's clock for this call.
    """

    windows: tuple[WindowUsage, ...]
    events: tuple[SpendEvent, ...]
    now_ms: int


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

    Raises:
        InvalidArgument: an empty plan, two windows of the same length, or a bad margin.
    """

    def __init__(self, redis: AnyRedis, windows: Sequence[Window], *,
                 key_margin_s: float = DEFAULT_KEY_MARGIN_S,
                 thresholds: Thresholds | None = None) -> None:
        if (isinstance(key_margin_s, bool) or not isinstance(key_margin_s, int | float)
                or not 0 <= key_margin_s <= MAX_WINDOW_S):
            raise InvalidArgument(f"key_margin_s must be >= 0, not {key_margin_s!r}")
        self.redis = redis
        self.windows = _plan(windows)
        self.key_margin_ms = round(key_margin_s * 1000)
        self._default_args = _plan_args(self.windows)
        self._thresholds = () if thresholds is None or not thresholds.spec else (
            thresholds.spec,)

    async def reserve(self, user_id: str, request_id: str, cost: int, *, route: str = "",
                      windows: Sequence[Window] | None = None,
                      now_ms: int | None = None, nonce: str | None = None) -> Reservation:
        """Charge ``cost`` tokens for ``request_id`` if it fits every window.

        Args:
            user_id: whose budget (any non-empty string; hashed into the key if unsafe).
            request_id: the charge's id; the same id is charged once per user.
            cost: tokens (integer >= 1).
            route: recorded with the charge for the audit trail.
            windows: this user's plan; the budget's default plan when None.
            now_ms: the caller's clock, ms since the epoch; ``time.time()`` when None.
            nonce: this call's nonce (``new_nonce()`` when None). A caller that may have to
                refund a charge whose reply it never got draws it first and keeps it.

        Returns:
            A ``Reservation``; ``allowed`` is False when any window lacks room (nothing is
            charged then). ``nonce`` is this call's.

        Raises:
            InvalidArgument: a malformed argument (checked before Redis is touched).
            CostExceedsLimit: ``cost`` is larger than a window's limit and can never fit.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        plan = self.windows if windows is None else _plan(windows)
        nonce = new_nonce() if nonce is None else _check_nonce(nonce)
        keys, args = self._reserve_call(user_id, request_id, cost, route, plan, now_ms, nonce)
        reply = await script("budget_reserve")(self.redis, keys, args)
        return _decode_reservation(reply, cost, plan, nonce)

    async def refund(self, user_id: str, request_id: str, *, nonce: str) -> bool:
        """Give back the whole charge that the reservation with ``nonce`` made for ``request_id``.

        Each window that still counts the charge gets its tokens back; a window the charge
        has already left gives nothing back. A charge of the same id made by another call
        (another nonce) is left alone.

        Args:
            nonce: the ``Reservation.nonce`` (or the nonce passed to ``reserve``) of the call
                that made the charge.

        Returns:
            True when a charge was removed; False when there was none of this caller
            (already refunded, unknown or expired id, or another call's charge). A repeated
            refund returns False.

        Raises:
            InvalidArgument: a malformed user or request id or nonce.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        keys = _user_keys(user_id)
        _check_request_id(request_id)
        args = [request_id, 0, _check_nonce(nonce)]
        return int(await script("budget_refund")(self.redis, keys, args)) == 1

    async def settle(self, user_id: str, request_id: str, actual_cost: int, *,
                     nonce: str) -> bool:
        """Lower the charge that the reservation with ``nonce`` made to ``actual_cost``.

        Never raises a charge, and never touches another call's charge of the same id.

        Args:
            actual_cost: tokens really used (integer >= 0); 0 removes the charge.
            nonce: the nonce of the reservation that made the charge.

        Returns:
            True when the charge was lowered (or removed); False when there was no charge
            of this caller or ``actual_cost`` is not below it. Settling twice to the same
            cost returns False the second time.

        Raises:
            InvalidArgument: a malformed argument.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        keys = _user_keys(user_id)
        _check_request_id(request_id)
        if not _is_int(actual_cost) or not 0 <= actual_cost <= MAX_TOKENS:
            raise InvalidArgument(f"actual_cost must be an integer >= 0, not {actual_cost!r}")
        args = [request_id, actual_cost, _check_nonce(nonce)]
        return int(await script("budget_refund")(self.redis, keys, args)) == 1

    async def usage(self, user_id: str, *, windows: Sequence[Window] | None = None,
                    now_ms: int | None = None, events: int = DEFAULT_EVENTS) -> Usage:
        """The user's spend in every window and the most recent charges.

        Args:
            windows: the user's plan; the budget's default plan when None.
            now_ms: the caller's clock, ms since the epoch; ``time.time()`` when None.
            events: how many recent charges to return (0..1000).

        Raises:
            InvalidArgument: a malformed argument.
            LimiterUnavailable: Redis could not be reached or did not answer in time.
        """
        plan = self.windows if windows is None else _plan(windows)
        keys = _user_keys(user_id)
        now = _now_ms(now_ms)
        if not _is_int(events) or not 0 <= events <= MAX_EVENTS:
            raise InvalidArgument(f"events must be an integer in 0..{MAX_EVENTS}, not {events!r}")
        args = [now, events, self.key_margin_ms, *(w.ms for w in plan)]
        reply = await script("budget_usage")(self.redis, keys, args)
        return _decode_usage(reply, plan)

    def _reserve_call(self, user_id: str, request_id: str, cost: int, route: str,
                      plan: tuple[Window, ...], now_ms: int | None,
                      nonce: str) -> tuple[list[str], list[Any]]:
        """Validate a reservation and build the script's keys and arguments.

        Benchmarks and tests use this to pipeline many reservations through the real script.
        """
        keys = _user_keys(user_id)
        _check_request_id(request_id)
        if not _is_int(cost) or not 1 <= cost <= MAX_TOKENS:
            raise InvalidArgument(f"cost must be an integer >= 1, not {cost!r}")
        if not isinstance(route, str) or len(route) > MAX_ID_LENGTH or not route.isprintable():
            raise InvalidArgument("route must be a printable string of at most 256 characters")
        now = _now_ms(now_ms)
        smallest, tail = self._default_args if plan is self.windows else _plan_args(plan)
        if cost > smallest:
            w = next(w for w in plan if cost > w.limit)
            raise CostExceedsLimit(
                f"cost {cost} exceeds the limit {w.limit} of the {w.seconds:g} s window",
                cost=cost, limit=w.limit)
        return keys, [now, request_id, cost, nonce, route, self.key_margin_ms, *tail,
                      *self._thresholds]


def new_nonce() -> str:
    """A fresh random nonce for one reservation (hex, no spaces)."""
    return secrets.token_hex(NONCE_BYTES)


def _check_nonce(nonce: str) -> str:
    if (not isinstance(nonce, str) or not 0 < len(nonce) <= MAX_NONCE_LENGTH
            or not all("!" <= c <= "~" for c in nonce)):
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
    """The plan's smallest limit and its one "<window_ms>:<limit> ..." argument of the reserve
    script, encoded once."""
    encoded = " ".join(f"{w.ms}:{w.limit}" for w in plan).encode()
    return min(w.limit for w in plan), (encoded,)


@lru_cache(maxsize=1024)
def _key_names(user_id: str) -> tuple[str, ...]:
    return tuple(user_keys(user_id, "log", "ev", "meta"))


def _user_keys(user_id: str) -> list[str]:
    if not isinstance(user_id, str) or not user_id:
        raise InvalidArgument("user_id must be a non-empty string")
    return list(_key_names(user_id))


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
_REJECTED, _CHARGED, _DUPLICATE = 0, 1, 2


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _resets(value: Any) -> int | None:
    """A script's resets_at_ms: -1 means the window holds no charge."""
    at = int(value)
    return None if at < 0 else at


def _window(w: Window, used: int, resets_at_ms: int | None) -> WindowUsage:
    return WindowUsage(limit=w.limit, used=used, remaining=max(0, w.limit - used),
                       window_s=float(w.seconds), resets_at_ms=resets_at_ms)


def _decode_reservation(reply: list[Any], cost: int, plan: tuple[Window, ...],
                        nonce: str) -> Reservation:
    """A ``Reservation`` from the reply of budget_reserve.lua (see its header)."""
    status = int(reply[0])
    states = []
    least, tightest = -1, plan[0]  # when allowed, the window with least room binds
    for i, w in enumerate(plan):
        limit, used = w.limit, int(reply[3 + 2 * i])
        left = limit - used if used < limit else 0
        states.append(WindowUsage(limit, used, left, float(w.seconds), _resets(reply[4 + 2 * i])))
        if least < 0 or left < least:
            least, tightest = left, w
    bind = plan[int(reply[2]) - 1] if status == _REJECTED else tightest
    extra = reply[3 + 2 * len(plan):]  # thresholds crossed: window position, percent
    crossings = tuple(Crossing(states[int(extra[i]) - 1].window_s, int(extra[i + 1]),
                               states[int(extra[i]) - 1].used, states[int(extra[i]) - 1].limit)
                      for i in range(0, len(extra) - 1, 2))
    return Reservation(status != _REJECTED, least, int(reply[1]) / 1000.0,
                       status == _DUPLICATE, cost, bind.limit, float(bind.seconds),
                       tuple(states), nonce, crossings)


def _decode_usage(reply: list[Any], plan: tuple[Window, ...]) -> Usage:
    """A ``Usage`` from the reply of budget_usage.lua (see its header)."""
    now = int(reply[0])
    states = tuple(_window(w, int(reply[1 + 2 * i]), _resets(reply[2 + 2 * i]))
                   for i, w in enumerate(plan))
    events = []
    rest = reply[1 + 2 * len(plan):]
    for i in range(0, len(rest), 3):
        request_id, at_ms, record = rest[i: i + 3]
        cost, route, nonce = 0, "", ""
        if record is not None:
            parts = _text(record).split(" ", 2)
            cost = int(parts[0])
            nonce = parts[1] if len(parts) > 1 else ""
            route = parts[2] if len(parts) > 2 else ""
        events.append(SpendEvent(request_id=_text(request_id), cost=cost, route=route,
                                 at_ms=int(float(_text(at_ms))), nonce=nonce))
    return Usage(windows=states, events=tuple(events), now_ms=now)
