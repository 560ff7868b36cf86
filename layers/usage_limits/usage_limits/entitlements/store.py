"""The durable record of plan overrides, grants, suspensions and operator actions: DynamoDB.

One table, on-demand, point-in-time recovery on (template.yaml ``EntitlementsTable``)::

    pk          sk                         item
    U#<user>    E#PLAN                     the plan override
    U#<user>    E#SUSP                     the suspension
    U#<user>    E#G#<reference>            a grant (tokens, consumed, kind, expiry, voided;
                                           expired_at, forfeited once seen expired unused,
                                           expired_by: the token of the call that did)
    U#<user>    E#LOAD                     the load epoch: raised by every load of the cache
                                           and every operator change
    U#<user>    C#<request id>#<nonce>     one charge's credit: drawn, returned, forfeited
                                           (``charges``; made durable before its provider
                                           is called)
    U#<user>    R#<request id>             a support refund of one charge (at most once)
    U#<user>    A#<ms, 13 digits>#<id>     an operator action (audit), newest last
    GSI ``audit`` (sparse: only audit items carry its keys)
    AUDIT       <ms, 13 digits>#<id>       every operator action, across users
    GSI ``expiry`` (sparse, keys only: only grants with an expiry carry ``gx_hour``)
    <UTC hour>  <expires_at, ms>           a grant by its expiry hour (``YYYY-MM-DDTHH``),
                                           for the auditor's expiry sweep

Everything the hot path needs about a user sits under ``E#``, so loading it is one Query.

Draws are made in the cache (the reservation script) and then recorded here in one
transaction that also checks the load epoch: a draw made under an epoch that a later load
has replaced can never commit (its credit would be counted twice: once by the load, which
did not see it, and once by the commit); the caller moves it onto the new copy and tries
again. Credit given back is conditioned on the charge's own record, never on the epoch:
every movement of credit is a record here, and the cache's copy is derived from them.
Every operator change is written in one transaction with its audit item: an action is
recorded exactly when it happened. A grant's creation is a conditional put on its reference, so the
same reference never makes a second grant, however often it is retried.

boto3 is imported on first use, never at module import (cold start).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import snapstart
from ..exceptions import InvalidArgument
from .charges import (
    CHARGE_PREFIX,
    ChargeRecord,
    DrawOutcome,
    Pairs,
    charge_sk,
    check_nonce,
    check_pairs,
    decode_pairs,
    encode_pairs,
    merged,
    record_of,
    split_return,
    totals,
)
from .config import StoreSettings, store_settings
from .dynamo import DynamoTable
from .exceptions import GrantConflict, NotFound, StoreUnavailable
from .models import (
    GRANT_KINDS,
    MAX_GRANT_TOKENS,
    AuditEntry,
    Change,
    Grant,
    PlanOverride,
    SupportRefund,
    Suspension,
    UserEntitlements,
    check_reason,
    check_reference,
)

#: The audit index and its key attributes.
AUDIT_INDEX = "audit"
AUDIT_PARTITION = "AUDIT"
#: The expiry index: grants with an expiry by the UTC hour of it (``gx_hour``) and the
#: expiry itself (``expires_at``, ms). Its own index rather than the audit index: that one
#: projects every attribute, so each draw's update of ``consumed`` would be written to it
#: too; this one holds keys only, which a grant's later updates never change, so only the
#: grant's creation writes it. Grants created before it existed carry no ``gx_hour``
#: (the load path still records their expiry). The grants of one expiry hour share one
#: index partition: creating more than about a thousand a second with the same expiry
#: hour would be throttled by the index (not sharded: grants are made one by one).
EXPIRY_INDEX = "expiry"
EXPIRY_HOUR_ATTR = "gx_hour"
#: Default and largest number of audit entries returned at once.
DEFAULT_AUDIT = 50
MAX_AUDIT = 500

#: The attribute DynamoDB's time to live reads (epoch seconds), as template.yaml declares it.
#: Only charge records carry it: grants, suspensions, overrides, refunds and the audit log
#: stay.
TTL_ATTRIBUTE = "ttl"
#: How long a charge's credit record is kept, days: over a year keeps a yearly audit of
#: where each grant's tokens went. A grant older than that may count consumption whose
#: records are gone (the auditor allows for it).
DRAW_RECORD_DAYS = 400

#: The table's key schema, as template.yaml declares it (a test keeps the two in step).
TABLE_DEFINITION: dict[str, Any] = {
    "AttributeDefinitions": [
        {"AttributeName": "pk", "AttributeType": "S"},
        {"AttributeName": "sk", "AttributeType": "S"},
        {"AttributeName": "gsi1pk", "AttributeType": "S"},
        {"AttributeName": "gsi1sk", "AttributeType": "S"},
        {"AttributeName": EXPIRY_HOUR_ATTR, "AttributeType": "S"},
        {"AttributeName": "expires_at", "AttributeType": "N"},
        {"AttributeName": "pend_pk", "AttributeType": "S"},
        {"AttributeName": "pend_sk", "AttributeType": "S"},
    ],
    "KeySchema": [
        {"AttributeName": "pk", "KeyType": "HASH"},
        {"AttributeName": "sk", "KeyType": "RANGE"},
    ],
    "GlobalSecondaryIndexes": [{
        "IndexName": AUDIT_INDEX,
        "KeySchema": [
            {"AttributeName": "gsi1pk", "KeyType": "HASH"},
            {"AttributeName": "gsi1sk", "KeyType": "RANGE"},
        ],
        "Projection": {"ProjectionType": "ALL"},
    }, {
        "IndexName": EXPIRY_INDEX,
        "KeySchema": [
            {"AttributeName": EXPIRY_HOUR_ATTR, "KeyType": "HASH"},
            {"AttributeName": "expires_at", "KeyType": "RANGE"},
        ],
        "Projection": {"ProjectionType": "KEYS_ONLY"},
    }, {
        # pending transfers only (sparse: a transition out of pending removes its keys), by
        # hold, for the sweep of abandoned ones (usage_limits/credit/book.py)
        "IndexName": "pending",
        "KeySchema": [
            {"AttributeName": "pend_pk", "KeyType": "HASH"},
            {"AttributeName": "pend_sk", "KeyType": "RANGE"},
        ],
        "Projection": {"ProjectionType": "KEYS_ONLY"},
    }],
    "BillingMode": "PAY_PER_REQUEST",
}

_PLAN_SK = "E#PLAN"
_SUSP_SK = "E#SUSP"
_GRANT = "E#G#"
_LOAD_SK = "E#LOAD"
_REFUND = "R#"
#: Attempts of a draw or return transaction that DynamoDB cancels for a conflict with
#: another transaction on the same grant.
_CONFLICT_ATTEMPTS = 4
#: Attempts of a return: conflicts, a record lowered meanwhile, and one more per grant that
#: turns out voided or expired (each forfeits its part and tries again).
_RETURN_ATTEMPTS = 8
#: The grant attributes that keep its credit reports (once-only events), ms when made.
_FLAG_ATTRS = {"l": "low_at", "x": "exhausted_at"}
_AUDIT = "A#"
_MAX_USER_ID = 256



def _pk(user_id: str) -> str:
    if not isinstance(user_id, str) or not 0 < len(user_id) <= _MAX_USER_ID \
            or not user_id.isprintable():
        raise InvalidArgument(f"user id must be 1 to {_MAX_USER_ID} printable characters")
    return "U#" + user_id


def _check_request_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not 0 < len(request_id) <= _MAX_USER_ID \
            or not request_id.isprintable():
        raise InvalidArgument(f"request_id must be 1 to {_MAX_USER_ID} printable characters")
    return request_id


def expiry_hour(ms: int) -> str:
    """The expiry index's partition of an instant: its UTC hour, ``YYYY-MM-DDTHH``."""
    return time.strftime("%Y-%m-%dT%H", time.gmtime(ms // 1000))


def _now_ms() -> int:
    return int(time.time() * 1000)


def _record_ttl() -> int:
    return int(time.time()) + DRAW_RECORD_DAYS * 86400


def _cancel_codes(exc: Any) -> list[str | None]:
    """The codes of a cancelled transaction, one per item (None for an item that passed)."""
    reasons = exc.response.get("CancellationReasons") or []
    return [r.get("Code") if r.get("Code") != "None" else None for r in reasons]


def _cancelled(op: str, codes: list[str | None], exc: Any) -> StoreUnavailable:
    """The error of a transaction DynamoDB cancelled or refused for good."""
    return StoreUnavailable(f"the entitlements store cancelled a {op}: "
                            f"{codes or exc.response.get('Error', {}).get('Code')}")


class ExtraConditionFailed(Exception):  # noqa: N818  (internal signal, not a public error)
    """An extra item of a return failed its condition (``index`` among the extra items)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


#: Makes the extra transaction items of a return, given what it returns and forfeits.
ExtraItems = Callable[[Pairs, Pairs], list[dict[str, Any]]]


@dataclass(frozen=True)
class CreditReturn:
    """What ``EntitlementStore.return_credit`` did.

    Attributes:
        changed: this call lowered the record (or wrote the tombstone of a charge that had
            none); False when it was at or below the new cost already.
        existed: a draw of the charge is recorded (False: none, a tombstone now).
        returned: (reference, tokens) given back to grants by this call, reverse draw
            order.
        forfeited: (reference, tokens) this call took off the charge whose grant had
            expired or been voided: still consumed.
        record: the record after the call (None for a tombstone written now).
    """

    changed: bool
    existed: bool
    returned: Pairs = ()
    forfeited: Pairs = ()
    record: ChargeRecord | None = None


def _change(item: Mapping[str, Any], prefix: str = "") -> Change:
    return Change(actor=str(item[prefix + "actor"]), reason=str(item[prefix + "reason"]),
                  at_ms=int(item[prefix + "at"]))


def _change_attrs(change: Change, prefix: str = "") -> dict[str, Any]:
    return {prefix + "actor": change.actor, prefix + "reason": change.reason,
            prefix + "at": change.at_ms}


def _grant(item: Mapping[str, Any]) -> Grant:
    expires = item.get("expires_at")
    return Grant(reference=str(item["reference"]), tokens=int(item["tokens"]),
                 consumed=int(item.get("consumed", 0)), kind=item["kind"],
                 expires_at_ms=None if expires is None else int(expires),
                 created=_change(item),
                 voided=_change(item, "void_") if "void_at" in item else None,
                 reported="".join(f for f, attr in _FLAG_ATTRS.items() if attr in item),
                 expired_at_ms=int(item["expired_at"]) if "expired_at" in item else None,
                 forfeited=int(item["forfeited"]) if "forfeited" in item else None)


def _support_refund(request_id: str, item: Mapping[str, Any]) -> SupportRefund:
    tokens = item.get("tokens")
    return SupportRefund(request_id, int(item.get("claimed", 0)),
                         None if tokens is None else int(tokens), _change(item),
                         str(item.get("nonce", "")), decode_pairs(item.get("credit")),
                         decode_pairs(item.get("lost")))


def _suspension(item: Mapping[str, Any]) -> Suspension:
    until = item.get("until")
    return Suspension(reason=str(item["reason"]), until_ms=None if until is None else int(until),
                      change=_change(item))


class EntitlementStore(DynamoTable):
    """Plan overrides, grants, suspensions and the audit log in one DynamoDB table.

    Args:
        settings: where the table is (default: from the environment).
        client: a boto3 DynamoDB client to use instead of making one (tests, custom wiring).

    Every method raises ``StoreUnavailable`` when DynamoDB cannot be reached or refuses the
    call, and ``InvalidArgument`` for bad input (before anything is written).
    """

    def __init__(self, settings: StoreSettings | None = None, *, client: Any = None) -> None:
        self.settings = settings or store_settings()
        super().__init__(self.settings, client, name="entitlements", passthrough=frozenset(
            {"TransactionCanceledException", "ConditionalCheckFailedException"}))

    # --- plumbing ---------------------------------------------------------------------------

    def _get(self, user_id: str, sk: str) -> dict[str, Any] | None:
        reply = self._call(self.client.get_item, TableName=self.table,
                           Key=self._ser({"pk": _pk(user_id), "sk": sk}), ConsistentRead=True)
        item = reply.get("Item")
        return self._de(item) if item else None

    def _audit_put(self, user_id: str, action: str, change: Change,
                   details: Mapping[str, Any]) -> dict[str, Any]:
        suffix = f"{change.at_ms:013d}#{uuid.uuid4().hex[:12]}"
        item = {"pk": _pk(user_id), "sk": _AUDIT + suffix, "gsi1pk": AUDIT_PARTITION,
                "gsi1sk": suffix, "user_id": user_id, "action": action,
                "details": json.dumps(dict(details), sort_keys=True),
                **_change_attrs(change)}
        return {"Put": {"TableName": self.table, "Item": self._ser(item)}}

    def _transact(self, items: list[dict[str, Any]]) -> bool:
        """Write ``items`` in one transaction; False when the first item's condition failed.

        Raises:
            StoreUnavailable: DynamoDB failed, or another item's condition failed.
        """
        from botocore.exceptions import ClientError

        try:
            self._call(self.client.transact_write_items, TransactItems=items)
        except ClientError as exc:
            reasons = exc.response.get("CancellationReasons") or []
            if reasons and reasons[0].get("Code") == "ConditionalCheckFailed":
                return False
            raise StoreUnavailable("the entitlements store cancelled a write: "
                                   f"{[r.get('Code') for r in reasons]}") from exc
        return True

    # --- reads ------------------------------------------------------------------------------

    def load(self, user_id: str) -> UserEntitlements:
        """Everything the hot path needs about a user, in one strongly consistent Query.

        A user never seen gets an empty record.
        """
        items = self._query_prefix(user_id, "E#")
        override = suspension = None
        grants = []
        for item in items:
            if item["sk"] == _PLAN_SK:
                override = PlanOverride(plan=str(item["plan"]), change=_change(item))
            elif item["sk"] == _SUSP_SK:
                suspension = _suspension(item)
            elif item["sk"].startswith(_GRANT):
                grants.append(_grant(item))
        grants.sort(key=lambda g: (g.created.at_ms, g.reference))
        return UserEntitlements(user_id, override, suspension, tuple(grants))

    def grant(self, user_id: str, reference: str) -> Grant | None:
        """One grant by its reference, or None."""
        item = self._get(user_id, _GRANT + check_reference(reference))
        return _grant(item) if item else None

    def audit(self, user_id: str | None = None, *, limit: int = DEFAULT_AUDIT) -> list[AuditEntry]:
        """Operator actions, newest first: one user's, or everyone's when ``user_id`` is None.

        Raises:
            InvalidArgument: ``limit`` is not 1..``MAX_AUDIT``.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_AUDIT:
            raise InvalidArgument(f"limit must be 1 to {MAX_AUDIT}")
        if user_id is None:
            kwargs: dict[str, Any] = {
                "IndexName": AUDIT_INDEX, "KeyConditionExpression": "gsi1pk = :p",
                "ExpressionAttributeValues": self._ser({":p": AUDIT_PARTITION})}
        else:
            kwargs = {"ConsistentRead": True,
                      "KeyConditionExpression": "pk = :pk AND begins_with(sk, :a)",
                      "ExpressionAttributeValues": self._ser({":pk": _pk(user_id),
                                                              ":a": _AUDIT})}
        reply = self._call(self.client.query, TableName=self.table, ScanIndexForward=False,
                           Limit=limit, **kwargs)
        out = []
        for raw in reply.get("Items", []):
            item = self._de(raw)
            out.append(AuditEntry(user_id=str(item["user_id"]), action=str(item["action"]),
                                  change=_change(item),
                                  details=json.loads(item.get("details") or "{}")))
        return out

    # --- plan override ----------------------------------------------------------------------

    def set_override(self, user_id: str, plan: str, *, actor: str, reason: str,
                     now_ms: int | None = None) -> PlanOverride:
        """Give a user a plan of the operator's choice (replacing any earlier override).

        The caller checks that ``plan`` names a plan of the deployment.
        """
        change = Change(actor, check_reason(reason), now_ms or _now_ms())
        item = {"pk": _pk(user_id), "sk": _PLAN_SK, "plan": plan, **_change_attrs(change)}
        self._transact([{"Put": {"TableName": self.table, "Item": self._ser(item)}},
                        self._audit_put(user_id, "plan.set", change, {"plan": plan})])
        return PlanOverride(plan, change)

    def clear_override(self, user_id: str, *, actor: str, reason: str,
                       now_ms: int | None = None) -> PlanOverride | None:
        """Remove a user's override; returns the one removed (None: there was none, and
        nothing is written or audited)."""
        change = Change(actor, check_reason(reason), now_ms or _now_ms())
        current = self._get(user_id, _PLAN_SK)
        if current is None:
            return None
        removed = PlanOverride(str(current["plan"]), _change(current))
        done = self._transact([
            {"Delete": {"TableName": self.table,
                        "Key": self._ser({"pk": _pk(user_id), "sk": _PLAN_SK}),
                        "ConditionExpression": "attribute_exists(pk)"}},
            self._audit_put(user_id, "plan.clear", change, {"plan": removed.plan})])
        return removed if done else None

    # --- grants -----------------------------------------------------------------------------

    def create_grant(self, user_id: str, *, tokens: int, kind: str, reference: str,
                     expires_at_ms: int | None, actor: str, reason: str,
                     now_ms: int | None = None) -> tuple[Grant, bool]:
        """Create a grant, once per reference.

        Returns:
            The grant and True when this call created it; the existing grant and False when
            the reference was used before with the same terms (a retry).

        Raises:
            InvalidArgument: tokens not 1..10**12, an unknown kind, a bad reference, or an
                expiry that is not in the future.
            GrantConflict: the reference was used before with other terms (nothing is
                written: a top-up is a new grant with a new reference).
        """
        now = now_ms or _now_ms()
        change = Change(actor, check_reason(reason), now)
        check_reference(reference)
        if isinstance(tokens, bool) or not isinstance(tokens, int) \
                or not 0 < tokens <= MAX_GRANT_TOKENS:
            raise InvalidArgument(f"tokens must be a whole number from 1 to {MAX_GRANT_TOKENS}")
        if kind not in GRANT_KINDS:
            raise InvalidArgument(f"kind must be one of {', '.join(GRANT_KINDS)}")
        if expires_at_ms is not None and expires_at_ms <= now:
            raise InvalidArgument("expires_at must be in the future")
        item = {"pk": _pk(user_id), "sk": _GRANT + reference, "reference": reference,
                "tokens": tokens, "consumed": 0, "kind": kind, "expires_at": expires_at_ms,
                EXPIRY_HOUR_ATTR: None if expires_at_ms is None else expiry_hour(expires_at_ms),
                **_change_attrs(change)}
        created = self._transact([
            {"Put": {"TableName": self.table, "Item": self._ser(item),
                     "ConditionExpression": "attribute_not_exists(pk)"}},
            self._audit_put(user_id, "grant.create", change,
                            {"reference": reference, "tokens": tokens, "kind": kind,
                             "expires_at_ms": expires_at_ms})])
        if created:
            return _grant(item), True
        existing = self.grant(user_id, reference)
        if existing is None:  # created and deleted in between: never happens (no deletes)
            raise StoreUnavailable("the grant vanished while it was being created")
        asked: dict[str, object] = {"tokens": tokens, "kind": kind,
                                    "expires_at_ms": expires_at_ms}
        if (existing.tokens, existing.kind, existing.expires_at_ms) != tuple(asked.values()):
            raise GrantConflict(f"the reference {reference!r} names a grant with other terms; "
                                "a top-up or an extension is a new grant with a new "
                                "reference", existing=existing, asked=asked)
        return existing, False

    def void_grant(self, user_id: str, reference: str, *, actor: str, reason: str,
                   now_ms: int | None = None) -> tuple[Grant, bool]:
        """Void a grant: what is left of it can no longer be drawn.

        Returns:
            The grant and True when this call voided it; False when it was already void.

        Raises:
            NotFound: the user has no grant with this reference.
        """
        change = Change(actor, check_reason(reason), now_ms or _now_ms())
        key = {"pk": _pk(user_id), "sk": _GRANT + check_reference(reference)}
        done = self._transact([
            {"Update": {"TableName": self.table, "Key": self._ser(key),
                        "ConditionExpression": "attribute_exists(pk) AND "
                                               "attribute_not_exists(void_at)",
                        "UpdateExpression": "SET void_actor = :a, void_reason = :r, "
                                            "void_at = :t",
                        "ExpressionAttributeValues": self._ser(
                            {":a": change.actor, ":r": change.reason, ":t": change.at_ms})}},
            self._audit_put(user_id, "grant.void", change, {"reference": reference})])
        grant = self.grant(user_id, reference)
        if grant is None:
            raise NotFound(f"the user has no grant with reference {reference!r}")
        return grant, done

    def mark_expired(self, user_id: str, grant: Grant, *, now_ms: int) -> bool:
        """Record, once, that ``grant`` expired with tokens unused: ``expired_at`` (ms) and
        ``forfeited`` (its remaining tokens) on the grant item.

        The write is conditioned on the grant as read (not voided, expired by ``now_ms``,
        ``consumed`` unchanged) and on no ``expired_at`` yet, so of all the loads and reads
        that see it expired exactly one records it and reports it. Each call writes a
        token of its own beside them (``expired_by``): when botocore re-sends the write
        after its answer was lost, the re-send fails the condition, and the item the
        failure returns carries this call's token, so the call still knows it recorded
        it. An answer lost on every attempt raises: the expiry stands, recorded, and no
        call reports it (at most once).

        Returns:
            True when this call recorded it; False when it was recorded already (by
            another call), or the grant changed since it was read (a later read records it).

        Raises:
            StoreUnavailable: DynamoDB failed.
        """
        from botocore.exceptions import ClientError

        if grant.expires_at_ms is None or grant.expires_at_ms > now_ms or grant.voided:
            return False
        key = {"pk": _pk(user_id), "sk": _GRANT + check_reference(grant.reference)}
        token = uuid.uuid4().hex
        try:
            self._call(self.client.update_item, TableName=self.table, Key=self._ser(key),
                       ConditionExpression="attribute_exists(pk) AND "
                                           "attribute_not_exists(expired_at) AND "
                                           "attribute_not_exists(void_at) AND "
                                           "expires_at <= :t AND #c = :c",
                       UpdateExpression="SET expired_at = :t, forfeited = :f, "
                                        "expired_by = :k",
                       ExpressionAttributeNames={"#c": "consumed"},  # a reserved word
                       ExpressionAttributeValues=self._ser(
                           {":t": now_ms, ":c": grant.consumed, ":f": grant.remaining,
                            ":k": token}),
                       ReturnValuesOnConditionCheckFailure="ALL_OLD")
        except ClientError as exc:  # the condition failed: recorded already, or changed
            item = exc.response.get("Item") or {}
            return bool(item) and self._de(item).get("expired_by") == token  # by this call
        return True

    def expiring(self, hour: str, from_ms: int, to_ms: int,
                 start: Mapping[str, Any] | None = None,
                 ) -> tuple[list[tuple[str, str, int]], dict[str, Any] | None]:
        """One page of the grants whose expiry is in ``hour`` (``expiry_hour``) and
        within [``from_ms``, ``to_ms``], earliest first (the expiry index: eventually
        consistent, keys only; read each grant itself to know where it stands).

        Args:
            start: the page's start (the previous page's second value; None: the first).

        Returns:
            (user id, reference, expires_at ms) per grant, and where the next page starts
            (None: this was the last).
        """
        kwargs: dict[str, Any] = {
            "TableName": self.table, "IndexName": EXPIRY_INDEX,
            "KeyConditionExpression": "#h = :h AND expires_at BETWEEN :a AND :b",
            "ExpressionAttributeNames": {"#h": EXPIRY_HOUR_ATTR},
            "ExpressionAttributeValues": self._ser({":h": hour, ":a": from_ms, ":b": to_ms})}
        if start is not None:
            kwargs["ExclusiveStartKey"] = dict(start)
        reply = self._call(self.client.query, **kwargs)
        out = []
        for raw in reply.get("Items", []):
            item = self._de(raw)
            pk, sk = str(item["pk"]), str(item["sk"])
            if pk.startswith("U#") and sk.startswith(_GRANT):
                out.append((pk[2:], sk[len(_GRANT):], int(item["expires_at"])))
        return out, reply.get("LastEvaluatedKey")

    # --- suspension -------------------------------------------------------------------------

    def suspend(self, user_id: str, *, reason: str, until_ms: int | None, actor: str,
                now_ms: int | None = None) -> Suspension:
        """Suspend a user (replacing any earlier suspension's reason and end).

        Raises:
            InvalidArgument: ``until_ms`` is not in the future.
        """
        now = now_ms or _now_ms()
        change = Change(actor, check_reason(reason), now)
        if until_ms is not None and until_ms <= now:
            raise InvalidArgument("until must be in the future")
        item = {"pk": _pk(user_id), "sk": _SUSP_SK, "until": until_ms, **_change_attrs(change)}
        self._transact([{"Put": {"TableName": self.table, "Item": self._ser(item)}},
                        self._audit_put(user_id, "suspension.set", change,
                                        {"until_ms": until_ms})])
        return Suspension(change.reason, until_ms, change)

    def lift_suspension(self, user_id: str, *, actor: str, reason: str,
                        now_ms: int | None = None) -> Suspension | None:
        """Lift a suspension; returns the one lifted (None: there was none, nothing written)."""
        change = Change(actor, check_reason(reason), now_ms or _now_ms())
        current = self._get(user_id, _SUSP_SK)
        if current is None:
            return None
        done = self._transact([
            {"Delete": {"TableName": self.table,
                        "Key": self._ser({"pk": _pk(user_id), "sk": _SUSP_SK}),
                        "ConditionExpression": "attribute_exists(pk)"}},
            self._audit_put(user_id, "suspension.lift", change, {})])
        return _suspension(current) if done else None

    # --- the cache's load epoch, and credit moving between grants and charges -------------

    def bump_epoch(self, user_id: str) -> int:
        """Raise the user's load epoch by one (``ADD``) and return the new value.

        A load of the cache, and every operator change, takes a new epoch: a draw made
        under an older one can no longer commit (``commit_draw``).
        """
        reply = self._call(self.client.update_item, TableName=self.table,
                           Key=self._ser({"pk": _pk(user_id), "sk": _LOAD_SK}),
                           UpdateExpression="ADD #e :one",
                           ExpressionAttributeNames={"#e": "epoch"},
                           ExpressionAttributeValues=self._ser({":one": 1}),
                           ReturnValues="UPDATED_NEW")
        return int(self._de(reply["Attributes"])["epoch"])

    def epoch(self, user_id: str) -> int:
        """The user's current load epoch (0 when never loaded)."""
        item = self._get(user_id, _LOAD_SK)
        return int(item["epoch"]) if item else 0

    def commit_draw(self, user_id: str, request_id: str, nonce: str,
                    draws: Sequence[tuple[str, int]], epoch: int, *, cost: int,
                    route: str = "", reported: Mapping[str, str] | None = None,
                    ) -> DrawOutcome:
        """Record one charge's draws from grants, once, if the load epoch is still ``epoch``.

        One transaction: the epoch check, the charge record ``C#<request id>#<nonce>``
        (created only if absent) and ``ADD consumed`` on each grant drawn, with the credit
        reports the draw crossed (``reported``) kept on the grant.

        Args:
            draws: (grant reference, tokens) pairs, as the reservation reported them.
            epoch: the cache's load epoch the reservation drew under.
            cost: the charge's cost, tokens (>= the tokens drawn).
            route: the route charged.
            reported: per grant reference, the credit reports the draw crossed (``l``
                low, ``x`` exhausted): a reload of the cache knows they were made.

        Returns:
            ``recorded`` (now or by an earlier attempt of the same charge), ``stale`` (the
            epoch moved on: nothing was written) or ``void`` (a lowering of this charge
            wrote it off first: it can never be recorded).

        Raises:
            InvalidArgument: no draws, or a malformed one.
            StoreUnavailable: DynamoDB failed; whether the draw landed is unknown (ask
                ``charge_record``, or settle it with ``return_credit``).
        """
        from botocore.exceptions import ClientError

        pk = _pk(user_id)
        _check_request_id(request_id)
        check_nonce(nonce)
        pairs = check_pairs(draws, "draw")
        if not pairs:
            raise InvalidArgument("a draw needs at least one grant")
        if isinstance(cost, bool) or not isinstance(cost, int) \
                or cost < sum(n for _, n in pairs):
            raise InvalidArgument("cost must be an integer at least the tokens drawn")
        now = _now_ms()
        record = {"request_id": request_id, "nonce": nonce, "cost": cost, "kept": cost,
                  "draws": encode_pairs(pairs), "state": "drawn", "epoch": epoch,
                  "route": route, "at": now, TTL_ATTRIBUTE: _record_ttl()}
        items: list[dict[str, Any]] = [
            {"ConditionCheck": {"TableName": self.table,
                                "Key": self._ser({"pk": pk, "sk": _LOAD_SK}),
                                "ConditionExpression": "#e = :e",
                                "ExpressionAttributeNames": {"#e": "epoch"},
                                "ExpressionAttributeValues": self._ser({":e": epoch})}},
            # an Update that creates the record, once (the request path needs no PutItem)
            self._create_update(pk, charge_sk(request_id, nonce), record)]
        for reference, tokens in totals(pairs).items():
            flags = (reported or {}).get(reference, "")
            sets = [f"{_FLAG_ATTRS[f]} = if_not_exists({_FLAG_ATTRS[f]}, :t)"
                    for f in "lx" if f in flags]
            values: dict[str, Any] = {":n": tokens, **({":t": now} if sets else {})}
            items.append({"Update": {
                "TableName": self.table, "Key": self._ser({"pk": pk, "sk": _GRANT + reference}),
                "ConditionExpression": "attribute_exists(pk)",
                "UpdateExpression": "ADD #c :n" + (" SET " + ", ".join(sets) if sets else ""),
                "ExpressionAttributeNames": {"#c": "consumed"},  # a reserved word
                "ExpressionAttributeValues": self._ser(values)}})
        for attempt in range(_CONFLICT_ATTEMPTS):
            try:
                self._call(self.client.transact_write_items, TransactItems=items)
                return "recorded"
            except ClientError as exc:
                codes = _cancel_codes(exc)
                if len(codes) > 1 and codes[1] == "ConditionalCheckFailed":
                    # the record is there: an earlier attempt of this very draw landed (its
                    # answer was lost), or a lowering wrote the charge off first
                    found = self.charge_record(user_id, request_id, nonce)
                    return "void" if found is None or found.state == "void" else "recorded"
                if codes[:1] == ["ConditionalCheckFailed"]:
                    return "stale"  # a load or an operator change since the reservation
                if "TransactionConflict" in codes and attempt + 1 < _CONFLICT_ATTEMPTS:
                    time.sleep(0.01 * 2 ** attempt)
                    continue
                raise _cancelled("draw", codes, exc) from exc
        raise AssertionError("unreachable: the last attempt returns or raises")

    def charge_record(self, user_id: str, request_id: str, nonce: str) -> ChargeRecord | None:
        """The credit record of the charge ``nonce`` made for ``request_id``, or None."""
        _check_request_id(request_id)
        item = self._get(user_id, charge_sk(request_id, check_nonce(nonce)))
        return record_of(item) if item else None

    def charge_records(self, user_id: str, request_id: str | None = None) -> list[ChargeRecord]:
        """Every credit record of the user (of one request id when given), oldest first
        within a request id (support, the auditor and tests)."""
        prefix = CHARGE_PREFIX if request_id is None else \
            charge_sk(_check_request_id(request_id), "")
        out = [record_of(item) for item in self._query_prefix(user_id, prefix)]
        if request_id is not None:
            out = [r for r in out if r.request_id == request_id]
        return sorted(out, key=lambda r: (r.request_id, r.at_ms))

    def return_credit(self, user_id: str, request_id: str, nonce: str, new_cost: int, *,
                      now_ms: int | None = None,
                      extra: ExtraItems | None = None) -> CreditReturn:
        """Lower the charge's record to ``new_cost`` and give its drawn credit back.

        Lowering by ``delta`` takes ``min(delta, still drawn)`` off the draws in reverse
        draw order (``charges.split_return``); each part goes back to its grant (``ADD
        consumed -n``) unless that grant has expired at ``now_ms`` or been voided, when
        it is forfeited. One transaction, conditioned on the record as it was read, never
        on the cache's epoch. A record already at or below ``new_cost`` is left alone
        (a re-sent or repeated call changes nothing). No record: a tombstone is written,
        so that a draw of this charge still on its way can never land.

        Args:
            new_cost: the charge's cost after the lowering (0: refunded).
            now_ms: the time that decides whether a grant has expired (default: now).
            extra: makes more transaction items that must commit with the lowering (a
                support refund's record and audit entry), given the credit returned and
                forfeited; their condition failing raises ``ExtraConditionFailed`` and
                nothing is written.

        Returns:
            A ``CreditReturn``.

        Raises:
            InvalidArgument: a malformed argument (nothing written).
            ExtraConditionFailed: an item of ``extra`` failed its condition.
            StoreUnavailable: DynamoDB failed; the lowering may or may not have landed
                (calling again is safe: it lands once).
        """
        from botocore.exceptions import ClientError

        pk = _pk(user_id)
        _check_request_id(request_id)
        check_nonce(nonce)
        if isinstance(new_cost, bool) or not isinstance(new_cost, int) or new_cost < 0:
            raise InvalidArgument("new_cost must be an integer >= 0")
        now = _now_ms() if now_ms is None else now_ms
        forfeit: set[str] = set()
        for attempt in range(_RETURN_ATTEMPTS):
            record = self.charge_record(user_id, request_id, nonce)
            if record is not None and (record.kept <= new_cost or record.state == "void"):
                return CreditReturn(changed=False, existed=record.state != "void",
                                    record=record)
            if record is None:
                tomb = {"request_id": request_id, "nonce": nonce, "cost": 0, "kept": 0,
                        "draws": "", "state": "void", "at": now, TTL_ATTRIBUTE: _record_ttl()}
                back: Pairs = ()
                items = [self._create_update(pk, charge_sk(request_id, nonce), tomb)]
            else:
                back = split_return(record.standing, record.kept - new_cost)
                items = [self._lowering(pk, record, new_cost, back, forfeit, now),
                         *self._grant_returns(pk, back, forfeit, now)]
            returned = tuple((r, n) for r, n in back if r not in forfeit)
            lost = tuple((r, n) for r, n in back if r in forfeit)
            first_extra = len(items)
            if extra is not None:
                items += extra(returned, lost)
            try:
                self._call(self.client.transact_write_items, TransactItems=items)
            except ClientError as exc:
                codes = _cancel_codes(exc)
                failed = [i for i, c in enumerate(codes) if c == "ConditionalCheckFailed"]
                if any(i >= first_extra for i in failed) and not any(
                        i < first_extra for i in failed):
                    raise ExtraConditionFailed(min(failed) - first_extra) from exc
                if failed and failed[0] == 0:
                    continue  # the record changed since it was read (or a draw landed)
                if failed:  # a grant expired or was voided since: its part is forfeited
                    grants = [r for r, _ in merged(back) if r not in forfeit]
                    forfeit.update(grants[i - 1] for i in failed if 0 < i <= len(grants))
                    continue
                if "TransactionConflict" in codes and attempt + 1 < _RETURN_ATTEMPTS:
                    time.sleep(0.01 * 2 ** attempt)
                    continue
                raise _cancelled("return", codes, exc) from exc
            if record is None:
                return CreditReturn(changed=True, existed=False)
            return CreditReturn(changed=True, existed=True, returned=returned, forfeited=lost,
                                record=self.charge_record(user_id, request_id, nonce))
        raise StoreUnavailable("the return kept conflicting with other writes")

    def _create_update(self, pk: str, sk: str, record: Mapping[str, Any]) -> dict[str, Any]:
        """A transaction item creating an item (an Update: the request path has no PutItem)."""
        return {"Update": {
            "TableName": self.table, "Key": self._ser({"pk": pk, "sk": sk}),
            "ConditionExpression": "attribute_not_exists(pk)",
            "UpdateExpression": "SET " + ", ".join(f"#{k} = :{k}" for k in record),
            "ExpressionAttributeNames": {f"#{k}": k for k in record},
            "ExpressionAttributeValues": self._ser({f":{k}": v for k, v in record.items()})}}

    def _lowering(self, pk: str, record: ChargeRecord, new_cost: int, back: Pairs,
                  forfeit: set[str], now: int) -> dict[str, Any]:
        """The update of a charge record lowered to ``new_cost``, conditioned on its read."""
        returned = merged((*record.returned, *((r, n) for r, n in back if r not in forfeit)))
        lost = merged((*record.forfeited, *((r, n) for r, n in back if r in forfeit)))
        after = ChargeRecord(record.request_id, record.nonce, record.cost, new_cost,
                             record.draws, returned, lost)  # checks the record's invariant
        values = {":kept": after.kept, ":ret": encode_pairs(returned),
                  ":lost": encode_pairs(lost), ":at": now, ":old": record.kept,
                  ":state": "returned" if new_cost == 0 else "lowered"}
        return {"Update": {
            "TableName": self.table,
            "Key": self._ser({"pk": pk, "sk": charge_sk(record.request_id, record.nonce)}),
            "ConditionExpression": "kept = :old",
            "UpdateExpression": "SET kept = :kept, ret = :ret, lost = :lost, "
                                "#s = :state, changed_at = :at",
            "ExpressionAttributeNames": {"#s": "state"},
            "ExpressionAttributeValues": self._ser(values)}}

    def _grant_returns(self, pk: str, back: Pairs, forfeit: set[str],
                       now: int) -> list[dict[str, Any]]:
        """``ADD consumed -n`` on each grant that gets credit back: only one that is still
        neither voided nor expired at ``now`` (its condition; else the part is forfeited).
        A return re-arms the grant's credit reports when it lifts remaining above the
        re-arming level (decided when the cache loads it: ``reported_flags``)."""
        return [{"Update": {
            "TableName": self.table, "Key": self._ser({"pk": pk, "sk": _GRANT + reference}),
            "ConditionExpression": "attribute_exists(pk) AND attribute_not_exists(void_at) "
                                   "AND (attribute_not_exists(expires_at) OR expires_at > :now)",
            "UpdateExpression": "ADD #c :n",
            "ExpressionAttributeNames": {"#c": "consumed"},
            "ExpressionAttributeValues": self._ser({":n": -tokens, ":now": now})}}
            for reference, tokens in merged(back) if reference not in forfeit]

    def _query_prefix(self, user_id: str, prefix: str) -> list[dict[str, Any]]:
        """Every item of the user whose sort key starts with ``prefix``, strongly read."""
        items: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {
            "TableName": self.table, "ConsistentRead": True,
            "KeyConditionExpression": "pk = :pk AND begins_with(sk, :p)",
            "ExpressionAttributeValues": self._ser({":pk": _pk(user_id), ":p": prefix})}
        while True:
            reply = self._call(self.client.query, **kwargs)
            items.extend(self._de(item) for item in reply.get("Items", []))
            if "LastEvaluatedKey" not in reply:
                return items
            kwargs["ExclusiveStartKey"] = reply["LastEvaluatedKey"]

    # --- support refunds --------------------------------------------------------------------

    def support_refund(self, user_id: str, request_id: str) -> SupportRefund | None:
        """The support refund of this charge, if one was made."""
        item = self._get(user_id, _REFUND + _check_request_id(request_id))
        return None if item is None else _support_refund(request_id, item)

    def support_refunds(self, user_id: str) -> list[SupportRefund]:
        """Every support refund of the user's charges, oldest request id first."""
        return [_support_refund(str(item["sk"])[len(_REFUND):], item)
                for item in self._query_prefix(user_id, _REFUND)]

    def refund_charge(self, user_id: str, request_id: str, nonce: str, *, tokens: int,
                      actor: str, reason: str, now_ms: int | None = None,
                      ) -> tuple[SupportRefund, bool]:
        """A support refund of the charge ``nonce`` made for ``request_id``, at most once.

        One transaction: the charge's credit comes back (``return_credit`` to 0: to the
        grants it drew from, unless expired or voided), the refund's record
        ``R#<request id>`` (created only if absent) and its audit entry. So the refund and
        its audit entry happen together or not at all. The ledger's windows (Redis) are
        the caller's to lower afterwards.

        Args:
            tokens: the charge's cost as the ledger holds it (what its windows get back);
                0 when the ledger no longer holds it (only its credit comes back).

        Returns:
            The refund and True when this call made it; the earlier refund and False.

        Raises:
            NotFound: nothing of the charge stands: the ledger holds none (``tokens`` 0)
                and its credit record is refunded or absent.
            StoreUnavailable: DynamoDB failed; the refund may or may not have landed
                (calling again is safe).
        """
        change = Change(actor, check_reason(reason), now_ms or _now_ms())
        pk = _pk(user_id)

        def items(returned: Pairs, forfeited: Pairs) -> list[dict[str, Any]]:
            item = {"pk": pk, "sk": _REFUND + request_id, "request_id": request_id,
                    "claimed": tokens, "tokens": tokens, "nonce": nonce,
                    "credit": encode_pairs(returned), "lost": encode_pairs(forfeited),
                    **_change_attrs(change)}
            return [{"Put": {"TableName": self.table, "Item": self._ser(item),
                             "ConditionExpression": "attribute_not_exists(pk)"}},
                    self._audit_put(user_id, "refund", change, {
                        "request_id": request_id, "tokens": tokens,
                        "credit": [{"reference": r, "tokens": n} for r, n in returned],
                        "forfeited": [{"reference": r, "tokens": n} for r, n in forfeited]})]

        earlier = self.support_refund(user_id, request_id)
        if earlier is not None:
            return earlier, False
        for _ in range(_CONFLICT_ATTEMPTS):
            record = self.charge_record(user_id, request_id, nonce)
            standing = record is not None and record.state != "void" and record.kept > 0
            if not standing and tokens == 0:
                raise NotFound(f"no charge {request_id!r} stands to be refunded")
            try:
                if standing or record is None:  # the credit back, or a tombstone
                    done = self.return_credit(user_id, request_id, nonce, 0,
                                              now_ms=change.at_ms, extra=items)
                    if not done.changed:
                        continue  # lowered by another call since it was read: look again
                elif not self._transact(items((), ())):
                    raise ExtraConditionFailed(0)
                else:
                    done = CreditReturn(changed=False, existed=True)
            except ExtraConditionFailed:
                found = self.support_refund(user_id, request_id)
                if found is None:
                    raise StoreUnavailable("the support refund's record vanished") from None
                return found, False
            return SupportRefund(request_id, tokens, tokens, change, nonce, done.returned,
                                 done.forfeited), True
        raise StoreUnavailable("the support refund kept conflicting with other writes")

    # --- setup (tests and the local stack) --------------------------------------------------

    def create_table(self) -> None:
        """Create the table as template.yaml defines it (local stack and tests only)."""
        client = self.client
        client.create_table(TableName=self.table, **TABLE_DEFINITION)
        client.get_waiter("table_exists").wait(TableName=self.table,
                                               WaiterConfig={"Delay": 0.1, "MaxAttempts": 100})
        client.update_time_to_live(TableName=self.table, TimeToLiveSpecification={
            "AttributeName": TTL_ATTRIBUTE, "Enabled": True})


_store: EntitlementStore | None = None


def default_store() -> EntitlementStore:
    """The process's store, made on first use from the environment (one per environment).

    Raises:
        StoreUnavailable: the store is not configured (``ATTO_ENTITLEMENTS_TABLE`` unset):
            a deployment mistake, not the caller's.
    """
    global _store
    if _store is None:
        try:
            _store = EntitlementStore(store_settings())
        except InvalidArgument as exc:
            raise StoreUnavailable(f"the entitlements store is misconfigured: {exc}") from exc
    return _store


def set_store(store: EntitlementStore | None) -> None:
    """Use ``store`` for every call of this process (tests, custom wiring); None resets."""
    global _store
    _store = store
    store_settings.cache_clear()


@snapstart.after_restore
def _forget_store() -> None:
    """After a SnapStart restore, make the DynamoDB client (and its connections) again."""
    set_store(None)
