"""The durable record of plan overrides, grants, suspensions and operator actions: DynamoDB.

One table, on-demand, point-in-time recovery on (template.yaml ``EntitlementsTable``)::

    pk          sk                         item
    U#<user>    E#PLAN                     the plan override
    U#<user>    E#SUSP                     the suspension
    U#<user>    E#G#<reference>            a grant (tokens, consumed, kind, expiry, voided)
    U#<user>    E#LOAD                     the load epoch: raised by every load of the cache
                                           and every operator change
    U#<user>    D#<nonce>#d#<request id>   one charge's draws from grants (made durable
                                           before its provider is called)
    U#<user>    D#<nonce>#r<n>#<request id>  credit that lowering the charge to n tokens gave
                                           back (the nonce is the charge's; it has no #)
    U#<user>    R#<request id>             a support refund of one charge (at most once)
    U#<user>    A#<ms, 13 digits>#<id>     an operator action (audit), newest last
    GSI ``audit`` (sparse: only audit items carry its keys)
    AUDIT       <ms, 13 digits>#<id>       every operator action, across users

Everything the hot path needs about a user sits under ``E#``, so loading it is one Query.

Draws are made in the cache (the reservation script) and then recorded here in one
transaction that also checks the load epoch: a draw made under an epoch that a later load
has replaced can never commit (its credit would be counted twice: once by the load, which
did not see it, and once by the commit). The same holds for credit given back.
Every change is written in one transaction with its audit item: an action is recorded
exactly when it happened. A grant's creation is a conditional put on its reference, so the
same reference never makes a second grant, however often it is retried.

boto3 is imported on first use, never at module import (cold start).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .. import snapstart
from ..exceptions import InvalidArgument
from .config import StoreSettings, store_settings
from .exceptions import NotFound, StoreUnavailable
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
#: Default and largest number of audit entries returned at once.
DEFAULT_AUDIT = 50
MAX_AUDIT = 500

#: The attribute DynamoDB's time to live reads (epoch seconds), as template.yaml declares it.
#: Only draw records carry it: grants, suspensions, overrides, refunds and the audit log stay.
TTL_ATTRIBUTE = "ttl"
#: How long a draw or return record is kept, days. A retry of the same charge comes within
#: seconds, so its once-only record is long gone only for charges far out of every window;
#: over a year keeps a yearly audit of where each grant's tokens went.
DRAW_RECORD_DAYS = 400

#: The table's key schema, as template.yaml declares it (a test keeps the two in step).
TABLE_DEFINITION: dict[str, Any] = {
    "AttributeDefinitions": [
        {"AttributeName": "pk", "AttributeType": "S"},
        {"AttributeName": "sk", "AttributeType": "S"},
        {"AttributeName": "gsi1pk", "AttributeType": "S"},
        {"AttributeName": "gsi1sk", "AttributeType": "S"},
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
    }],
    "BillingMode": "PAY_PER_REQUEST",
}

_PLAN_SK = "E#PLAN"
_SUSP_SK = "E#SUSP"
_GRANT = "E#G#"
_LOAD_SK = "E#LOAD"
_DRAW = "D#"
_REFUND = "R#"
#: Attempts of a draw or return transaction that DynamoDB cancels for a conflict with
#: another transaction on the same grant.
_CONFLICT_ATTEMPTS = 4
_AUDIT = "A#"
_MAX_USER_ID = 256

T = TypeVar("T")


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


def _now_ms() -> int:
    return int(time.time() * 1000)


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
                 voided=_change(item, "void_") if "void_at" in item else None)


def _suspension(item: Mapping[str, Any]) -> Suspension:
    until = item.get("until")
    return Suspension(reason=str(item["reason"]), until_ms=None if until is None else int(until),
                      change=_change(item))


class EntitlementStore:
    """Plan overrides, grants, suspensions and the audit log in one DynamoDB table.

    Args:
        settings: where the table is (default: from the environment).
        client: a boto3 DynamoDB client to use instead of making one (tests, custom wiring).

    Every method raises ``StoreUnavailable`` when DynamoDB cannot be reached or refuses the
    call, and ``InvalidArgument`` for bad input (before anything is written).
    """

    def __init__(self, settings: StoreSettings | None = None, *, client: Any = None) -> None:
        self.settings = settings or store_settings()
        self.table = self.settings.table
        self._client = client

    # --- plumbing ---------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The DynamoDB client, made on first use."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            s = self.settings
            self._client = boto3.client(
                "dynamodb", region_name=s.region, endpoint_url=s.endpoint_url,
                config=Config(connect_timeout=s.connect_timeout_s,
                              read_timeout=s.read_timeout_s,
                              retries={"max_attempts": s.max_attempts, "mode": "standard"}))
        return self._client

    def _call(self, fn: Callable[..., T], **kwargs: Any) -> T:
        """Call the client; botocore errors become ``StoreUnavailable``."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in (
                    "TransactionCanceledException", "ConditionalCheckFailedException"):
                raise
            raise StoreUnavailable(f"the entitlements store refused the call: "
                                   f"{exc.response.get('Error', {}).get('Code')}") from exc
        except BotoCoreError as exc:
            raise StoreUnavailable(f"the entitlements store is unreachable: {exc}") from exc

    @staticmethod
    def _ser(item: Mapping[str, Any]) -> dict[str, Any]:
        from boto3.dynamodb.types import TypeSerializer

        ser = TypeSerializer()
        return {k: ser.serialize(v) for k, v in item.items() if v is not None}

    @staticmethod
    def _de(item: Mapping[str, Any]) -> dict[str, Any]:
        from boto3.dynamodb.types import TypeDeserializer

        de = TypeDeserializer()
        return {k: de.deserialize(v) for k, v in item.items()}

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
        items: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {
            "TableName": self.table, "ConsistentRead": True,
            "KeyConditionExpression": "pk = :pk AND begins_with(sk, :e)",
            "ExpressionAttributeValues": self._ser({":pk": _pk(user_id), ":e": "E#"}),
        }
        while True:
            reply = self._call(self.client.query, **kwargs)
            items.extend(self._de(item) for item in reply.get("Items", []))
            if "LastEvaluatedKey" not in reply:
                break
            kwargs["ExclusiveStartKey"] = reply["LastEvaluatedKey"]
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
            the reference was used before (whatever the other fields say now).

        Raises:
            InvalidArgument: tokens not 1..10**12, an unknown kind, a bad reference, or an
                expiry that is not in the future.
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

    # --- the cache's load epoch, draws and credit given back ------------------------------

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
                    draws: Sequence[tuple[str, int]], epoch: int) -> bool:
        """Record one charge's draws from grants, once, if the load epoch is still ``epoch``.

        One transaction: the epoch check, a ``D#<nonce>#d#<request id>`` record (conditional
        on not existing) and ``ADD consumed`` on each grant drawn. Called again with the
        same charge (a retry), it finds the record and changes nothing.

        Args:
            draws: (grant reference, tokens) pairs, as the reservation reported them.
            epoch: the cache's load epoch the reservation saw.

        Returns:
            True when the draws are recorded (now or by an earlier call); False when the
            epoch moved on (a load or an operator change since): nothing was written.

        Raises:
            InvalidArgument: no draws, or a malformed one.
            StoreUnavailable: DynamoDB failed; nothing is known to be written.
        """
        return self._commit_credit(user_id, request_id, nonce, draws, epoch, sign=1,
                                   suffix="d", op="draw")

    def commit_return(self, user_id: str, request_id: str, nonce: str, new_cost: int,
                      returned: Sequence[tuple[str, int]], epoch: int) -> bool:
        """Record credit that lowering a charge to ``new_cost`` gave back to its grants.

        The same transaction as ``commit_draw``, with ``ADD consumed -n``; the record
        ``D#<nonce>#r<new_cost>#<request id>`` makes it happen once per lowering.

        Returns:
            True when recorded (now or earlier); False when the epoch moved on.

        Raises:
            InvalidArgument: nothing returned, or a malformed pair.
            StoreUnavailable: DynamoDB failed.
        """
        if isinstance(new_cost, bool) or not isinstance(new_cost, int) or new_cost < 0:
            raise InvalidArgument("new_cost must be an integer >= 0")
        return self._commit_credit(user_id, request_id, nonce, returned, epoch, sign=-1,
                                   suffix=f"r{new_cost}", op="return")

    def _commit_credit(self, user_id: str, request_id: str, nonce: str,
                       pairs: Sequence[tuple[str, int]], epoch: int, *, sign: int,
                       suffix: str, op: str) -> bool:
        from botocore.exceptions import ClientError

        pk = _pk(user_id)
        _check_request_id(request_id)
        if not isinstance(nonce, str) or not nonce or not nonce.isprintable() \
                or any(c in nonce for c in " #"):
            raise InvalidArgument("nonce must be a non-empty string without spaces or #")
        if not pairs:
            raise InvalidArgument(f"a {op} needs at least one grant")
        totals: dict[str, int] = {}
        for reference, tokens in pairs:
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
                raise InvalidArgument(f"tokens of a {op} must be positive integers")
            totals[check_reference(reference)] = totals.get(reference, 0) + tokens
        record = {"request_id": request_id, "nonce": nonce, "op": op, "epoch": epoch,
                  "draws": " ".join(f"{r}={n}" for r, n in pairs), "at": _now_ms(),
                  TTL_ATTRIBUTE: int(time.time()) + DRAW_RECORD_DAYS * 86400}
        items: list[dict[str, Any]] = [
            {"ConditionCheck": {"TableName": self.table,
                                "Key": self._ser({"pk": pk, "sk": _LOAD_SK}),
                                "ConditionExpression": "#e = :e",
                                "ExpressionAttributeNames": {"#e": "epoch"},
                                "ExpressionAttributeValues": self._ser({":e": epoch})}},
            # an Update that creates the record, once (the request path needs no PutItem)
            {"Update": {"TableName": self.table,
                        "Key": self._ser({"pk": pk,
                                          "sk": f"{_DRAW}{nonce}#{suffix}#{request_id}"}),
                        "ConditionExpression": "attribute_not_exists(pk)",
                        "UpdateExpression": "SET " + ", ".join(f"#{k} = :{k}" for k in record),
                        "ExpressionAttributeNames": {f"#{k}": k for k in record},
                        "ExpressionAttributeValues": self._ser(
                            {f":{k}": v for k, v in record.items()})}},
            *({"Update": {"TableName": self.table,
                          "Key": self._ser({"pk": pk, "sk": _GRANT + reference}),
                          "ConditionExpression": "attribute_exists(pk)",
                          "UpdateExpression": "ADD #c :n",  # CONSUMED is a reserved word
                          "ExpressionAttributeNames": {"#c": "consumed"},
                          "ExpressionAttributeValues": self._ser({":n": sign * tokens})}}
              for reference, tokens in totals.items())]
        for attempt in range(_CONFLICT_ATTEMPTS):
            try:
                self._call(self.client.transact_write_items, TransactItems=items)
                return True
            except ClientError as exc:
                codes = [r.get("Code") for r in exc.response.get("CancellationReasons") or []]
                if codes[:1] == ["ConditionalCheckFailed"]:
                    return False  # a load or an operator change since the reservation
                if len(codes) > 1 and codes[1] == "ConditionalCheckFailed":
                    return True  # this very charge's record is there: done before
                if "TransactionConflict" in codes and attempt + 1 < _CONFLICT_ATTEMPTS:
                    time.sleep(0.01 * 2 ** attempt)
                    continue
                raise StoreUnavailable(f"the entitlements store cancelled a {op}: "
                                       f"{codes or exc.response.get('Error', {}).get('Code')}"
                                       ) from exc
        raise StoreUnavailable(f"the {op} kept conflicting with other writes")  # unreachable

    def draw_recorded(self, user_id: str, request_id: str, nonce: str) -> bool:
        """Whether the draws of the charge made by ``nonce`` are recorded (``commit_draw``)."""
        _check_request_id(request_id)
        return self._get(user_id, f"{_DRAW}{nonce}#d#{request_id}") is not None

    def credit_records(self, user_id: str) -> list[dict[str, Any]]:
        """Every draw and return record of the user, oldest key first (tests, support)."""
        items: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {
            "TableName": self.table, "ConsistentRead": True,
            "KeyConditionExpression": "pk = :pk AND begins_with(sk, :d)",
            "ExpressionAttributeValues": self._ser({":pk": _pk(user_id), ":d": _DRAW})}
        while True:
            reply = self._call(self.client.query, **kwargs)
            items.extend(self._de(item) for item in reply.get("Items", []))
            if "LastEvaluatedKey" not in reply:
                return items
            kwargs["ExclusiveStartKey"] = reply["LastEvaluatedKey"]

    # --- support refunds --------------------------------------------------------------------

    def support_refund(self, user_id: str, request_id: str) -> SupportRefund | None:
        """The support refund of this charge, if one was asked for."""
        item = self._get(user_id, _REFUND + _check_request_id(request_id))
        if item is None:
            return None
        tokens = item.get("tokens")
        return SupportRefund(request_id, int(item.get("claimed", 0)),
                             None if tokens is None else int(tokens), _change(item),
                             str(item.get("nonce", "")))

    def claim_support_refund(self, user_id: str, request_id: str, *, claimed: int, actor: str,
                             reason: str, nonce: str = "",
                             now_ms: int | None = None) -> tuple[SupportRefund, bool]:
        """Claim the one support refund of a charge of ``claimed`` tokens, before the ledger
        is touched. ``nonce`` is that charge's: an attempt that completes the claim removes
        that very charge, never one a retry made later under the same id.

        Returns:
            The claim and True when this call made it; the existing record and False when
            one exists (finished when its ``tokens`` is set, else an attempt that did not
            finish, which the caller completes).
        """
        from botocore.exceptions import ClientError

        change = Change(actor, check_reason(reason), now_ms or _now_ms())
        item = {"pk": _pk(user_id), "sk": _REFUND + _check_request_id(request_id),
                "request_id": request_id, "claimed": claimed, **_change_attrs(change)}
        if nonce:
            item["nonce"] = nonce
        try:
            self._call(self.client.put_item, TableName=self.table, Item=self._ser(item),
                       ConditionExpression="attribute_not_exists(pk)")
        except ClientError as exc:
            existing = self.support_refund(user_id, request_id)
            if existing is None:
                raise StoreUnavailable("the refund claim vanished") from exc
            return existing, False
        return SupportRefund(request_id, claimed, None, change, nonce), True

    def finish_support_refund(self, claim: SupportRefund, user_id: str, tokens: int) -> \
            SupportRefund:
        """Record what a claimed refund gave back, with its audit entry, in one transaction."""
        key = {"pk": _pk(user_id), "sk": _REFUND + claim.request_id}
        done = self._transact([
            {"Update": {"TableName": self.table, "Key": self._ser(key),
                        "ConditionExpression": "attribute_exists(pk) AND "
                                               "attribute_not_exists(tokens)",
                        "UpdateExpression": "SET tokens = :n",
                        "ExpressionAttributeValues": self._ser({":n": tokens})}},
            self._audit_put(user_id, "refund", claim.change,
                            {"request_id": claim.request_id, "tokens": tokens})])
        if not done:
            existing = self.support_refund(user_id, claim.request_id)
            if existing is not None:
                return existing
        return SupportRefund(claim.request_id, claim.claimed, tokens, claim.change, claim.nonce)

    def drop_support_refund(self, claim: SupportRefund, user_id: str) -> None:
        """Forget an unfinished claim whose charge was not in the ledger (nothing changed)."""
        key = {"pk": _pk(user_id), "sk": _REFUND + claim.request_id}
        from botocore.exceptions import ClientError

        with contextlib.suppress(ClientError):  # finished meanwhile by another call: keep it
            self._call(self.client.delete_item, TableName=self.table, Key=self._ser(key),
                       ConditionExpression="attribute_not_exists(tokens)")

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
