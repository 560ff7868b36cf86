"""The conservation auditor: reads one user's books, checks them (``audit``), reports.

A run audits the users with usage records since the previous run (``active_users`` of the
usage records; the previous run's end is an item of the entitlements table, pk
``AUDITOR``, sk ``LAST``), not every user, so its cost follows the active users. A share of
them only when ``ATTO_AUDIT_SAMPLE`` < 1 (chosen by a hash of the user and the hour, so
every user is sampled sooner or later), and at most ``ATTO_AUDIT_MAX_USERS``: a run that
hits that bound does not move the mark, so the next run starts from the same instant.

Per user: the grants and charge records (DynamoDB, strongly consistent), the ledger and
cached copy (Redis, one atomic read, ``budget_audit_read.lua``) and the usage records; the
three checks run; a user with a divergence is read and checked again after
``ATTO_AUDIT_RECHECK_S``, and only what the second read finds too is reported (a write that
was on its way has landed by then). The only thing it writes (besides its mark) is a usage
record that is provably missing: a charge record of DynamoDB older than the write bound with
no usage record. Everything else is for a person, with the command that fixes it.

A scheduled run (the active users, moving the mark) first sweeps the grants that expired
unused since the previous sweep (``expiry_sweep``): each is recorded and handed to
``on_forfeit`` once, whether or not its user comes back.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..exceptions import InvalidArgument
from .audit import (
    AuditReport,
    Divergence,
    LedgerView,
    UserAudit,
    check_charge_records,
    check_credit,
    check_grants,
    check_records,
    confirmed,
    parse_view,
)

if TYPE_CHECKING:
    from .charges import ChargeRecord
    from .store import EntitlementStore

log = logging.getLogger("usage_limits.audit")

SAMPLE_ENV = "ATTO_AUDIT_SAMPLE"
MAX_USERS_ENV = "ATTO_AUDIT_MAX_USERS"
WRITE_BOUND_ENV = "ATTO_AUDIT_WRITE_BOUND_S"
RECHECK_ENV = "ATTO_AUDIT_RECHECK_S"
FIRST_SPAN_ENV = "ATTO_AUDIT_FIRST_SPAN_S"
CONCURRENCY_ENV = "ATTO_AUDIT_CONCURRENCY"
#: Most charges of one user read from the ledger in one call (the bound of its work).
MAX_LEDGER_EVENTS = 20_000
#: The mark of the last run in the entitlements table.
MARK_PK, MARK_SK = "AUDITOR", "LAST"
#: Charge records are kept this long (``store.DRAW_RECORD_DAYS``), days.
RECORD_DAYS = 400
#: The span of usage records compared when the ledger holds nothing of a user (its
#: longest window is unknown then), ms: the longest window of the usual plans.
NO_LEDGER_SPAN_MS = 31 * 86_400_000


def record_from_charge(user_id: str, charge: ChargeRecord, route: str = "") -> Any:
    """The usage record a charge record proves: its cost, what it keeps and its draws
    (the plan is not on the charge record: '')."""
    from .usage import RecordState, UsageRecord

    state: RecordState = ("charged" if charge.kept == charge.cost else
                          "settled" if charge.kept else "refunded")
    return UsageRecord(user_id, charge.request_id, charge.nonce,
                       charge.route or route or "unknown", "", charge.cost, charge.kept,
                       charge.draws, state, charge.at_ms, charge.changed_ms)


@dataclass(frozen=True)
class AuditSettings:
    """How a run audits, read once from the environment.

    Attributes:
        sample: the share of active users audited per run, 0 < sample <= 1.
        max_users: most users one run audits.
        write_bound_s: how long a charge's records may take to land, seconds: younger
            ones are not expected yet.
        recheck_s: the pause before a user with a divergence is read again, seconds.
        first_span_s: the span a first run (no mark yet) audits, seconds.
        concurrency: users audited at once (each waits on DynamoDB and Redis, not the CPU).
    """

    sample: float = 1.0
    max_users: int = 100_000
    write_bound_s: float = 300.0
    recheck_s: float = 2.0
    first_span_s: float = 3600.0
    concurrency: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.sample <= 1:
            raise InvalidArgument(f"{SAMPLE_ENV} must be in (0, 1], not {self.sample!r}")
        if self.max_users < 1:
            raise InvalidArgument(f"{MAX_USERS_ENV} must be >= 1")
        if not 1 <= self.concurrency <= 64:
            raise InvalidArgument(f"{CONCURRENCY_ENV} must be 1 to 64")
        for name, value in ((WRITE_BOUND_ENV, self.write_bound_s),
                            (RECHECK_ENV, self.recheck_s), (FIRST_SPAN_ENV, self.first_span_s)):
            if not value >= 0:
                raise InvalidArgument(f"{name} must be >= 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AuditSettings:
        """The settings from ``env`` (default ``os.environ``); empty counts as unset.

        Raises:
            InvalidArgument: a value that is not a number in range.
        """
        source = os.environ if env is None else env

        def num(name: str, default: float) -> float:
            text = source.get(name, "").strip()
            try:
                return float(text) if text else default
            except ValueError:
                raise InvalidArgument(f"{name} must be a number, not {text!r}") from None

        d = cls()
        return cls(sample=num(SAMPLE_ENV, d.sample),
                   max_users=int(num(MAX_USERS_ENV, d.max_users)),
                   write_bound_s=num(WRITE_BOUND_ENV, d.write_bound_s),
                   recheck_s=num(RECHECK_ENV, d.recheck_s),
                   first_span_s=num(FIRST_SPAN_ENV, d.first_span_s),
                   concurrency=int(num(CONCURRENCY_ENV, d.concurrency)))


def rank(user_id: str, salt: str) -> int:
    """The user's place in this run (``salt``: the run's hour), a 64-bit hash: each run
    samples, and orders, the users differently."""
    digest = hashlib.sha256(f"{salt}:{user_id}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big")


def sampled(user_id: str, salt: str, share: float) -> bool:
    """Whether ``user_id`` is in this run's sample: its ``rank`` below ``share``."""
    return share >= 1 or rank(user_id, salt) < share * 2**64


@dataclass(frozen=True)
class Books:
    """What one read of a user's books found (the checks' input)."""

    grants: tuple[Any, ...]
    charges: tuple[ChargeRecord, ...]
    view: LedgerView
    usage: tuple[Any, ...]
    now_ms: int
    usage_from_ms: int = 0


class Auditor:
    """Checks the books of users and reports what diverges.

    Args:
        store: the entitlements store (grants, charge records, the run mark).
        redis: the ledger's client (``redis.asyncio``; None: the ledger is not compared).
        usage: the usage-record store (None: usage records are not compared).
        settings: how runs audit (default: from the environment).
        repair: write a usage record that is provably missing (default True; the CLI's
            ``books`` without ``--repair`` only reports).
        sweep_expiry: a scheduled run (the active users, moving the mark) first sweeps the
            grants that expired unused (``expiry_sweep``; default True).
    """

    def __init__(self, store: EntitlementStore, redis: Any = None, usage: Any = None, *,
                 settings: AuditSettings | None = None, repair: bool = True,
                 sweep_expiry: bool = True) -> None:
        self.store = store
        self.redis = redis
        self.usage = usage
        self.settings = settings or AuditSettings.from_env()
        self.repair = repair
        self.sweep_expiry = sweep_expiry
        #: Called with (user id, grants) for each grant the expiry sweep recorded as
        #: expired unused (the function publishes ``Atto Credit Expired``); None: nobody.
        self.on_forfeit: Callable[[str, list[Any]], Any] | None = None

    # --- reads ------------------------------------------------------------------------------

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def read_ledger(self, user_id: str, now_ms: int) -> LedgerView:
        """The user's ledger and cached copy, in one atomic read (an empty view without
        Redis)."""
        if self.redis is None:
            return LedgerView(0, 0, -1)
        from .._scripts import script
        from ..keys import user_keys

        keys = user_keys(user_id, "log", "ev", "meta", "ent", "dr")
        reply = await script("budget_audit_read")(self.redis, keys,
                                                  [now_ms, MAX_LEDGER_EVENTS])
        return parse_view(reply)

    async def read(self, user_id: str, now_ms: int | None = None) -> Books:
        """One read of the user's books: DynamoDB, then Redis, then the usage records.

        The reads are not one snapshot: what is on its way between them (younger than the
        write bound) is allowed for by the checks, and the recheck drops the rest.
        """
        now = int(time.time() * 1000) if now_ms is None else now_ms
        record = await self._run(self.store.load, user_id)
        charges = await self._run(self.store.charge_records, user_id)
        view = await self.read_ledger(user_id, now)
        usage: tuple[Any, ...] = ()
        since = now - (view.longest_ms or NO_LEDGER_SPAN_MS)
        if view.longest_ms:
            since = max(view.clock_ms, now) - view.longest_ms
        if self.usage is not None:
            usage = tuple(await self._run(self.usage.records, user_id, since, now + 1))
        return Books(tuple(record.grants), tuple(charges), view, usage, now, since)

    # --- checks -----------------------------------------------------------------------------

    def check(self, user_id: str, books: Books) -> tuple[list[Divergence], list[str]]:
        """The three checks over one read."""
        bound_ms = int(self.settings.write_bound_s * 1000)
        since = books.now_ms - RECORD_DAYS * 86_400_000
        found = check_grants(user_id, books.grants, books.charges, records_since_ms=since)
        notes: list[str] = []
        if self.redis is None:
            notes.append("no ledger given: credit and usage records not compared")
        else:
            credit, n = check_credit(user_id, books.grants, books.view, books.charges,
                                     books.now_ms, write_bound_ms=bound_ms)
            found += credit
            notes += n
        if self.usage is None:
            notes.append("no usage records given: not compared")
            return found, notes
        if self.redis is not None:
            records, n = check_records(user_id, books.view, books.usage, books.now_ms,
                                       write_bound_ms=bound_ms)
            found += records
            notes += n
        found += check_charge_records(
            user_id, books.charges, books.usage, books.usage_from_ms, books.now_ms,
            write_bound_ms=bound_ms,
            reported=[(d.request_ids[0], d.nonce) for d in found if d.kind == "record_missing"])
        return found, notes

    async def audit_user(self, user_id: str, now_ms: int | None = None) -> UserAudit:
        """Audit one user: read and check; what diverged is read and checked again after
        the recheck pause, and only what both reads found is reported. A missing usage
        record that a charge record proves is written (``repair``).

        Raises:
            StoreUnavailable, LimiterUnavailable: a backend failed (nothing reported).
        """
        books = await self.read(user_id, now_ms)
        found, notes = self.check(user_id, books)
        if found:
            await asyncio.sleep(self.settings.recheck_s)
            later = None if now_ms is None else now_ms + int(self.settings.recheck_s * 1000)
            books = await self.read(user_id, later)
            again, notes = self.check(user_id, books)
            found = confirmed(found, again)
        repaired: list[str] = []
        if self.repair and self.usage is not None:
            found, repaired = await self._repair(user_id, books, found)
        return UserAudit(user_id, tuple(found), tuple(notes), tuple(repaired))

    async def _repair(self, user_id: str, books: Books,
                      found: Sequence[Divergence]) -> tuple[list[Divergence], list[str]]:
        """Write the usage records that are provably missing: a ``record_missing`` whose
        charge record DynamoDB holds. It stays in the report, marked repaired."""
        from dataclasses import replace

        charges = {(c.request_id, c.nonce): c for c in books.charges}
        routes = {(c.request_id, c.nonce): c.route for c in books.view.charges}
        out, repaired = [], []
        for d in found:
            key = (d.request_ids[0], d.nonce) if d.kind == "record_missing" else None
            record = charges.get(key) if key else None
            if key is None or record is None or record.state == "void":
                out.append(d)
                continue
            await self._run(self.usage.put,
                            record_from_charge(user_id, record, routes.get(key, "")))
            repaired.append(f"{user_id} {record.request_id}")
            out.append(replace(d, repaired=True))
        return out, repaired

    # --- runs -------------------------------------------------------------------------------

    async def _audit_all(self, users: Sequence[str], now_ms: int | None,
                         time_left_s: Any) -> tuple[list[UserAudit], list[str]]:
        """Audit ``users``, ``concurrency`` at a time, in order; none is started once
        ``time_left_s()`` is <= 0 (those started finish).

        Returns:
            (the audits made, the users whose audit failed: DynamoDB or Redis did not
            answer; each is logged, and the run does not move its mark).
        """
        from ..exceptions import LimiterUnavailable
        from .exceptions import StoreUnavailable

        out: list[UserAudit | None] = [None] * len(users)
        failed: list[str] = []
        queue = iter(range(len(users)))

        async def worker() -> None:
            for i in queue:
                if time_left_s is not None and time_left_s() <= 0:
                    return
                try:
                    out[i] = await self.audit_user(users[i], now_ms)
                except (StoreUnavailable, LimiterUnavailable) as exc:
                    log.warning("could not audit a user: %s", exc)
                    failed.append(users[i])

        await asyncio.gather(*(worker() for _ in range(self.settings.concurrency)))
        return [one for one in out if one is not None], failed

    def last_mark(self) -> int | None:
        """The end of the previous run, ms (None: no run yet)."""
        s = self.store
        reply = s._call(s.client.get_item, TableName=s.table, ConsistentRead=True,
                        Key=s._ser({"pk": MARK_PK, "sk": MARK_SK}))
        item = reply.get("Item")
        return None if not item else int(s._de(item)["until"])

    def set_mark(self, until_ms: int, report: AuditReport) -> None:
        """Record the end of this run: the next starts there (less the write bound)."""
        s = self.store
        s._call(s.client.put_item, TableName=s.table, Item=s._ser({
            "pk": MARK_PK, "sk": MARK_SK, "until": until_ms,
            "divergences": len(report.divergences), "users": report.users_audited}))

    async def run(self, *, users: Sequence[str] | None = None,
                  now_ms: int | None = None, move_mark: bool = True,
                  time_left_s: Any = None) -> AuditReport:
        """One run: the users given, else those active since the previous run.

        Args:
            users: audit these (the CLI's ``--user``); the mark is then left alone.
            now_ms: the run's clock (tests).
            move_mark: record this run's end for the next (only when ``users`` is None).
            time_left_s: a callable giving the seconds the run may still take (a Lambda's
                remaining time less a margin); the run stops before a user when it is
                <= 0, and leaves the mark where it was (the next run audits them). The
                expiry sweep shares it (and stops before a grant).

        Raises:
            InvalidArgument: neither users nor a usage-record store to find them.
            StoreUnavailable, LimiterUnavailable: a backend failed (the mark stays).
        """
        started = time.monotonic()
        now = int(time.time() * 1000) if now_ms is None else now_ms
        bound_ms = int(self.settings.write_bound_s * 1000)
        swept = None
        if users is None:
            if self.usage is None:
                raise InvalidArgument("a run over the active users needs the usage records")
            # the scheduled run sweeps expired grants first: its work is what expired since
            # the last sweep, and it shares (and is bounded by) the run's time
            if move_mark and self.sweep_expiry:
                from .expiry_sweep import ExpirySweep

                swept = await ExpirySweep(self.store, self.on_forfeit).run(
                    now_ms=now, first_span_ms=int(self.settings.first_span_s * 1000),
                    time_left_s=time_left_s)
            last = await self._run(self.last_mark)
            since = (now - int(self.settings.first_span_s * 1000) if last is None
                     else last - bound_ms)
            active = list(await self._run(self.usage.active_users, since, now))
        else:
            since, active, move_mark = now, list(users), False
        salt = time.strftime("%Y-%m-%dT%H", time.gmtime(now / 1000))
        chosen = [u for u in active if users is not None or
                  sampled(u, salt, self.settings.sample)]
        if users is None:  # a run that stops early (time, bound) leaves others each hour
            chosen.sort(key=lambda u: rank(u, salt))
        beyond = max(0, len(chosen) - self.settings.max_users)
        chosen = chosen[:self.settings.max_users]
        divergences: list[Divergence] = []
        notes: dict[str, tuple[str, ...]] = {}
        repaired: list[str] = []
        done, failed = await self._audit_all(chosen, now_ms, time_left_s)
        for user in failed:
            notes[user] = ("not audited: DynamoDB or Redis did not answer",)
        if len(done) + len(failed) < len(chosen):
            log.warning("the audit ran out of time after %d of %d users", len(done),
                        len(chosen))
        missed = beyond + len(chosen) - len(done)
        for one in done:
            divergences += one.divergences
            repaired += one.repaired
            if one.notes:
                notes[one.user_id] = one.notes
        report = AuditReport(
            started_ms=now, since_ms=since, until_ms=now, users_active=len(active),
            users_audited=len(done), users_not_audited=missed,
            divergences=tuple(divergences), notes=notes, repaired=tuple(repaired),
            duration_ms=int((time.monotonic() - started) * 1000),
            sample=1.0 if users is not None else self.settings.sample,
            grants_expired_swept=0 if swept is None else swept.swept,
            expiry_swept_until_ms=None if swept is None else swept.until_ms)
        if move_mark and not missed:
            await self._run(self.set_mark, now, report)
        return report
