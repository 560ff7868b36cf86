"""Usage records written beside the request: started at the reservation, never failing it.

``start`` is called once a charge is made (its draws recorded): the record's put runs as a
task, in a worker thread (boto3 is blocking), while the route calls its provider. ``lowered``
follows each settle or refund the ledger made: the same task (or a new one) lowers the
record once its put has landed. The middleware's ``drain`` waits for them within the
request's clean-up bound. A write that fails, or is still running at that bound, is
**kept** (``RecordsKept``) and tried again before this environment's next requests, like a
kept refund (``web.refunds``); every write is idempotent (``entitlements.usage``), so a
write whose reply was lost, tried again, lands once.

Bounds: at most ``MAX_PENDING`` records are kept per environment (beyond that the oldest is
dropped), each at most ``KEEP_S``; one dropped either way is counted ``RecordsLost`` and
logged with its ids (the charge record of truth is unaffected: only the statement lacks it).
Before a request, at most ``RETRY_BATCH`` kept records are tried, all at once, each within
``RETRY_EACH_S``.

The first record of a user in a UTC hour also writes the hour's active-user marker
(``UsageStore.mark_active``), gated by a Redis ``SET NX`` in the user's hash tag with an
expiry of two hours, and remembered in the process: about one marker write per active
user-hour, not one per charge.

Records are on when ``ATTO_USAGE_TABLE`` is set (``usage_store.default_usage_store``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..entitlements.usage import RecordState, UsageRecord, hour_of, lowered_state
from ..keys import user_keys
from . import observability as obs

if TYPE_CHECKING:
    from ..entitlements.usage_store import UsageStore
    from .charge import Charge

#: Records kept per execution environment; beyond that the oldest are dropped (lost).
MAX_PENDING = 1000
#: How long a kept record is tried again, seconds, before it is dropped (lost).
KEEP_S = 24 * 3600.0
#: Kept records tried before one request, at most, and the longest each may take.
RETRY_BATCH = 32
RETRY_EACH_S = 0.5
#: How long the Redis gate of an active-user marker lives: past the end of its hour.
ACTIVE_GATE_S = 7200
#: (user, hour) pairs remembered in the process as marked.
MAX_MARKED = 10_000


@dataclass
class _Job:
    """One charge's record on its way to the table.

    Attributes:
        record: what the record should be now (lowered by ``lowered``).
        put_done: its put has landed (or never will be needed: a lowering of a charge
            whose record this environment did not start).
        landed_kept: what the table's record keeps, as far as this job knows.
        redis: the ledger's client, for the active-user gate (None: no marker).
        task: the write running now, if any.
        kept_at: when it was first kept (``time.monotonic()``), None while never kept.
    """

    record: UsageRecord
    put_done: bool
    landed_kept: int
    redis: Any = field(default=None, repr=False)
    marked: bool = False
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    kept_at: float | None = None


_jobs: OrderedDict[tuple[str, str, str], _Job] = OrderedDict()
_marked: OrderedDict[tuple[str, str], None] = OrderedDict()


def _usage_store() -> UsageStore | None:
    """The environment's usage store (None: records are off, or cannot be set up: logged,
    never raised), sharing the entitlements store's DynamoDB client when there is one
    (one client, one connection pool)."""
    from ..entitlements import usage_store

    try:
        store = usage_store.default_usage_store()
        if store is not None and store._client is None:
            from .settings import settings

            if settings().entitlements:
                from ..entitlements.store import default_store

                store._client = default_store().client
    except Exception:
        obs.logger().exception("the usage records' store could not be set up")
        return None
    return store


def _key(charge: Charge) -> tuple[str, str, str]:
    return charge.user_id, charge.request_id, charge.nonce


def _now_ms() -> int:
    return int(time.time() * 1000)


def start(charge: Charge, *, route: str, plan: str) -> None:
    """Start writing the record of a charge just made (call after its draws are recorded).

    Never raises: a record that cannot even be built is logged and left out.
    """
    store = _usage_store()
    reservation = charge.reservation
    if store is None or reservation is None or not charge.nonce:
        return
    try:
        draws = tuple(reservation.draws) if charge.credit_state() == "recorded" else ()
        record = UsageRecord(charge.user_id, charge.request_id, charge.nonce, route, plan,
                             charge.cost, charge.cost, draws, "charged", _now_ms())
    except Exception:
        obs.logger().exception("a usage record could not be made", extra={
            "request_id": charge.request_id})
        return
    job = _Job(record, put_done=False, landed_kept=charge.cost,
               redis=getattr(charge.budget, "redis", None))
    _jobs[_key(charge)] = job
    _run(job, store)


def lowered(charge: Charge, kept: int, *, support: bool = False) -> None:
    """Lower the record of ``charge`` to ``kept`` (after the ledger lowered the charge).

    Never raises. A charge whose record this environment is not writing (a kept refund
    whose record landed long ago) gets a lowering alone.
    """
    store = _usage_store()
    if store is None or not charge.nonce:
        return
    state: RecordState = lowered_state(kept, support=support)
    job, reservation = _jobs.get(_key(charge)), charge.reservation
    if job is None and reservation is None:
        return  # a reservation that never answered: no record was started for it
    try:
        if job is None and reservation is not None:
            cost = reservation.cost
            base = UsageRecord(charge.user_id, charge.request_id, charge.nonce, "", "",
                               cost, cost, (), "charged", _now_ms())
            job = _Job(base, put_done=True, landed_kept=cost)
            _jobs[_key(charge)] = job
        if job is None:
            return
        job.record = job.record.lowered(kept, state, _now_ms())
    except Exception:
        obs.logger().exception("a usage record's lowering could not be made", extra={
            "request_id": charge.request_id})
        return
    if job.task is None and job.kept_at is None:
        _run(job, store)


def _run(job: _Job, store: UsageStore) -> None:
    job.task = asyncio.get_running_loop().create_task(_flush(job, store))


async def _flush(job: _Job, store: UsageStore) -> None:
    """Write the job until the table holds what it should; a failure keeps the job."""
    try:
        while True:
            target = job.record
            await _mark_active(job, store)
            if not job.put_done:
                created = await asyncio.to_thread(store.put, target)
                job.put_done = True
                job.landed_kept = target.kept if created else target.cost
            if target.kept < job.landed_kept:
                await asyncio.to_thread(store.lower, target.user_id, target.request_id,
                                        target.nonce, target.kept, target.state,
                                        target.changed_ms or _now_ms())
                job.landed_kept = target.kept
            if job.record is target:
                _done(job)
                return
    except asyncio.CancelledError:
        _keep(job, "a usage record's write ran out of time; kept")
        raise
    except Exception:
        _keep(job, "a usage record's write failed; kept")
    finally:
        job.task = None


async def _mark_active(job: _Job, store: UsageStore) -> None:
    """Write the user's marker for the record's hour, about once per user-hour."""
    if job.marked or job.redis is None or job.record.partial:
        return
    user, hour = job.record.user_id, hour_of(job.record.at_ms)
    if (user, hour) not in _marked:
        gate = user_keys(user, f"act:{hour}")[0]
        try:
            first = bool(await job.redis.set(gate, 1, nx=True, ex=ACTIVE_GATE_S))
        except Exception:  # Redis down: the marker is idempotent, write it anyway
            first, gate = True, ""
        if first:
            try:
                await asyncio.to_thread(store.mark_active, user, job.record.at_ms)
            except BaseException:
                if gate:  # the next record of the hour tries again
                    await asyncio.shield(_forget_gate(job.redis, gate))
                raise
        _marked[(user, hour)] = None
        while len(_marked) > MAX_MARKED:
            _marked.popitem(last=False)
    job.marked = True


async def _forget_gate(redis: Any, gate: str) -> None:
    try:
        await redis.delete(gate)
    except Exception:  # the gate expires on its own; that hour's marker may be missing
        obs.logger().warning("could not clear an active-user gate", exc_info=True)


def _done(job: _Job) -> None:
    r = job.record
    key = (r.user_id, r.request_id, r.nonce)
    if _jobs.get(key) is job:
        del _jobs[key]
    if job.kept_at is not None:
        obs.logger().info("kept usage record written", extra={
            "request_id": r.request_id, "delay_s": round(time.monotonic() - job.kept_at, 3)})


def _keep(job: _Job, message: str) -> None:
    obs.logger().warning(message, extra={"request_id": job.record.request_id},
                         exc_info=True)
    if job.kept_at is None:
        job.kept_at = time.monotonic()
        obs.count(obs.RECORDS_KEPT)
    kept = [j for j in _jobs.values() if j.kept_at is not None]
    if len(kept) > MAX_PENDING:
        _lose(min(kept, key=lambda j: j.kept_at or 0.0), "kept usage record dropped (too many)")


def _lose(job: _Job, message: str) -> None:
    r = job.record
    _jobs.pop((r.user_id, r.request_id, r.nonce), None)
    obs.count(obs.RECORDS_LOST)
    obs.logger().error(message, extra={"request_id": r.request_id, "user": r.user_id,
                                       "nonce": r.nonce, "kept": r.kept, "state": r.state})


def pending() -> int:
    """How many records are kept to be written again."""
    return sum(1 for j in _jobs.values() if j.kept_at is not None and j.task is None)


def in_flight() -> int:
    """How many record writes are running now."""
    return sum(1 for j in _jobs.values() if j.task is not None)


async def drain(timeout_s: float) -> bool:
    """Wait for the record writes running now, at most ``timeout_s`` in all; those still
    running then are cancelled and kept (their write may land anyway: it is idempotent).

    Returns:
        True when none was left running.
    """
    tasks = [j.task for j in _jobs.values() if j.task is not None]
    if not tasks:
        return True
    _, late = await asyncio.wait(tasks, timeout=max(0.0, timeout_s))
    for task in late:
        task.cancel()
    if late:
        await asyncio.wait(late)
    return not late


async def retry(each_s: float = RETRY_EACH_S, batch: int = RETRY_BATCH) -> int:
    """Try up to ``batch`` kept records, oldest first, at once, each within ``each_s``;
    drop those kept longer than ``KEEP_S`` (lost).

    Returns:
        How many landed.
    """
    store = _usage_store()
    if store is None:
        return 0
    now = time.monotonic()
    tried: list[_Job] = []
    for job in [j for j in _jobs.values() if j.kept_at is not None and j.task is None]:
        if now - (job.kept_at or now) > KEEP_S:
            _lose(job, "kept usage record expired")
        elif len(tried) < batch:
            tried.append(job)
    for job in tried:
        _jobs.move_to_end(_key_of(job))  # behind the others: they get their turn first
        _run(job, store)
    tasks = [j.task for j in tried if j.task is not None]
    if tasks:
        _, late = await asyncio.wait(tasks, timeout=each_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)
    return sum(1 for j in tried if _key_of(j) not in _jobs)


def _key_of(job: _Job) -> tuple[str, str, str]:
    r = job.record
    return r.user_id, r.request_id, r.nonce


def clear() -> None:
    """Forget every record in flight or kept, and the marked hours (tests)."""
    for job in _jobs.values():
        if job.task is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: it runs no more
                job.task.cancel()
    _jobs.clear()
    _marked.clear()
