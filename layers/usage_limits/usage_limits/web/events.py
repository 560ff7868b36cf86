"""Usage-threshold and credit events, published to EventBridge within a short bound.

Four detail-types, all with source ``atto.cloud``:

- ``Atto Usage Threshold``: a charge took a user across a threshold of a window
  (``user``, ``plan``, ``window_s``, ``threshold`` in percent, ``used``, ``limit``);
- ``Atto Credit Low``: a charge took one of a user's credit grants to ``low_percent`` of
  its tokens or below (``user``, ``plan``, ``reference``, ``grant_kind``, ``remaining``,
  ``tokens``, ``low_percent``);
- ``Atto Credit Exhausted``: a charge used up one of a user's credit grants (same fields,
  ``remaining`` 0);
- ``Atto Credit Expired``: a grant expired with tokens unused (``user``, ``reference``,
  ``grant_kind``, ``forfeited``, ``tokens``, ``expires_at``), once per grant, published by
  the load, read or auditor's expiry sweep that first recorded it (the grant's
  ``expired_at``); none when every answer to that write was lost (``store.mark_expired``).

The reservation script reports each crossing once per grant (``Reservation.crossings`` and
``Reservation.credit_crossings``); ``threshold_events`` and ``credit_events`` turn them into
events.

Publishing never fails a request and never holds it longer than ``timeout_s``: the
PutEvents call runs in a worker thread with botocore timeouts of the same length and no
retries, and the caller stops waiting when ``asyncio.timeout`` ends. An event that was not
confirmed within the bound is logged and counted (``EventsFailed``); it may still arrive.

``publish_soon`` starts the publication as a task, so it overlaps whatever the request does
next; ``drain`` (awaited by the middleware before the request's metrics are written) waits
for those tasks, each of which ends within its bound.

Environment: ``ATTO_EVENT_BUS`` (the bus's name or ARN; unset: events are not published,
as in local mode, where each is printed instead as one line starting ``LOCAL_EVENT_MARK``),
``ATTO_EVENTS_TIMEOUT_S`` (default 1.0).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

from .. import snapstart
from ..exceptions import InvalidArgument
from . import observability as obs
from .settings import settings

if TYPE_CHECKING:
    from ..budget import Crossing

ATTO_EVENT_BUS = "ATTO_EVENT_BUS"
ATTO_EVENTS_TIMEOUT_S = "ATTO_EVENTS_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1.0

SOURCE = "atto.cloud"
USAGE_THRESHOLD = "Atto Usage Threshold"
CREDIT_LOW = "Atto Credit Low"
CREDIT_EXHAUSTED = "Atto Credit Exhausted"
CREDIT_EXPIRED = "Atto Credit Expired"
DETAIL_TYPES = (USAGE_THRESHOLD, CREDIT_LOW, CREDIT_EXHAUSTED, CREDIT_EXPIRED)

#: How a line that shows an event local mode did not publish begins (then the
#: detail-type and the detail as JSON).
LOCAL_EVENT_MARK = "[event, local: not published]"

#: PutEvents takes at most this many entries per call.
MAX_ENTRIES = 10


@dataclass(frozen=True)
class EventSettings:
    """Where and how long events are published.

    Attributes:
        bus: the event bus's name or ARN; None publishes nothing.
        timeout_s: the longest a request waits for a publication (seconds, > 0); also
            botocore's connect and read timeouts.
    """

    bus: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EventSettings:
        """Read the settings from ``env`` (default ``os.environ``).

        Raises:
            InvalidArgument: ``ATTO_EVENTS_TIMEOUT_S`` is not a positive number.
        """
        env = os.environ if env is None else env
        text = env.get(ATTO_EVENTS_TIMEOUT_S, "").strip()
        try:
            timeout = float(text) if text else DEFAULT_TIMEOUT_S
        except ValueError:
            raise InvalidArgument(f"{ATTO_EVENTS_TIMEOUT_S}: {text!r} is not a number") from None
        if not timeout > 0:
            raise InvalidArgument(f"{ATTO_EVENTS_TIMEOUT_S} must be > 0, got {text!r}")
        return cls(bus=env.get(ATTO_EVENT_BUS, "").strip() or None, timeout_s=timeout)


@dataclass(frozen=True)
class UsageThreshold:
    """A charge took ``user`` across ``threshold`` percent of one window of their plan.

    Attributes:
        user: the user's id (the JWT ``sub``).
        plan: the name of the user's plan.
        window_s: the window's length in seconds.
        threshold: the threshold crossed, in percent of ``limit``.
        used: tokens used in the window after the charge.
        limit: the window's limit in tokens.
    """

    user: str
    plan: str
    window_s: int
    threshold: int
    used: int
    limit: int

    detail_type = USAGE_THRESHOLD


class GrantCrossing(Protocol):
    """What a reservation reports about one grant it drew (``budget.CreditCrossing``).

    Attributes:
        reference: the grant's reference.
        kind: ``low`` or ``exhausted``.
        remaining: tokens left in the grant after the charge.
        tokens: the grant's amount.
    """

    @property
    def reference(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def remaining(self) -> int: ...

    @property
    def tokens(self) -> int: ...


@dataclass(frozen=True)
class CreditLow:
    """A charge took one grant of ``user`` to ``low_percent`` of its tokens or below.

    Attributes:
        user: the user's id (the JWT ``sub``).
        plan: the name of the plan the charge was made under.
        reference: the grant's reference (as the operator created it).
        grant_kind: ``promo`` or ``paid`` when the caller knew it, else None.
        remaining: tokens left in the grant after the charge.
        tokens: the grant's amount.
        low_percent: the share of ``tokens`` that counts as low (``ATTO_CREDIT_LOW_PERCENT``).
    """

    user: str
    plan: str
    reference: str
    grant_kind: str | None
    remaining: int
    tokens: int
    low_percent: int

    detail_type = CREDIT_LOW


@dataclass(frozen=True)
class CreditExhausted:
    """A charge used up one grant of ``user`` (nothing left of it).

    Attributes:
        user: the user's id.
        plan: the name of the plan the charge was made under.
        reference: the grant's reference.
        grant_kind: ``promo`` or ``paid`` when the caller knew it, else None.
        remaining: tokens left in the grant (0).
        tokens: the grant's amount.
        low_percent: the share of ``tokens`` that counts as low.
    """

    user: str
    plan: str
    reference: str
    grant_kind: str | None
    remaining: int
    tokens: int
    low_percent: int

    detail_type = CREDIT_EXHAUSTED


#: The event of each kind of grant crossing.
_CREDIT_EVENTS: dict[str, type[CreditLow] | type[CreditExhausted]] = {
    "low": CreditLow, "exhausted": CreditExhausted}


@dataclass(frozen=True)
class CreditExpired:
    """One grant of ``user`` expired with tokens unused: they are forfeited. Published
    once per grant, by the load, read or expiry sweep that first recorded it
    (``expired_at``).

    Attributes:
        user: the user's id.
        reference: the grant's reference.
        grant_kind: ``promo`` or ``paid``.
        forfeited: the unused tokens, lost at expiry.
        tokens: the grant's amount.
        expires_at: when it expired (RFC 3339, UTC).
    """

    user: str
    reference: str
    grant_kind: str
    forfeited: int
    tokens: int
    expires_at: str

    detail_type = CREDIT_EXPIRED


Event = UsageThreshold | CreditLow | CreditExhausted | CreditExpired


def expired_events(user_id: str, grants: Sequence[Any]) -> list[CreditExpired]:
    """One ``CreditExpired`` per grant (``entitlements.Grant``) recorded as expired unused."""
    from ..entitlements.models import iso

    return [CreditExpired(user=user_id, reference=g.reference, grant_kind=g.kind,
                          forfeited=g.remaining, tokens=g.tokens,
                          expires_at=iso(g.expires_at_ms) or "") for g in grants]


def threshold_events(user: str, plan: str,
                     crossings: Sequence[Crossing]) -> list[UsageThreshold]:
    """One ``UsageThreshold`` per crossing a reservation reported."""
    return [UsageThreshold(user=user, plan=plan, window_s=round(c.window_s),
                           threshold=c.threshold, used=c.used, limit=c.limit)
            for c in crossings]


def credit_events(user_id: str, plan_name: str, crossings: Sequence[GrantCrossing], *,
                  low_percent: int | None = None,
                  grant_kinds: Mapping[str, str] | None = None,
                  ) -> list[CreditLow | CreditExhausted]:
    """One ``CreditLow`` or ``CreditExhausted`` per grant crossing a reservation reported.

    Args:
        user_id: the user's id (as ``threshold_events`` names them).
        plan_name: the plan the charge was made under.
        crossings: ``Reservation.credit_crossings``, in the order the script reported them.
        low_percent: the low share the ledger used (default: the web settings'
            ``credit_low_percent``, the value the environment's ledgers are made with).
        grant_kinds: reference -> ``promo``/``paid``, overriding what a crossing says; a
            crossing without a ``grant_kind`` of its own and not in it has None.

    Returns:
        The events, in the order of ``crossings``. A crossing of a kind other than
        ``low`` or ``exhausted`` is logged and left out, never raised: the charge it
        describes is already made.
    """
    percent = settings().credit_low_percent if low_percent is None else low_percent
    kinds = grant_kinds or {}
    out: list[CreditLow | CreditExhausted] = []
    for c in crossings:
        made = _CREDIT_EVENTS.get(c.kind)
        if made is None:
            obs.logger().warning("unknown credit crossing left out", extra={"kind": c.kind})
            continue
        out.append(made(user=user_id, plan=plan_name, reference=c.reference,
                        grant_kind=kinds.get(c.reference)
                        or getattr(c, "grant_kind", None) or None, remaining=c.remaining,
                        tokens=c.tokens, low_percent=percent))
    return out


def entry(event: Event, bus: str) -> dict[str, str]:
    """The PutEvents entry of ``event`` on ``bus``."""
    return {"Source": SOURCE, "DetailType": event.detail_type, "EventBusName": bus,
            "Detail": json.dumps(asdict(event), separators=(",", ":"))}


class EventPublisher:
    """Publishes events to one bus, each call bounded by ``settings.timeout_s``.

    Args:
        settings: the bus and the bound.
        client: an EventBridge client to use (default: one boto3 client, made on first use
            with the bound as its timeouts and no retries).
    """

    def __init__(self, settings: EventSettings, client: Any = None) -> None:
        self.settings = settings
        self._client = client
        self._lock = threading.Lock()

    def _events_client(self) -> Any:
        with self._lock:  # boto3's default session is not safe to share while it makes one
            if self._client is None:
                import boto3
                from botocore.config import Config

                bound = self.settings.timeout_s
                self._client = boto3.client("events", config=Config(
                    connect_timeout=bound, read_timeout=bound,
                    retries={"total_max_attempts": 1, "mode": "standard"}))
            return self._client

    def _put(self, entries: list[dict[str, str]]) -> int:
        """Send ``entries`` (in calls of up to ``MAX_ENTRIES``); how many were refused."""
        client = self._events_client()
        refused = 0
        for start in range(0, len(entries), MAX_ENTRIES):
            answer = client.put_events(Entries=entries[start:start + MAX_ENTRIES])
            failed = int(answer.get("FailedEntryCount", 0))
            if failed:
                refused += failed
                codes = sorted({e.get("ErrorCode", "?") for e in answer.get("Entries", [])
                                if e.get("ErrorCode")})
                obs.logger().error("events refused", extra={"count": failed, "codes": codes})
        return refused

    async def publish(self, events: Sequence[Event]) -> bool:
        """Publish ``events``; True when every one was accepted within the bound.

        Never raises: a failure or a timeout is logged and counted as ``EventsFailed``
        (one per event not confirmed). Without a bus, publishes nothing and returns False.
        """
        if not events or self.settings.bus is None:
            return not events
        bus = self.settings.bus
        entries = [entry(e, bus) for e in events]
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                refused = await asyncio.to_thread(self._put, entries)
        except Exception as exc:  # TimeoutError, botocore errors, no credentials, ...
            obs.count(obs.EVENTS_FAILED, len(entries))
            obs.logger().error("events not published", extra={
                "count": len(entries), "error": type(exc).__name__,
                "detail_types": sorted({e["DetailType"] for e in entries})})
            return False
        if refused:
            obs.count(obs.EVENTS_FAILED, refused)
        return refused == 0


@cache
def publisher() -> EventPublisher:
    """The execution environment's publisher, configured from the environment."""
    return EventPublisher(EventSettings.from_env())


# A restored snapshot must not share the publisher's client and its pooled connections.
snapstart.after_restore(publisher.cache_clear)


_tasks: set[asyncio.Task[bool]] = set()


def publish_soon(events: Sequence[Event]) -> None:
    """Start publishing ``events`` without waiting; ``drain`` waits for it.

    Without a bus nothing is published; in local mode each event is printed to stderr as
    one line, so that ``make serve`` shows what a deployed stack would publish.
    """
    if not events:
        return
    if publisher().settings.bus is None:
        if settings().local:
            for event in events:
                print(f"{LOCAL_EVENT_MARK} {event.detail_type} "
                      f"{json.dumps(asdict(event), separators=(',', ':'))}",
                      file=sys.stderr, flush=True)
        return
    task = asyncio.get_running_loop().create_task(publisher().publish(list(events)))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


async def drain(timeout_s: float | None = None) -> bool:
    """Wait for the publications ``publish_soon`` started (each ends within its bound).

    Args:
        timeout_s: the longest wait in all (None: until they end). Publications still
            running then go on (none is cancelled), and end when the loop runs again.

    Returns:
        True when none is left running.
    """
    loop = asyncio.get_running_loop()
    end = None if timeout_s is None else loop.time() + timeout_s
    while _tasks:
        left = None if end is None else end - loop.time()
        if left is not None and left <= 0:
            return False
        await asyncio.wait(list(_tasks), timeout=left)
    return True
