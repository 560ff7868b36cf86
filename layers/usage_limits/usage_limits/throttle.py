"""Distributed provider throttle: one shared rate (and in-flight cap) per upstream provider.

Every Lambda instance asks Redis for the provider's next free slot (``lua/throttle_acquire.lua``,
GCRA). While the provider is not saturated the slot is booked at once: one script call. When
it is, the request joins the provider's fair queue (start-time fair queuing: one start tag per
request from its user's finish tag, ``lua/_fair_queue.lua``), is told the slot it would get if
everyone ahead of it went first, sleeps, and asks again just before that slot
(``lua/throttle_confirm.lua``): the head of the queue books its slot, anyone else is told its
new slot ("moved": a fairer request arrived meanwhile). So the users waiting share the slots
about equally (``weight`` for a plan's share), however many requests each has in flight; a
user alone gets the whole rate. No slot is ever booked more than a few round trips ahead, so
an upstream 429's pause holds back every slot not yet booked. A request whose slot lies past
its wait limit (by default the request's deadline) gets ``ProviderBusy`` with a true
``retry_after_s``. Every script call carries an id of its own, and a call run twice (redis-py
re-sends a script whose reply was lost) answers the same and books once.
An upstream's Retry-After is bounded by ``max_pause_s`` (``<PROVIDER>_MAX_PAUSE_S``).

Example:
    >>> llm = ProviderThrottle.from_env(redis, "llm", default_rate="20/s")
    >>> async with llm.slot(cost=1, user="u1") as waited_s:   # ProviderBusy: none in time
    ...     reply = await call_upstream()
    >>> await llm.pause(30)                           # upstream said 429: every instance waits

Provider clients usually wrap their public methods with ``@throttled(...)`` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from . import deadline
from ._scripts import script
from .exceptions import CostExceedsLimit, InvalidArgument, ProviderBusy
from .keys import provider_keys

if TYPE_CHECKING:
    from ._scripts import AnyRedis
    from ._semaphore import LeaseSemaphore

__all__ = ["Admission", "ProviderThrottle", "UpstreamRateLimited", "bind_share", "parse_rate",
           "share_scope", "throttled"]

P = ParamSpec("P")
R = TypeVar("R")

#: Suffixes of the environment variables read by ``ProviderThrottle.from_env``.
ENV_RATE, ENV_BURST, ENV_CONCURRENCY = "_RATE", "_BURST", "_CONCURRENCY"
ENV_JITTER = "_JITTER_MS"
ENV_MAX_PAUSE = "_MAX_PAUSE_S"
#: Default dispatch jitter allowance, as a share of the rate's period (see ``ProviderThrottle``'s
#: ``jitter_s``): 15 ms for a per-second rate, 0.9 s for a per-minute one; 1.5% of the rate.
DEFAULT_JITTER_SHARE = 0.015
#: Re-admissions of a caller that woke too late for its slot or came back after its queue
#: entry expired, before it gives up with ProviderBusy.
MAX_READMISSIONS = 3
#: Cooldown used when an upstream 429 carried no usable Retry-After (absent, unreadable,
#: negative or not finite).
DEFAULT_PAUSE_S = 1.0
#: Longest pause an upstream's Retry-After may impose (``<PROVIDER>_MAX_PAUSE_S``), as
#: ``fetch.py`` bounds a page's; ``MAX_PAUSE_LIMIT_S`` bounds the setting itself.
DEFAULT_MAX_PAUSE_S = 60.0
MAX_PAUSE_LIMIT_S = 300.0
#: A queued caller asks again three of its round trips before the slot it was told, at least
#: 20 ms and at most 50 ms, so that its answer is back by the slot even when one round trip
#: takes longer than the last or the host stalls the caller for a few ms: the head of the
#: queue books the slot it asks for, or the clock when it asks late, and every slot after
#: it moves by as much. The same lead is the horizon: no slot is booked further ahead of
#: its caller's clock, so a pause that an upstream 429 sets holds back every slot but those
#: booked within these 20 to 50 ms (never more than half a slot interval, see _admit).
MIN_LEAD_S = 0.02
MAX_LEAD_S = 0.05
#: The shortest sleep of a queued caller between two calls (while the head has not booked;
#: at least its last round trip).
MIN_POLL_S = 0.005
#: How late after its told slot a queued caller may ask again before its entry expires
#: (a busy event loop; a caller that died leaves the queue after this): the longest a dead
#: waiter at the head of the queue holds the others back.
QUEUE_GRACE_S = 0.25
#: The user of a request that names none: such requests share one turn between them.
ANONYMOUS = "-"
#: Script answers (``lua/throttle_acquire.lua``, ``lua/throttle_confirm.lua``).
REFUSED, BOOKED, QUEUED, GONE = 0, 1, 3, 4
#: How long a script call's answer is kept for a re-send of the same call (redis-py re-sends
#: within its socket timeout and backoff; a command held up in the network arrives later).
ANSWER_TTL_S = 10.0
#: ``asyncio.sleep`` wakes up to ~1 ms late (epoll rounds its timeout up to whole ms); the
#: last part of a wait is spent yielding to the loop until the slot's time. Measured with 8
#: processes x 25 tasks: median lateness 0.01 ms. Spinning longer (5 ms) did not shorten the
#: tail, which comes from OS scheduling on a busy host, and makes the process look CPU-bound.
SPIN_S = 0.002

_UNITS = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hour": 3600.0}
_RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)?\s*([a-z]+)\s*")


class UpstreamRateLimited(Exception):
    """Raised by a provider client when the upstream answered 429 (or says "slow down").

    ``ProviderThrottle.call`` and ``@throttled`` catch it, pause the provider for every
    instance for ``retry_after_s`` and retry within the request's deadline; when they cannot,
    they raise ``ProviderBusy`` from it.

    Attributes:
        retry_after_s: the upstream's Retry-After in seconds (``DEFAULT_PAUSE_S`` if absent).
    """

    def __init__(self, retry_after_s: float | None = None, message: str | None = None) -> None:
        if retry_after_s is None or not math.isfinite(retry_after_s) or retry_after_s < 0:
            retry_after_s = DEFAULT_PAUSE_S
        super().__init__(message or f"upstream rate limited; retry after {retry_after_s:.3f}s")
        self.retry_after_s = float(retry_after_s)


@dataclass(frozen=True, slots=True)
class Admission:
    """A granted provider slot.

    Attributes:
        waited_s: seconds from the call to the grant (what ``acquire`` returns).
        requested_at: epoch seconds when the request asked for its slot.
        slot_at: epoch seconds of the reserved slot (the provider's shared timeline).
        granted_at: epoch seconds when the caller was let go (``granted_at - slot_at`` is
            the wake-up lateness).
        seq: the provider's booking number; strictly increasing in booking order.
        calls: script calls this admission made (1 when the provider was not saturated).
    """

    waited_s: float
    requested_at: float
    slot_at: float
    granted_at: float
    seq: int
    calls: int = 1


class ProviderThrottle:
    """The shared rate limit (and optional in-flight cap) of one upstream provider.

    Args:
        redis: a ``redis.asyncio.Redis`` or ``RedisCluster`` (all keys share one hash tag).
        provider: the provider's name; instances with the same name share one limit.
        rate: calls (cost units) allowed per ``per_s`` seconds, > 0.
        per_s: the period of ``rate`` in seconds, > 0 (``rate=600, per_s=60`` is 10/s).
        burst: cost units that may start at once after an idle period, >= 1. No interval of
            length t ever holds more than ``rate * t / per_s + burst`` units.
        max_concurrency: calls that may be in flight at once (``slot()`` holds a lease for
            the duration of the call), or None for no cap.
        lease_s: how long a lease lives if its holder dies without releasing it; must
            exceed the longest call.
        jitter_s: how late a call may reach the provider, after its slot, without breaking
            the limit there. Slots are spaced ``(per_s + jitter_s) / rate`` apart, so calls
            that leave up to ``jitter_s`` after their slot still never put more than ``rate``
            (+ ``burst`` - 1) units into any ``per_s`` window as the provider counts them;
            a caller that wakes later than that gives its slot up and takes a new one. The
            cost is ``jitter_s / per_s`` of the rate. None (the default) is 1.5% of
            ``per_s``: 15 ms for a per-second rate, 0.9 s for a per-minute one (where a
            cold connection's first round trip must not cost a slot of several seconds).
            0 gives exact GCRA spacing and never re-admits.
        max_pause_s: the longest pause ``pause`` sets, whatever the upstream asked for,
            0 < max_pause_s <= ``MAX_PAUSE_LIMIT_S`` (default ``DEFAULT_MAX_PAUSE_S``).

    Raises:
        InvalidArgument: an argument is out of range.
    """

    def __init__(self, redis: AnyRedis, provider: str, *, rate: float, per_s: float = 1.0,
                 burst: float = 1, max_concurrency: int | None = None,
                 lease_s: float = 30.0, jitter_s: float | None = None,
                 max_pause_s: float = DEFAULT_MAX_PAUSE_S) -> None:
        if not isinstance(provider, str) or not provider:
            raise InvalidArgument("provider must be a non-empty string")
        self.provider = provider
        self.rate = _positive("rate", rate)
        self.per_s = _positive("per_s", per_s)
        self.burst = _positive("burst", burst)
        if self.burst < 1:
            raise InvalidArgument(f"burst must be >= 1, got {burst!r}")
        if max_concurrency is not None and (
                isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                or max_concurrency < 1):
            raise InvalidArgument(f"max_concurrency must be None or an int >= 1, "
                                  f"got {max_concurrency!r}")
        self.max_concurrency = max_concurrency
        self.lease_s = _positive("lease_s", lease_s)
        if jitter_s is None:
            jitter_s = DEFAULT_JITTER_SHARE * self.per_s
        if isinstance(jitter_s, bool) or not isinstance(jitter_s, int | float) or not (
                0 <= jitter_s < self.per_s):
            raise InvalidArgument(f"jitter_s must be >= 0 and below per_s, got {jitter_s!r}")
        self.jitter_s = float(jitter_s)
        self.max_pause_s = _positive("max_pause_s", max_pause_s)
        if self.max_pause_s > MAX_PAUSE_LIMIT_S:
            raise InvalidArgument(f"max_pause_s must be at most {MAX_PAUSE_LIMIT_S:g}, "
                                  f"got {max_pause_s!r}")
        self._client = redis
        # Cluster safety: every key of the provider shares the tag {p:<provider>}; so does
        # each call's answer key (see _answer_key).
        self._state_key, self._answer_prefix, *self._queue_keys = provider_keys(
            provider, "gcra", "gcra:call:", "fq", "fq:entries", "fq:expiry", "fq:users")
        self._round_trip_s = 0.0
        self._answer_ttl_ms = f"{ANSWER_TTL_S * 1000:.0f}"
        self._grace_ms = f"{QUEUE_GRACE_S * 1000:.0f}"
        # A queued head that asks late books the slot it was told, up to half the dispatch
        # allowance back (the other half is for the call to leave; throttle_confirm.lua), so
        # the slots after it do not move; a waiter whose head is later than that passes it
        # over. Without an allowance (jitter_s=0: exact spacing, a late caller goes anyway,
        # as ever) up to MIN_LEAD_S back.
        reach_s = self.jitter_s / 2 if self.jitter_s else MIN_LEAD_S
        self._reach_ms = f"{reach_s * 1000:.3f}"
        # At most half a slot interval: the next waiter then asks after the head before it
        # has (a waiter that asks before the head books is told to wait, and asks again).
        self._max_lead_s = self.interval_s / 2
        self._interval_ms = repr((self.per_s + self.jitter_s) * 1000.0 / self.rate)
        self._semaphore: LeaseSemaphore | None = None
        if max_concurrency is not None:
            from ._semaphore import LeaseSemaphore

            self._semaphore = LeaseSemaphore(redis, provider, max_concurrency, self.lease_s)

    def __repr__(self) -> str:
        return (f"ProviderThrottle({self.provider!r}, rate={self.rate:g}, per_s={self.per_s:g}, "
                f"burst={self.burst:g}, max_concurrency={self.max_concurrency}, "
                f"jitter_s={self.jitter_s:g})")

    @property
    def interval_s(self) -> float:
        """Seconds between two unit-cost slots at full load (``(per_s + jitter_s) / rate``)."""
        return (self.per_s + self.jitter_s) / self.rate

    @classmethod
    def from_env(cls, redis: AnyRedis, provider: str, *, default_rate: str = "20/s",
                 default_burst: float = 1, default_concurrency: int | None = None,
                 lease_s: float = 30.0,
                 env: Mapping[str, str] | None = None) -> ProviderThrottle:
        """A throttle configured by ``<PROVIDER>_RATE``, ``_BURST``, ``_CONCURRENCY``,
        ``_JITTER_MS`` (the dispatch jitter allowance, default 1.5% of the rate's period) and
        ``_MAX_PAUSE_S`` (the longest pause an upstream 429 may impose, default 60 s, at
        most 300 s).

        ``<PROVIDER>`` is the provider's name upper-cased, other characters than letters and
        digits replaced by ``_`` (``"salary-api"`` reads ``SALARY_API_RATE``). An unset or
        empty variable takes the default; ``_CONCURRENCY`` may be ``none`` (no cap).

        Examples: ``LLM_RATE=20/s``, ``LLM_RATE=600/m``, ``LLM_RATE=90000/1m`` with
        ``LLM_BURST=8000`` (tokens per minute), ``LLM_CONCURRENCY=4``.

        Raises:
            InvalidArgument: a variable (or default) is malformed or out of range; the
                message names the variable.
        """
        env = os.environ if env is None else env
        prefix = re.sub(r"[^A-Z0-9]", "_", provider.upper())
        rate_name, burst_name, conc_name = (prefix + s for s in
                                            (ENV_RATE, ENV_BURST, ENV_CONCURRENCY))

        rate_text = env.get(rate_name, "").strip() or default_rate
        try:
            rate, per_s = parse_rate(rate_text)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{rate_name}: {exc}") from None

        burst: float = default_burst
        burst_text = env.get(burst_name, "").strip()
        if burst_text:
            try:
                burst = float(burst_text)
            except ValueError:
                raise InvalidArgument(f"{burst_name}={burst_text!r} is not a number") from None
            if not math.isfinite(burst) or burst < 1:
                raise InvalidArgument(f"{burst_name}={burst_text!r} must be a number >= 1")
            if burst.is_integer():
                burst = int(burst)

        concurrency = default_concurrency
        conc_text = env.get(conc_name, "").strip()
        if conc_text.lower() in ("none", "off"):
            concurrency = None
        elif conc_text:
            if not conc_text.isdigit() or int(conc_text) < 1:
                raise InvalidArgument(f"{conc_name}={conc_text!r} must be a whole number >= 1 "
                                      f"or 'none'")
            concurrency = int(conc_text)

        jitter_name = prefix + ENV_JITTER
        jitter_text = env.get(jitter_name, "").strip()
        jitter_s: float | None = None
        if jitter_text:
            try:
                jitter_s = float(jitter_text) / 1000
            except ValueError:
                raise InvalidArgument(f"{jitter_name}={jitter_text!r} is not a number") from None

        pause_name = prefix + ENV_MAX_PAUSE
        pause_text = env.get(pause_name, "").strip()
        max_pause_s = DEFAULT_MAX_PAUSE_S
        if pause_text:
            try:
                max_pause_s = float(pause_text)
            except ValueError:
                raise InvalidArgument(f"{pause_name}={pause_text!r} is not a number") from None
            if not (math.isfinite(max_pause_s) and 0 < max_pause_s <= MAX_PAUSE_LIMIT_S):
                raise InvalidArgument(f"{pause_name}={pause_text!r} must be a number of "
                                      f"seconds above 0 and at most {MAX_PAUSE_LIMIT_S:g}")

        try:
            return cls(redis, provider, rate=rate, per_s=per_s, burst=burst,
                       max_concurrency=concurrency, lease_s=lease_s, jitter_s=jitter_s,
                       max_pause_s=max_pause_s)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{prefix}_*: {exc}") from None

    async def acquire(self, cost: float = 1, max_wait_s: float | None = None, *,
                      user: str | None = None, weight: float | None = None) -> float:
        """Wait for this provider's next rate slot.

        The in-flight cap (``max_concurrency``) needs a lease that is given back after the
        call: use ``slot()`` (or ``@throttled``) for that; ``acquire`` takes the rate only.

        Args:
            cost: cost units of the call (1 for plain call counting), 0 < cost <= burst.
            max_wait_s: longest acceptable wait; defaults to, and is always clamped to, the
                request's remaining time (``usage_limits.deadline.remaining_s()``).
            user: whose request this is: while the provider is saturated, the users waiting
                share its slots fairly. None: the user of the enclosing ``share_scope``,
                else one anonymous user shared by all such requests.
            weight: the user's share relative to others (> 0; a plan's ``weight``); None:
                the enclosing ``share_scope``'s, else 1.

        Returns:
            Seconds waited.

        Raises:
            ProviderBusy: the slot lies past ``max_wait_s``; nothing was reserved.
            CostExceedsLimit: ``cost > burst`` (can never be admitted).
            InvalidArgument: bad ``cost`` or ``max_wait_s``.
            LimiterUnavailable: Redis failed.
        """
        return (await self.admit(cost, max_wait_s, user=user, weight=weight)).waited_s

    async def admit(self, cost: float = 1, max_wait_s: float | None = None, *,
                    user: str | None = None, weight: float | None = None) -> Admission:
        """Like ``acquire`` but returns the whole ``Admission`` (slot, timestamps, order)."""
        cost = self._check_cost(cost)
        limit_s = self._wait_limit(max_wait_s)
        return await self._admit(cost, limit_s, _share(user, weight))

    @contextlib.asynccontextmanager
    async def slot(self, cost: float = 1, max_wait_s: float | None = None, *,
                   user: str | None = None,
                   weight: float | None = None) -> AsyncIterator[float]:
        """Hold a provider slot for the duration of the block; yields the seconds waited.

        With ``max_concurrency`` a lease is taken first (in arrival order), then the rate
        slot; the lease is given back when the block exits (or after ``lease_s`` if this
        process dies). Without it, this is ``acquire``. ``user`` and ``weight``: as
        ``acquire`` (the leases are granted in arrival order, not by share).

        Raises:
            ProviderBusy: no lease or no rate slot within the allowed wait (a lease taken
                for a rate slot that is too late is given back).
            CostExceedsLimit, InvalidArgument, LimiterUnavailable: as ``acquire``.
        """
        cost = self._check_cost(cost)
        limit_s = self._wait_limit(max_wait_s)
        share = _share(user, weight)
        semaphore = self._semaphore
        if semaphore is None:
            yield (await self._admit(cost, limit_s, share)).waited_s
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        lease = await semaphore.acquire(start + limit_s)
        try:
            await self._admit(cost, max(0.0, limit_s - (loop.time() - start)), share)
            yield loop.time() - start
        finally:
            await semaphore.release(lease)

    def bounded_pause_s(self, seconds: float | None) -> float:
        """The pause an upstream's Retry-After of ``seconds`` gets: at most ``max_pause_s``.

        None, a negative or a non-finite value (``inf``, ``nan``) gets ``DEFAULT_PAUSE_S``.

        Raises:
            InvalidArgument: ``seconds`` is not a number.
        """
        if seconds is None:
            return min(DEFAULT_PAUSE_S, self.max_pause_s)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise InvalidArgument(f"pause seconds must be a number, got {seconds!r}")
        if not (math.isfinite(seconds) and seconds >= 0):
            seconds = DEFAULT_PAUSE_S
        return min(float(seconds), self.max_pause_s)

    async def pause(self, seconds: float) -> float:
        """Hold back every instance's new slots for ``seconds`` (after an upstream 429).

        The pause is bounded by ``bounded_pause_s``: at most ``max_pause_s``, and
        ``DEFAULT_PAUSE_S`` for a negative or non-finite value. Extends an existing pause,
        never shortens it. No slot is booked inside the pause; slots booked before it lie
        at most a few round trips ahead of their callers (``MAX_LEAD_S``).

        Returns:
            Epoch seconds when the provider's pause ends.

        Raises:
            InvalidArgument: ``seconds`` is not a number.
            LimiterUnavailable: Redis failed.
        """
        pause_s = self.bounded_pause_s(seconds)
        until = await script("throttle_pause")(
            self._client, [self._state_key, self._answer_key(), self._queue_keys[2]],
            [f"{time.time() * 1000:.3f}", f"{pause_s * 1000:.3f}", self._answer_ttl_ms])
        return float(until) / 1000

    async def call(self, fn: Callable[[], Awaitable[R]], *, cost: float = 1, retries: int = 0,
                   max_wait_s: float | None = None, user: str | None = None,
                   weight: float | None = None) -> R:
        """Run ``fn()`` inside a slot; on ``UpstreamRateLimited`` pause the provider and retry.

        Every instance is held back for the upstream's Retry-After. The call is retried up
        to ``retries`` times, each attempt waiting for a slot after the pause but never past
        the request's deadline.

        Raises:
            ProviderBusy: no slot in time, or the upstream still refused after ``retries``
                retries (``from`` the ``UpstreamRateLimited``; ``retry_after_s`` is the
                upstream's).
        """
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise InvalidArgument(f"retries must be an int >= 0, got {retries!r}")
        attempt = 0
        while True:
            async with self.slot(cost, max_wait_s, user=user, weight=weight):
                try:
                    return await fn()
                except UpstreamRateLimited as exc:
                    limited = exc
            until = await self.pause(limited.retry_after_s)
            retry_after = max(self.bounded_pause_s(limited.retry_after_s), until - time.time())
            if attempt >= retries or retry_after >= deadline.remaining_s():
                raise ProviderBusy(self.provider, retry_after,
                                   f"provider {self.provider!r} is rate limiting us; "
                                   f"retry after {retry_after:.3f}s") from limited
            attempt += 1

    async def _admit(self, cost: float, limit_s: float, share: tuple[str, float]) -> Admission:
        loop = asyncio.get_running_loop()
        requested = time.time()
        start = loop.time()
        user, weight = share
        request_id, entry, readmissions, calls = uuid.uuid4().hex, "", 0, 0
        planned = 0.0  # the lead a queued caller woke up by
        while True:
            # Wall clock first, loop clock second: a pause between the two readings can
            # only make this caller wake late, never before its slot.
            now_ms = f"{(time.time() if calls else requested) * 1000:.3f}"
            asked = loop.time() if calls else start
            lead = min(MAX_LEAD_S, max(MIN_LEAD_S, 3 * self._round_trip_s), self._max_lead_s)
            # A caller that woke by a lead books within it, though its round trips got
            # shorter meanwhile (else it would be told to wait and ask once more).
            horizon_ms = f"{max(lead, planned) * 1000:.3f}"
            left_ms = f"{max(0.0, limit_s - (asked - start)) * 1000:.3f}"
            keys = [self._state_key, self._answer_key(), *self._queue_keys]
            if entry:
                reply = await script("throttle_confirm")(self._client, keys, [
                    now_ms, self._interval_ms, repr(self.burst), left_ms, self._answer_ttl_ms,
                    horizon_ms, entry, self._grace_ms, self._reach_ms])
            else:
                reply = await script("throttle_acquire")(self._client, keys, [
                    now_ms, self._interval_ms, repr(self.burst), repr(cost), left_ms,
                    self._answer_ttl_ms, horizon_ms, user, repr(weight),
                    self._grace_ms, request_id])
            calls += 1
            self._round_trip_s = loop.time() - asked
            status, wait_s = int(reply[0]), float(reply[1]) / 1000
            due = asked + wait_s
            if status == REFUSED:
                raise ProviderBusy(self.provider, wait_s)
            if status == QUEUED:
                # Told a slot that fairer arrivals may still push back: ask again just
                # before it (never in a tight loop while the head has not booked yet).
                entry, planned = _text(reply[4]), lead
                poll = max(MIN_POLL_S, self._round_trip_s)
                await _sleep_until(loop, max(due - lead, loop.time() + poll))
                continue
            if status == BOOKED:
                await _sleep_until(loop, due)
                # Woken later than the provider's counting can absorb (a busy loop or
                # host): going now could put one call too many into a window. Take a new
                # slot instead; the old one stays unused.
                if self.jitter_s == 0 or loop.time() - due <= self.jitter_s:
                    return Admission(waited_s=loop.time() - start, requested_at=requested,
                                     slot_at=float(reply[2]) / 1000, granted_at=time.time(),
                                     seq=int(reply[3]), calls=calls)
            # Woke too late, or (GONE) came back after its queue entry expired: ask anew.
            readmissions += 1
            if readmissions > MAX_READMISSIONS:
                raise ProviderBusy(self.provider, self.interval_s,
                                   f"provider {self.provider!r}: this instance keeps waking too "
                                   f"late for its slots")
            request_id, entry, planned = uuid.uuid4().hex, "", 0.0

    def _answer_key(self) -> str:
        """A fresh key for one script call's answer (its id), in the provider's slot."""
        return self._answer_prefix + uuid.uuid4().hex

    def _check_cost(self, cost: float) -> float:
        cost = _positive("cost", cost)
        if cost > self.burst:
            raise CostExceedsLimit(
                f"cost {cost:g} of provider {self.provider!r} is above the burst capacity "
                f"{self.burst:g}: it could never be admitted", cost=cost, limit=self.burst)
        return cost

    def _wait_limit(self, max_wait_s: float | None) -> float:
        remaining = deadline.remaining_s()
        if max_wait_s is None:
            return remaining
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, int | float) or not (
                max_wait_s >= 0):
            raise InvalidArgument(f"max_wait_s must be a number >= 0, got {max_wait_s!r}")
        return min(float(max_wait_s), remaining)


def throttled(throttle: ProviderThrottle | str | Callable[[Any], ProviderThrottle] = "throttle",
              *, cost: float | Callable[..., float] = 1, retries: int = 0,
              max_wait_s: float | None = None,
              ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Throttle an async provider-client method (or function) by its provider's limits.

    Each call waits for a slot (holding a lease for the duration of the call when the
    throttle has ``max_concurrency``), never past the request's deadline. When the call
    raises ``UpstreamRateLimited`` the provider is paused for every instance and the call is
    retried up to ``retries`` times (see ``ProviderThrottle.call``).

    Args:
        throttle: where the limits live: the name of an attribute of ``self`` (default
            ``"throttle"``), a callable taking ``self``, or a ``ProviderThrottle``.
        cost: cost units per call, or a function of the call's arguments (including
            ``self``) that estimates them, e.g. tokens of an LLM prompt.
        retries: retries after ``UpstreamRateLimited``.
        max_wait_s: longest wait for a slot (always clamped to the request's deadline).

    Example:
        >>> class LlmClient:
        ...     def __init__(self, redis):
        ...         self.throttle = ProviderThrottle.from_env(redis, "llm", default_rate="600/m")
        ...
        ...     @throttled(cost=lambda self, prompt: 1 + len(prompt) // 4, retries=1)
        ...     async def complete(self, prompt: str) -> str:
        ...         response = await self.http.post(...)
        ...         if response.status_code == 429:
        ...             raise UpstreamRateLimited(float(response.headers.get("Retry-After", 1)))
        ...         return response.json()["text"]

    Raises (from the decorated call):
        ProviderBusy: no slot in time, or still rate limited after the retries.
    """
    if not (isinstance(throttle, ProviderThrottle | str) or callable(throttle)):
        raise InvalidArgument(f"throttle must be an attribute name, a callable or a "
                              f"ProviderThrottle, got {throttle!r}")
    if not callable(cost):
        _positive("cost", cost)

    def resolve(args: tuple[Any, ...]) -> ProviderThrottle:
        if isinstance(throttle, ProviderThrottle):
            return throttle
        if not args:
            raise InvalidArgument("@throttled with an attribute name or callable needs a "
                                  "method (self as the first argument)")
        found = getattr(args[0], throttle) if isinstance(throttle, str) else throttle(args[0])
        if not isinstance(found, ProviderThrottle):
            raise InvalidArgument(f"@throttled: {throttle!r} gave {found!r}, "
                                  f"not a ProviderThrottle")
        return found

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            units = cost(*args, **kwargs) if callable(cost) else cost
            return await resolve(args).call(lambda: fn(*args, **kwargs), cost=units,
                                            retries=retries, max_wait_s=max_wait_s)

        return wrapper

    return decorate


def parse_rate(text: str) -> tuple[float, float]:
    """``(rate, per_s)`` of a rate text: ``"20/s"`` -> ``(20.0, 1.0)``.

    ``"600/m"`` -> ``(600.0, 60.0)``; ``"5/10s"`` -> ``(5.0, 10.0)``.
    Units: ``s``/``sec``, ``m``/``min``, ``h``/``hour``.

    Raises:
        InvalidArgument: not a positive rate of that form.
    """
    match = _RATE.fullmatch(text.lower()) if isinstance(text, str) else None
    if not match or match.group(3) not in _UNITS:
        raise InvalidArgument(f"{text!r} is not a rate like '20/s', '600/m' or '5/10s'")
    count = float(match.group(1))
    per_s = float(match.group(2) or 1) * _UNITS[match.group(3)]
    if count <= 0 or per_s <= 0:
        raise InvalidArgument(f"{text!r}: the rate and its period must be > 0")
    return count, per_s


_share_var: ContextVar[tuple[str, float] | None] = ContextVar("usage_limits_share",
                                                             default=None)


@contextlib.contextmanager
def share_scope(user: str, weight: float = 1.0) -> Iterator[None]:
    """Throttled calls inside the block are ``user``'s, with ``weight`` (fair queuing).

    For code outside a request (the web layer calls ``bind_share`` with the caller's id and
    their plan's weight, so provider clients need not pass them).

    Raises:
        InvalidArgument: ``user`` is empty or ``weight`` is not a finite number > 0.
    """
    token = _share_var.set(_share(user, weight))
    try:
        yield
    finally:
        _share_var.reset(token)


def bind_share(user: str, weight: float = 1.0) -> None:
    """Throttled calls of the current context (a request's task) are ``user``'s, with
    ``weight``: what the web layer does once it knows the caller and their plan.

    Raises:
        InvalidArgument: ``user`` is empty or ``weight`` is not a finite number > 0.
    """
    _share_var.set(_share(user, weight))


def _share(user: str | None, weight: float | None) -> tuple[str, float]:
    """The (user, weight) a request is queued under: the arguments, else the scope's."""
    scoped = _share_var.get()
    if user is None:
        user = scoped[0] if scoped else ANONYMOUS
    if weight is None:
        weight = scoped[1] if scoped and scoped[0] == user else 1.0
    if not isinstance(user, str) or not user:
        raise InvalidArgument(f"user must be a non-empty string, got {user!r}")
    return user, _positive("weight", weight)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    """Sleep until ``loop.time() >= when``: asyncio.sleep, then yield until it is time."""
    left = when - loop.time()
    if left > SPIN_S:
        await asyncio.sleep(left - SPIN_S)
    while loop.time() < when:  # noqa: ASYNC110 - a spin of at most SPIN_S, on purpose
        await asyncio.sleep(0)


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
