"""The book: every charge a transfer in DynamoDB, the only place money is decided.

One item per transfer in the entitlements table (``docs/entitlements.md``, "Durability")::

    pk = U#<user>   sk = T#<request id>#<nonce>
    state      pending | posted | voided | reversed (``transfers.State``)
    reserved   tokens reserved (quota and credit); kept: tokens kept once posted (0 voided)
    route, plan, idem (the Idempotency-Key, absent without one), user, rid, nonce
    legs       [{g: grant reference, n: tokens}] in draw order ([] for a quota-only charge)
    back       [{g, returned, forfeited}]: credit that left the transfer, per grant
    created_ms, hold_ms (until when the request may post), done_ms (left pending),
    reversed_ms, ttl (epoch s, ``TRANSFER_DAYS``)
    pend_pk = PEND#<0..15>, pend_sk = <hold_ms, 13 digits>#<user>#<sk>: only while
    pending (the sparse ``pending`` index the sweep reads)

Every write is generated from the row ``transfers.apply`` returns: conditioned on the
source state (and the hold), with each leg in the same transaction. Taking a leg is
``ADD consumed :n`` on the grant conditioned on it being live and ``consumed <= :cap``
(``cap = tokens - n``, ``tokens`` never changes): **a grant is never overdrawn**; giving
one back is ``ADD consumed -n`` on a live grant, else the part is forfeited (it stays
consumed). So, for every grant, ``consumed`` = its legs - what came back to it
(**no credit created**), whatever is re-sent, refused or lost.

boto3 is imported on first use (cold start).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..entitlements.config import StoreSettings, store_settings
from ..entitlements.dynamo import DynamoTable
from ..entitlements.exceptions import StoreUnavailable
from ..entitlements.models import Grant
from ..entitlements.store import _grant, _pk
from ..exceptions import InvalidArgument
from .exceptions import ExtraRefused
from .legs import Back, Leg, balance, drawn, give_back, merge_back, plan_legs, standing
from .transfers import Event, Result, State, Transition, apply

#: Sort-key prefix of a transfer.
TRANSFER_PREFIX = "T#"
#: The sparse index of pending transfers, and its shard count: a pending transfer's
#: ``pend_pk`` is ``PEND#<crc32(user) % 16>``, so one user's are in one shard and the
#: sweep reads 16 small partitions (only requests in flight are pending).
PENDING_INDEX = "pending"
PENDING_SHARDS = 16
#: How long a transfer is kept, days (the item's ``ttl``): a yearly statement and audit.
TRANSFER_DAYS = 400
#: Attempts of one call: transaction conflicts (with a backoff of 10 ms doubling), a
#: hint found stale (one re-read of the grants), a grant found voided or expired while
#: credit went back to it (its part forfeited), a state changed between read and write.
ATTEMPTS = 8

#: Pages of the ``pending`` index one ``abandoned`` call reads, at most (its bound).
MAX_PAGES = 10

#: Makes more transaction items that must commit with a transition (a support reversal's
#: audit entry), given the credit it gives back.
ExtraItems = Callable[[tuple[Back, ...]], list[dict[str, Any]]]


def transfer_sk(request_id: str, nonce: str) -> str:
    """The sort key of the transfer ``nonce`` made for ``request_id``."""
    return f"{TRANSFER_PREFIX}{request_id}#{nonce}"


def shard_of(user_id: str) -> int:
    """The shard (0..15) of the ``pending`` index that holds a user's pending transfers."""
    return zlib.crc32(user_id.encode()) % PENDING_SHARDS


def pending_shard(user_id: str) -> str:
    """The ``pending`` index partition of a user's pending transfers."""
    return f"PEND#{shard_of(user_id)}"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _check_tokens(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{name} must be a whole number of tokens >= 0")
    return value


def check_nonce(nonce: object) -> str:
    """A reservation's nonce as a transfer's key carries it: printable, no space or ``#``.

    Raises:
        InvalidArgument: anything else.
    """
    if not isinstance(nonce, str) or not 0 < len(nonce) <= 64 or not nonce.isprintable() \
            or any(c in nonce for c in " #"):
        raise InvalidArgument("nonce must be 1 to 64 printable characters without spaces or #")
    return nonce


def _check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not 0 < len(request_id) <= 256 \
            or not request_id.isprintable():
        raise InvalidArgument("request_id must be 1 to 256 printable characters")
    return request_id


@dataclass(frozen=True)
class Transfer:
    """One charge as the book holds it.

    Attributes:
        user_id, request_id, nonce: whose, which request, which reservation of it.
        state: where it stands (``State``).
        reserved: tokens reserved (quota and credit).
        kept: tokens kept once posted (0 while pending or voided).
        legs: its credit draws, in draw order.
        back: credit that left it (returned or forfeited), per grant.
        route, plan, idem: what was charged, under which plan, for which Idempotency-Key.
        created_ms, hold_ms, done_ms, reversed_ms: when it was made, until when it may be
            posted, when it left pending (None while pending) and was reversed.
    """

    user_id: str
    request_id: str
    nonce: str
    state: State
    reserved: int
    kept: int = 0
    legs: tuple[Leg, ...] = ()
    back: tuple[Back, ...] = ()
    route: str = ""
    plan: str = ""
    idem: str | None = None
    created_ms: int = 0
    hold_ms: int = 0
    done_ms: int | None = None
    reversed_ms: int | None = None

    def __post_init__(self) -> None:
        # invariant (the auditor's too): what came back of a grant never exceeds its legs
        for leg in standing(self.legs, ()):
            came_back = sum(b.returned + b.forfeited for b in self.back if b.grant == leg.grant)
            if came_back > leg.tokens:
                raise InvalidArgument(f"transfer {self.request_id}: back exceeds its legs")
        if any(b.grant not in {leg.grant for leg in self.legs} for b in self.back):
            raise InvalidArgument(f"transfer {self.request_id}: back names a grant not drawn")

    @property
    def sk(self) -> str:
        """Its sort key."""
        return transfer_sk(self.request_id, self.nonce)

    @property
    def drawn(self) -> int:
        """Credit its legs drew."""
        return drawn(self.legs)

    @property
    def credit_standing(self) -> int:
        """Credit still drawn by it (legs minus what came back)."""
        return drawn(standing(self.legs, self.back))

    def abandoned(self, now_ms: int) -> bool:
        """Pending past its hold: treat as voided; whoever finds it writes the void."""
        return self.state is State.PENDING and self.hold_ms <= now_ms

    def charged(self, now_ms: int) -> int:
        """Tokens the transfer stands for at ``now_ms``, as every reader must count it:
        ``kept`` once posted, ``reserved`` while pending within its hold (in flight), 0
        when voided, reversed or abandoned."""
        if self.state is State.POSTED:
            return self.kept
        if self.state is State.PENDING and not self.abandoned(now_ms):
            return self.reserved
        return 0

    def item(self) -> dict[str, Any]:
        """The item as stored (None values are left out)."""
        pending = self.state is State.PENDING
        return {
            "pk": _pk(self.user_id), "sk": self.sk, "user": self.user_id,
            "rid": self.request_id, "nonce": self.nonce, "state": str(self.state),
            "reserved": self.reserved, "kept": self.kept,
            "legs": [{"g": leg.grant, "n": leg.tokens} for leg in self.legs],
            "back": [{"g": b.grant, "returned": b.returned, "forfeited": b.forfeited}
                     for b in self.back],
            "route": self.route, "plan": self.plan, "idem": self.idem,
            "created_ms": self.created_ms, "hold_ms": self.hold_ms, "done_ms": self.done_ms,
            "reversed_ms": self.reversed_ms,
            "ttl": self.created_ms // 1000 + TRANSFER_DAYS * 86400,
            "pend_pk": pending_shard(self.user_id) if pending else None,
            "pend_sk": f"{self.hold_ms:013d}#{self.user_id}#{self.sk}" if pending else None,
        }

    @classmethod
    def of(cls, item: Mapping[str, Any]) -> Transfer:
        """A transfer from its stored item (the pair of ``item``: the invariant is
        checked again on the way in)."""
        def opt(name: str) -> int | None:
            return None if item.get(name) is None else int(item[name])

        return cls(
            user_id=str(item["user"]), request_id=str(item["rid"]), nonce=str(item["nonce"]),
            state=State(item["state"]), reserved=int(item["reserved"]),
            kept=int(item.get("kept", 0)),
            legs=tuple(Leg(str(x["g"]), int(x["n"])) for x in item.get("legs") or ()),
            back=tuple(Back(str(x["g"]), int(x.get("returned", 0)), int(x.get("forfeited", 0)))
                       for x in item.get("back") or ()),
            route=str(item.get("route", "")), plan=str(item.get("plan", "")),
            idem=None if item.get("idem") is None else str(item["idem"]),
            created_ms=int(item.get("created_ms", 0)), hold_ms=int(item.get("hold_ms", 0)),
            done_ms=opt("done_ms"), reversed_ms=opt("reversed_ms"))


@dataclass(frozen=True)
class Answer:
    """What one call of the book did.

    Attributes:
        result: ``applied`` or ``exists`` (done), else why not (``transfers.Result``).
        transfer: the transfer as it now stands (None: no item).
        moved: the credit this call gave back (a post below ``reserved``, a void, a
            reversal), per grant; () when it gave nothing back or wrote nothing.
        credit: the credit spendable after the call as the book last read it (set when a
            reservation is refused for ``exceeds_credit``; else None).
        grants: the grants the call re-read (a stale hint), else ().
    """

    result: Result
    transfer: Transfer | None
    moved: tuple[Back, ...] = ()
    credit: int | None = None
    grants: tuple[Grant, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when what was asked for has happened."""
        return self.result.ok


class _Retry(Exception):  # noqa: N818  (internal signal)
    """The write lost a race; read again and re-decide."""


class TransferBook(DynamoTable):
    """Transfers and the grants they draw on, in the entitlements table.

    Args:
        settings: where the table is (default: from the environment).
        client: a boto3 DynamoDB client to use instead of making one.

    Every method raises ``StoreUnavailable`` when DynamoDB cannot be reached or refuses
    (whether a write landed is then unknown: every call is safe to send again), and
    ``InvalidArgument`` for bad input, before anything is written.
    """

    def __init__(self, settings: StoreSettings | None = None, *, client: Any = None) -> None:
        self.settings = settings or store_settings()
        super().__init__(self.settings, client, name="entitlements", passthrough=frozenset(
            {"TransactionCanceledException", "ConditionalCheckFailedException"}))

    # --- reads ------------------------------------------------------------------------------

    def get(self, user_id: str, request_id: str, nonce: str) -> Transfer | None:
        """One transfer, strongly read, or None."""
        key = {"pk": _pk(user_id), "sk": transfer_sk(_check_request_id(request_id),
                                                     check_nonce(nonce))}
        reply = self._call(self.client.get_item, TableName=self.table, Key=self._ser(key),
                           ConsistentRead=True)
        return Transfer.of(self._de(reply["Item"])) if reply.get("Item") else None

    def transfers(self, user_id: str, request_id: str | None = None) -> list[Transfer]:
        """The user's transfers (of one request id when given), by sort key."""
        prefix = TRANSFER_PREFIX if request_id is None else \
            transfer_sk(_check_request_id(request_id), "")
        out = [Transfer.of(i) for i in self._query(_pk(user_id), prefix)]
        return [t for t in out if request_id is None or t.request_id == request_id]

    def grants(self, user_id: str) -> tuple[Grant, ...]:
        """Every grant of the user, strongly read (one Query)."""
        return tuple(_grant(i) for i in self._query(_pk(user_id), "E#G#"))

    def abandoned(self, shard: int, now_ms: int, *, user_id: str | None = None,
                  limit: int = 100) -> list[tuple[str, str, str]]:
        """(user, request id, nonce) of pending transfers past their hold in one shard of
        the ``pending`` index (eventually consistent: a hold ended moments ago may be
        missing; the sweep's bound allows for it), of one user when given; at most
        ``limit``, oldest hold first, reading at most ``MAX_PAGES`` pages."""
        kwargs: dict[str, Any] = {
            "TableName": self.table, "IndexName": PENDING_INDEX, "Limit": limit,
            "KeyConditionExpression": "pend_pk = :s AND pend_sk < :t",
            "ExpressionAttributeValues": self._ser(
                {":s": f"PEND#{shard}", ":t": f"{now_ms:013d}#",
                 **({":u": _pk(user_id)} if user_id is not None else {})})}
        if user_id is not None:
            kwargs["FilterExpression"] = "pk = :u"
        out: list[tuple[str, str, str]] = []
        for _ in range(MAX_PAGES):  # a filter applies after Limit: a page may hold none
            reply = self._call(self.client.query, **kwargs)
            for raw in reply.get("Items", []):
                item = self._de(raw)
                user = str(item["pk"])[2:]
                rid, _, nonce = str(item["sk"])[len(TRANSFER_PREFIX):].rpartition("#")
                out.append((user, rid, nonce))
            if len(out) >= limit or "LastEvaluatedKey" not in reply:
                break
            kwargs["ExclusiveStartKey"] = reply["LastEvaluatedKey"]
        return out[:limit]

    def _query(self, pk: str, prefix: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {
            "TableName": self.table, "ConsistentRead": True,
            "KeyConditionExpression": "pk = :pk AND begins_with(sk, :p)",
            "ExpressionAttributeValues": self._ser({":pk": pk, ":p": prefix})}
        while True:
            reply = self._call(self.client.query, **kwargs)
            items.extend(self._de(i) for i in reply.get("Items", []))
            if "LastEvaluatedKey" not in reply:
                return items
            kwargs["ExclusiveStartKey"] = reply["LastEvaluatedKey"]

    # --- reserve ----------------------------------------------------------------------------

    def reserve(self, user_id: str, request_id: str, nonce: str, *, reserved: int,
                credit: int, hold_ms: int, route: str = "", plan: str = "",
                idem: str | None = None, grants: Sequence[Grant] | None = None,
                now_ms: int | None = None) -> Answer:
        """Make the transfer pending with legs for ``credit`` tokens, in one transaction.

        Args:
            reserved: the charge's whole cost, tokens.
            credit: the part of it drawn from grants (0: a quota-only transfer, one write).
            hold_ms: until when the request may post (ms since the epoch).
            grants: the grants as a hint says they stand (None: read them). A stale hint
                costs one refused write and one re-read, never a wrong draw.

        Returns:
            ``applied`` (made now), ``exists`` (made by an earlier send of this call),
            ``exceeds_credit`` (the live grants hold less than ``credit``: nothing written;
            ``credit`` on the answer is what they hold), or the refusal of
            ``transfers.apply`` (``already_voided``: a void came first; ``expired``: an
            earlier send landed and its hold has ended, now voided).
        """
        _check_tokens(reserved, "reserved")
        if _check_tokens(credit, "credit") > reserved:
            raise InvalidArgument("credit cannot exceed reserved")
        now = _now_ms() if now_ms is None else now_ms
        base = Transfer(user_id, _check_request_id(request_id), check_nonce(nonce),
                        State.PENDING, reserved, route=route, plan=plan, idem=idem,
                        created_ms=now, hold_ms=hold_ms)
        fresh = grants is None and credit > 0
        known = tuple(self.grants(user_id)) if fresh else tuple(grants or ())
        for attempt in range(ATTEMPTS):
            legs = plan_legs(known, credit, now) if credit else ()
            if drawn(legs) < credit:
                if not fresh:
                    known, fresh = self.grants(user_id), True
                    continue
                if self.get(user_id, request_id, nonce) is not None:
                    # an earlier send of this very call landed (its answer was lost): the
                    # credit it took is what is missing now
                    return self._settle(user_id, request_id, nonce, Event.RESERVE, now)
                return Answer(Result.EXCEEDS_CREDIT, None, credit=balance(known, now),
                              grants=known)
            transfer = replace(base, legs=legs)
            items = [self._put(transfer), *self._takes(transfer, known, now)]
            try:
                self._write(items, attempt)
            except _Retry as lost:
                index = lost.args[0]
                if index == 0:  # the item exists: an earlier send, or a void first
                    return self._settle(user_id, request_id, nonce, Event.RESERVE, now)
                if index is not None:  # a leg's grant holds less than the hint said
                    known, fresh = self.grants(user_id), True
                continue
            return Answer(Result.APPLIED, transfer, grants=known if fresh else ())
        raise StoreUnavailable("the reservation kept conflicting with other writes")

    # --- resolve ----------------------------------------------------------------------------

    def post(self, transfer: Transfer, kept: int, *, now_ms: int | None = None) -> Answer:
        """Post a pending transfer keeping ``kept`` tokens (``<= reserved``); the credit
        of the difference (at most what it drew) goes back, last leg first.

        Returns:
            ``applied``, ``exists`` (posted already), or a refusal: ``expired`` (its hold
            ended: it is voided now, its credit back), ``already_voided``, ``not_found``.
        """
        if _check_tokens(kept, "kept") > transfer.reserved:
            raise InvalidArgument("kept cannot exceed reserved")
        return self.resolve(transfer.user_id, transfer.request_id, transfer.nonce, Event.POST,
                            kept=kept, known=transfer, now_ms=now_ms)

    def void(self, user_id: str, request_id: str, nonce: str, *,
             known: Transfer | None = None, now_ms: int | None = None) -> Answer:
        """Void a transfer: every leg returns (or is forfeited). With no item, a voided
        stub is written, so a reservation of it still on its way can never land.

        Args:
            known: the transfer as the caller last saw it (saves a read; a stale one
                costs one refused write and a read).

        Returns:
            ``applied``, ``exists`` (voided already) or ``already_posted`` /
            ``already_reversed``.
        """
        return self.resolve(user_id, request_id, nonce, Event.VOID, known=known, now_ms=now_ms)

    def reverse(self, user_id: str, request_id: str, nonce: str, *,
                extra: ExtraItems | None = None, now_ms: int | None = None) -> Answer:
        """Reverse a posted transfer (support): what it still draws returns to its grants;
        ``extra`` items (an audit entry) commit with it.

        Returns:
            ``applied``, ``exists`` (reversed already), ``not_posted``, ``not_found``,
            ``already_voided`` or ``expired`` (pending past its hold: voided now).

        Raises:
            ExtraRefused: an ``extra`` item's condition failed; nothing was written.
        """
        return self.resolve(user_id, request_id, nonce, Event.REVERSE, extra=extra,
                            now_ms=now_ms)

    def resolve_abandoned(self, user_id: str, request_id: str, nonce: str, *,
                          now_ms: int | None = None) -> Answer:
        """Void the transfer if it is pending past its hold (the user's next request, the
        sweep, support). Answers ``applied`` when this call voided it, ``exists`` when it
        was voided already, ``not_found``, or the state it stands in otherwise."""
        now = _now_ms() if now_ms is None else now_ms
        found = self.get(user_id, request_id, nonce)
        if found is None:
            return Answer(Result.NOT_FOUND, None)
        if found.abandoned(now) or found.state is State.VOIDED:
            return self.resolve(user_id, request_id, nonce, Event.VOID, known=found,
                                now_ms=now)
        return Answer(Result.EXISTS if found.state is not State.PENDING else
                      Result.NOT_POSTED, found)

    def sweep(self, now_ms: int | None = None, *, limit: int = 100) -> int:
        """Void every pending transfer past its hold that the ``pending`` index shows in
        any shard (at most ``limit`` per shard per call). Returns how many it voided."""
        now = _now_ms() if now_ms is None else now_ms
        voided = 0
        for shard in range(PENDING_SHARDS):
            for user, rid, nonce in self.abandoned(shard, now, limit=limit):
                voided += self.resolve_abandoned(user, rid, nonce, now_ms=now).result \
                    is Result.APPLIED
        return voided

    def resolve(self, user_id: str, request_id: str, nonce: str, event: Event, *,
                kept: int = 0, known: Transfer | None = None,
                extra: ExtraItems | None = None, now_ms: int | None = None) -> Answer:
        """Apply ``event`` (post, void, reverse) to a transfer: the one function that moves
        a transfer out of where it stands (TigerBeetle's post_or_void_pending_transfer).

        Reads the item unless ``known``; looks the transition up (``transfers.apply``);
        writes it conditioned on the source state and hold, with the grant returns in the
        same transaction. A lost race re-reads and re-decides; re-applying what happened
        answers ``exists``.
        """
        now = _now_ms() if now_ms is None else now_ms
        current = self.get(user_id, request_id, nonce) if known is None else known
        forfeit: set[str] = set()
        for attempt in range(ATTEMPTS):
            row = apply(None if current is None else current.state, event,
                        abandoned=current is not None and current.abandoned(now))
            if not row.writes:
                return Answer(row.result, current)
            moves = self._moves(current, row.target, kept)
            moved = tuple(Back(g, 0 if g in forfeit else n, n if g in forfeit else 0)
                          for g, n in ((m.grant, m.tokens) for m in moves))
            after = self._after(current, row, user_id, request_id, nonce, kept, moved, now)
            items = [self._transition(current, after, row, now),
                     *self._returns(after, moved, now)]
            first_extra = len(items)
            if extra is not None:
                items += extra(moved)
            try:
                self._write(items, attempt)
            except _Retry as lost:
                index = lost.args[0]
                if index is not None and 0 < index < first_extra:
                    # that grant was voided or expired since: its part is forfeited
                    forfeit.add([m.grant for m in moved if m.returned > 0][index - 1])
                    continue
                if index is not None and index >= first_extra:
                    raise ExtraRefused(index - first_extra) from None
                current = self.get(user_id, request_id, nonce)  # the state moved: re-decide
                continue
            return Answer(row.result, after, moved)
        raise StoreUnavailable("the transfer kept conflicting with other writes")

    def _settle(self, user_id: str, request_id: str, nonce: str, event: Event,
                now: int) -> Answer:
        """The answer to a reservation whose item already exists."""
        current = self.get(user_id, request_id, nonce)
        row = apply(None if current is None else current.state, event,
                    abandoned=current is not None and current.abandoned(now))
        if row.writes and row.target is State.VOIDED:
            voided = self.resolve(user_id, request_id, nonce, Event.VOID, known=current,
                                  now_ms=now)
            return Answer(row.result, voided.transfer, voided.moved)
        return Answer(row.result, current)

    # --- writes -----------------------------------------------------------------------------

    @staticmethod
    def _moves(current: Transfer | None, target: State | None, kept: int) -> tuple[Leg, ...]:
        """The credit a transition gives back: to posted, the part of ``reserved - kept``
        that is credit; to voided or reversed, everything still drawn."""
        if current is None:
            return ()
        if target is State.POSTED:
            return give_back(current.legs, current.back, current.reserved - kept)
        return give_back(current.legs, current.back, current.credit_standing)

    @staticmethod
    def _after(current: Transfer | None, row: Transition, user_id: str, request_id: str,
               nonce: str, kept: int, moved: tuple[Back, ...], now: int) -> Transfer:
        """The transfer as the transition leaves it."""
        if current is None:  # a void of nothing: the stub that keeps a late reserve out
            return Transfer(user_id, request_id, nonce, State.VOIDED, 0, created_ms=now,
                            hold_ms=now, done_ms=now)
        target = row.target or current.state
        return replace(
            current, state=target, back=merge_back(current.back, moved),
            kept=kept if target is State.POSTED else 0 if target is not State.REVERSED
            else current.kept,
            done_ms=now if current.state is State.PENDING else current.done_ms,
            reversed_ms=now if target is State.REVERSED else current.reversed_ms)

    def _transition(self, current: Transfer | None, after: Transfer, row: Transition,
                    now: int) -> dict[str, Any]:
        """The item's write, conditioned on the row's source state and hold."""
        if current is None:
            return self._put(after)
        names = {"#s": "state", "#k": "kept", "#b": "back"}  # reserved words among them
        values: dict[str, Any] = {":from": str(row.source), ":to": str(after.state),
                                  ":kept": after.kept, ":back": after.item()["back"]}
        sets = ["#s = :to", "#k = :kept", "#b = :back"]
        for name in ("done_ms", "reversed_ms"):
            if getattr(after, name) is not None:
                sets.append(f"{name} = :{name}")
                values[f":{name}"] = getattr(after, name)
        condition = "#s = :from"
        if row.hold != "any":
            condition += " AND hold_ms > :now" if row.hold == "live" else " AND hold_ms <= :now"
            values[":now"] = now
        update = "SET " + ", ".join(sets)
        if row.source is State.PENDING:
            update += " REMOVE pend_pk, pend_sk"
        return {"Update": {"TableName": self.table,
                           "Key": self._ser({"pk": _pk(after.user_id), "sk": after.sk}),
                           "ConditionExpression": condition, "UpdateExpression": update,
                           "ExpressionAttributeNames": names,
                           "ExpressionAttributeValues": self._ser(values)}}

    def _put(self, transfer: Transfer) -> dict[str, Any]:
        """Create the item once (an Update, so the functions need no PutItem)."""
        item = {k: v for k, v in transfer.item().items() if v is not None and k not in
                ("pk", "sk")}
        return {"Update": {
            "TableName": self.table,
            "Key": self._ser({"pk": _pk(transfer.user_id), "sk": transfer.sk}),
            "ConditionExpression": "attribute_not_exists(pk)",
            "UpdateExpression": "SET " + ", ".join(f"#{k} = :{k}" for k in item),
            "ExpressionAttributeNames": {f"#{k}": k for k in item},
            "ExpressionAttributeValues": self._ser({f":{k}": v for k, v in item.items()})}}

    def _takes(self, transfer: Transfer, grants: Sequence[Grant],
               now: int) -> list[dict[str, Any]]:
        """One leg each: ``ADD consumed :n`` on a live grant with ``consumed <= :cap``."""
        tokens = {g.reference: g.tokens for g in grants}
        return [self._grant_update(transfer.user_id, leg.grant, leg.tokens, now,
                                   cap=tokens[leg.grant] - leg.tokens)
                for leg in transfer.legs]

    def _returns(self, after: Transfer, moved: tuple[Back, ...],
                 now: int) -> list[dict[str, Any]]:
        """``ADD consumed -n`` on each live grant that gets credit back."""
        return [self._grant_update(after.user_id, m.grant, -m.returned, now)
                for m in moved if m.returned > 0]

    def _grant_update(self, user_id: str, reference: str, tokens: int, now: int, *,
                      cap: int | None = None) -> dict[str, Any]:
        values: dict[str, Any] = {":n": tokens, ":now": now}
        condition = ("attribute_exists(pk) AND attribute_not_exists(void_at) AND "
                     "(attribute_not_exists(expires_at) OR expires_at > :now)")
        if cap is not None:  # never overdrawn: the one place this is enforced
            condition += " AND (attribute_not_exists(#c) OR #c <= :cap)"
            values[":cap"] = cap
        return {"Update": {
            "TableName": self.table,
            "Key": self._ser({"pk": _pk(user_id), "sk": "E#G#" + reference}),
            "ConditionExpression": condition, "UpdateExpression": "ADD #c :n",
            "ExpressionAttributeNames": {"#c": "consumed"},
            "ExpressionAttributeValues": self._ser(values)}}

    def _write(self, items: list[dict[str, Any]], attempt: int) -> None:
        """Send ``items`` (one Update alone, else one transaction).

        Raises:
            _Retry: a condition failed (``args[0]``: the first failing item's index) or a
                transaction conflict to retry after a backoff (``args[0]`` None).
            StoreUnavailable: DynamoDB failed or kept conflicting.
        """
        from botocore.exceptions import ClientError

        try:
            if len(items) == 1:
                self._call(self.client.update_item, **items[0]["Update"])
            else:
                self._call(self.client.transact_write_items, TransactItems=items)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code == "ConditionalCheckFailedException":
                raise _Retry(0) from exc
            reasons = exc.response.get("CancellationReasons") or []
            codes = [r.get("Code") for r in reasons]
            if "ConditionalCheckFailed" in codes:
                raise _Retry(codes.index("ConditionalCheckFailed")) from exc
            if "TransactionConflict" in codes and attempt + 1 < ATTEMPTS:
                time.sleep(0.01 * 2 ** min(attempt, 4))
                raise _Retry(None) from exc
            raise StoreUnavailable(f"the entitlements store refused a transfer: "
                                   f"{codes or code}") from exc


__all__ = ["ATTEMPTS", "PENDING_INDEX", "PENDING_SHARDS", "TRANSFER_DAYS", "TRANSFER_PREFIX",
           "Answer", "ExtraItems", "Transfer", "TransferBook", "pending_shard", "shard_of",
           "transfer_sk"]
