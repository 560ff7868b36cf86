"""The in-flight cap of a provider: a leased semaphore in Redis with an arrival-order queue.

Every holder owns a lease that expires by itself after ``lease_s``, so a holder killed by
``kill -9`` or a Lambda timeout (which runs no ``finally``) frees its place without running
any code. Callers that cannot have a lease join a queue ordered by arrival; a caller is
granted only when it is among the first ``free`` queued callers (see
``lua/throttle_lease_acquire.lua``). A queued caller keeps its entry alive by re-checking at
least every ``WAITER_TTL_S / 3``; a dead waiter leaves the queue on its own.

Every script call is idempotent: a re-sent acquire (redis-py re-sends a script whose reply
was lost) finds the caller's own lease and answers "granted" instead of queueing the caller
behind itself, and a released id (a caller that left) is never granted again, so an acquire
held up in the network cannot leak a lease. Expiries are kept on the provider's lease
clock: the server's clock (never running back), with a caller's clock trusted only within
``LEASE_CLOCK_TRUST_S`` of it (``lua/_lease_clock.lua``), so no caller's clock, however
far off, shortens or lengthens another caller's lease. Waits are computed on that clock too.

Waking up: a release publishes on the provider's channel. On a standalone client, one
subscription per process and provider (alive only while somebody waits) turns messages
into wake-ups; waiters treat them as hints and always re-check with the script. Cluster
clients (and a subscription that failed) poll instead, with a bounded interval, and never
later than the moment enough leases expire for their turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._scripts import script
from .exceptions import LimiterUnavailable, ProviderBusy
from .keys import provider_keys

if TYPE_CHECKING:
    from ._scripts import AnyRedis

log = logging.getLogger(__name__)

#: A queued caller that stops re-checking for this long leaves the queue.
WAITER_TTL_S = 2.0
#: Longest sleep between re-checks when pub/sub wakes the waiter (a safety net only).
SUBSCRIBED_POLL_S = 0.5
#: Polling without pub/sub: this much per place still missing, at most POLL_MAX_S.
POLL_STEP_S = 0.02
POLL_MAX_S = 0.25
#: How far a caller's clock is trusted from the Redis server's for lease expiries: none,
#: the server's clock alone decides.
LEASE_CLOCK_TRUST_S = 0.0


@dataclass(frozen=True, slots=True)
class LeaseCheck:
    """One answer of ``throttle_lease_acquire.lua``.

    Attributes:
        granted: the lease is held now.
        rank: 0-based place in the queue, -1 when not queued.
        free: leases free at the time of the check (may be <= 0).
        expiry_at: epoch seconds (on the provider's lease clock) when to check again
            at the latest: enough leases will have expired for this caller's turn, or a
            queue entry ahead expires (None: unknown).
        clock_at: epoch seconds on the lease clock when the check ran; ``expiry_at -
            clock_at`` is the wait, whatever this caller's own clock says.
    """

    granted: bool
    rank: int
    free: int
    expiry_at: float | None
    clock_at: float

    @property
    def wait_s(self) -> float | None:
        """Seconds until ``expiry_at`` (None: unknown)."""
        return None if self.expiry_at is None else self.expiry_at - self.clock_at

    @property
    def missing(self) -> int:
        """Places that must still free up before this caller's turn (>= 1 when waiting)."""
        return max(1, self.rank - self.free + 1)


class LeaseSemaphore:
    """At most ``limit`` leases of one provider held at once, across every instance."""

    def __init__(self, client: AnyRedis, provider: str, limit: int, lease_s: float) -> None:
        self.provider = provider
        self.limit = limit
        self.lease_s = lease_s
        self._client = client
        # Cluster safety: every key (and the channel name) carries the provider's hash tag.
        self._keys = provider_keys(provider, "leases", "waiters", "wexpiry", "lclock",
                                   "released")
        [self._channel] = provider_keys(provider, "free")
        self._wakeups = _Wakeups(client, self._channel) if _has_pubsub(client) else None

    async def acquire(self, deadline: float) -> str:
        """Take a lease, waiting in arrival order until ``deadline`` (event-loop time).

        Returns:
            The lease id, for ``release``.

        Raises:
            ProviderBusy: no lease could be had before the deadline.
            LimiterUnavailable: Redis failed.
        """
        loop = asyncio.get_running_loop()
        lease_id = uuid.uuid4().hex
        queue = deadline > loop.time()
        try:
            check = await self._check(lease_id, queue=queue)
            if check.granted:
                return lease_id
            if not queue:
                raise self._busy(check)
            async with self._listening(deadline - loop.time()) as wakeups:
                while True:
                    seen = wakeups.count if wakeups else 0
                    check = await self._check(lease_id, queue=True)
                    if check.granted:
                        return lease_id
                    left = deadline - loop.time()
                    if left <= 0:
                        raise self._busy(check)
                    subscribed = wakeups is not None and wakeups.alive
                    pause = min(left, WAITER_TTL_S / 3,
                                SUBSCRIBED_POLL_S if subscribed else
                                min(POLL_MAX_S, POLL_STEP_S * check.missing))
                    if check.wait_s is not None:
                        pause = min(pause, max(0.001, check.wait_s + 0.001))
                    if wakeups is not None and subscribed:
                        await wakeups.wait(seen + check.missing, pause)
                    else:
                        await asyncio.sleep(pause)
        except BaseException:
            # Leave the queue (and give back a lease granted in a reply we never read).
            await self.release(lease_id)
            raise

    async def release(self, lease_id: str) -> bool:
        """Give back a lease (or leave the queue) and wake the waiters.

        Failures are logged, not raised: the lease expires by itself after ``lease_s``.

        Returns:
            True when a live lease was released.
        """
        try:
            released = await script("throttle_lease_release")(
                self._client, self._keys, [lease_id, self._channel,
                                           f"{time.time() * 1000:.3f}",
                                           f"{self.lease_s * 1000:.3f}",
                                           f"{LEASE_CLOCK_TRUST_S * 1000:.3f}"])
        except LimiterUnavailable as exc:
            log.warning("could not release a %s lease (it expires by itself): %s",
                        self.provider, exc)
            return False
        return bool(released)

    async def _check(self, lease_id: str, *, queue: bool) -> LeaseCheck:
        reply = await script("throttle_lease_acquire")(self._client, self._keys, [
            f"{time.time() * 1000:.3f}", self.limit, f"{self.lease_s * 1000:.3f}", lease_id,
            f"{WAITER_TTL_S * 1000:.0f}", 1 if queue else 0,
            f"{LEASE_CLOCK_TRUST_S * 1000:.3f}"])
        expiry = reply[3]
        return LeaseCheck(granted=bool(int(reply[0])), rank=int(reply[1]), free=int(reply[2]),
                          expiry_at=float(expiry) / 1000 if expiry else None,
                          clock_at=float(reply[4]) / 1000)

    def _busy(self, check: LeaseCheck) -> ProviderBusy:
        wait = check.wait_s
        retry_after = self.lease_s if wait is None else max(0.001, wait)
        return ProviderBusy(self.provider, retry_after,
                            f"provider {self.provider!r} has {self.limit} calls in flight; "
                            f"retry after {retry_after:.3f}s")

    @contextlib.asynccontextmanager
    async def _listening(self, within_s: float) -> AsyncIterator[_Wakeups | None]:
        if self._wakeups is None:
            yield None
            return
        async with self._wakeups.session(within_s) as subscribed:
            yield self._wakeups if subscribed else None


def _has_pubsub(client: Any) -> bool:
    """Pub/sub wake-ups on standalone clients; cluster clients poll."""
    from redis.asyncio import Redis

    return isinstance(client, Redis)


class _Wakeups:
    """One subscription per process and provider, shared by its waiters while any waits.

    ``count`` is the number of release messages seen; a waiter that needs ``n`` more places
    sleeps until ``count`` grew by ``n`` (or its poll interval passed), then re-checks.
    ``alive`` turns False when the subscription broke; waiters then poll.
    """

    def __init__(self, client: Any, channel: str) -> None:
        self._client = client
        self._channel = channel
        self.count = 0
        self.alive = False
        self._users = 0
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[bool] | None = None
        self._event: asyncio.Event | None = None

    @contextlib.asynccontextmanager
    async def session(self, within_s: float) -> AsyncIterator[bool]:
        """Be subscribed inside the block; yields False (poll) when that failed or took
        longer than ``within_s`` (e.g. a connection pool at its limit)."""
        self._users += 1
        try:
            if self._task is None or self._ready is None:
                self._ready = asyncio.get_running_loop().create_future()
                self._event = asyncio.Event()
                self._task = asyncio.create_task(self._listen(self._ready))
            # Subscribed before the waiter's next check: no release can fall in between.
            try:
                async with asyncio.timeout(max(0.0, within_s)):
                    subscribed = await asyncio.shield(self._ready)
            except TimeoutError:
                subscribed = False
            yield subscribed
        finally:
            self._users -= 1
            if self._users == 0 and self._task is not None:
                self._task.cancel()
                self._task = None
                self._ready = None

    async def wait(self, target: int, for_s: float) -> None:
        """Sleep until ``count >= target`` or ``for_s`` seconds passed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + for_s
        while self.count < target and self._event is not None:
            left = end - loop.time()
            if left <= 0:
                return
            event = self._event
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await event.wait()

    async def _listen(self, ready: asyncio.Future[bool]) -> None:
        pubsub = self._client.pubsub()
        try:
            await pubsub.subscribe(self._channel)
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is None:
                    continue
                if message["type"] == "subscribe" and not ready.done():
                    self.alive = True
                    ready.set_result(True)
                elif message["type"] == "message":
                    self.count += 1
                    event, self._event = self._event, asyncio.Event()
                    if event is not None:
                        event.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # waiters fall back to polling; the scripts report outages
            log.debug("wake-up subscription to %s failed: %s", self._channel, exc)
        finally:
            if self._task in (None, asyncio.current_task()):  # not when a new one took over
                self.alive = False
            if not ready.done():
                ready.set_result(False)
            with contextlib.suppress(Exception):
                await pubsub.aclose()
