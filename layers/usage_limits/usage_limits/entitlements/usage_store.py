"""The usage records' DynamoDB table: one record per charge, and the active-user markers.

One table of its own, on-demand, point-in-time recovery on (template.yaml ``UsageTable``;
the contract is in ``usage``)::

    pk                      sk                      item
    U#<user>                <request id>#<nonce>    one charge's usage record
    ACTIVE#<YYYY-MM-DDTHH>  <user>                  the user has records in that UTC hour
    LSI ``by_time``: pk, at (ms)                    a user's records in time order

Every write is one ``UpdateItem`` (a put or a lowering) or ``PutItem`` (a marker): one
write unit each for an item under 1 KB, which a record always is.

boto3 is imported on first use, never at module import (cold start).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from .. import snapstart
from ..exceptions import InvalidArgument
from .config import (
    AWS_DEFAULT_REGION_ENV,
    AWS_REGION_ENV,
    DYNAMODB_ENDPOINT_ENV,
    env_reader,
)
from .dynamo import DynamoTable
from .models import iso
from .usage import (
    ACTIVE_PREFIX,
    DEFAULT_RECORD_DAYS,
    TIME_INDEX,
    TTL_ATTRIBUTE,
    Cursor,
    RecordState,
    UsageRecord,
    active_key,
    check_id,
    decode_cursor,
    encode_cursor,
    fixed_fields,
    hours,
    moving_fields,
    record_key,
    record_of,
    user_pk,
)

#: The usage records' table.
USAGE_TABLE_ENV = "ATTO_USAGE_TABLE"
#: Days a usage record is kept (its time to live).
USAGE_RECORDS_DAYS_ENV = "ATTO_USAGE_RECORDS_DAYS"
#: Default and largest page of ``history``.
DEFAULT_PAGE = 50
MAX_PAGE = 500
#: The longest span ``active_users`` reads, hours (one Query per hour).
MAX_ACTIVE_HOURS = 24 * 62

#: The table's key schema, as template.yaml declares it (a test keeps the two in step).
TABLE_DEFINITION: dict[str, Any] = {
    "AttributeDefinitions": [
        {"AttributeName": "pk", "AttributeType": "S"},
        {"AttributeName": "sk", "AttributeType": "S"},
        {"AttributeName": "at", "AttributeType": "N"},
    ],
    "KeySchema": [
        {"AttributeName": "pk", "KeyType": "HASH"},
        {"AttributeName": "sk", "KeyType": "RANGE"},
    ],
    "LocalSecondaryIndexes": [{
        "IndexName": TIME_INDEX,
        "KeySchema": [
            {"AttributeName": "pk", "KeyType": "HASH"},
            {"AttributeName": "at", "KeyType": "RANGE"},
        ],
        "Projection": {"ProjectionType": "ALL"},
    }],
    "BillingMode": "PAY_PER_REQUEST",
}



@dataclass(frozen=True)
class UsageSettings:
    """Where the usage table is and how long records are kept.

    Attributes:
        table: the table's name.
        endpoint_url: a DynamoDB endpoint other than AWS's (local serving), else None.
        region: the AWS region (None: botocore's own lookup).
        record_days: days a record is kept (``ATTO_USAGE_RECORDS_DAYS``, default 400).
        connect_timeout_s: seconds to wait for a connection.
        read_timeout_s: seconds to wait for an answer.
        max_attempts: attempts per call, retries included (botocore's standard mode).
    """

    table: str
    endpoint_url: str | None = None
    region: str | None = None
    record_days: int = DEFAULT_RECORD_DAYS
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 2.0
    max_attempts: int = 3

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> UsageSettings:
        """Read the settings from ``env`` (default ``os.environ``); empty counts as unset.

        Raises:
            InvalidArgument: ``ATTO_USAGE_TABLE`` is not set, or
                ``ATTO_USAGE_RECORDS_DAYS`` is not a whole number of days >= 1.
        """
        get = env_reader(env)
        table = get(USAGE_TABLE_ENV)
        if table is None:
            raise InvalidArgument(f"{USAGE_TABLE_ENV} is not set (the usage records' "
                                  "DynamoDB table)")
        days_text = get(USAGE_RECORDS_DAYS_ENV)
        try:
            days = DEFAULT_RECORD_DAYS if days_text is None else int(days_text)
        except ValueError:
            days = 0
        if days < 1:
            raise InvalidArgument(f"{USAGE_RECORDS_DAYS_ENV} must be a whole number of days "
                                  f">= 1, got {days_text!r}")
        return cls(table=table, endpoint_url=get(DYNAMODB_ENDPOINT_ENV),
                   region=get(AWS_REGION_ENV) or get(AWS_DEFAULT_REGION_ENV),
                   record_days=days)


@cache
def usage_settings() -> UsageSettings:
    """The process-wide usage-table settings, read once per execution environment."""
    return UsageSettings.from_env()


@dataclass(frozen=True)
class UsagePage:
    """One page of a user's records, newest first.

    Attributes:
        records: the page's records.
        cursor: what to pass for the next page; None when this is the last.
    """

    records: tuple[UsageRecord, ...]
    cursor: str | None


def _check_span(from_ms: int, to_ms: int) -> None:
    for name, value in (("from", from_ms), ("to", to_ms)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"{name} must be an instant (ms since the epoch, >= 0)")
    if to_ms <= from_ms:
        raise InvalidArgument("to must be later than from")


def cursor_in_span(cursor: str, from_ms: int, to_ms: int) -> Cursor:
    """What ``cursor`` holds, when it belongs to the span [from, to).

    Raises:
        InvalidArgument: it is not a cursor, or one of another span (saying which).
    """
    at = decode_cursor(cursor)
    if (at.from_ms, at.to_ms) != (from_ms, to_ms):
        raise InvalidArgument(f"cursor belongs to the statement from {iso(at.from_ms)} to "
                              f"{iso(at.to_ms)}: ask with that from/to, or with none")
    return at


class UsageStore(DynamoTable):
    """Usage records and active-user markers in one DynamoDB table.

    Args:
        settings: where the table is (default: from the environment).
        client: a boto3 DynamoDB client to use instead of making one (tests, sharing the
            entitlements store's).

    Every method raises ``StoreUnavailable`` when DynamoDB cannot be reached or refuses the
    call, and ``InvalidArgument`` for bad input (before anything is written).
    """

    def __init__(self, settings: UsageSettings | None = None, *, client: Any = None) -> None:
        self.settings = settings or usage_settings()
        super().__init__(self.settings, client, name="usage",
                         passthrough=frozenset({"ConditionalCheckFailedException"}))

    # --- plumbing ---------------------------------------------------------------------------

    def _ttl(self, at_ms: int) -> int:
        return at_ms // 1000 + self.settings.record_days * 86400

    # --- writes -----------------------------------------------------------------------------

    def put(self, record: UsageRecord) -> bool:
        """Write a charge's record, idempotently by request id and nonce.

        The fixed fields (route, plan, cost, draws, ``at``) are always written (the same
        values every time); ``kept``, ``state`` and ``changed_ms`` only when the record has
        none yet. So a re-sent put changes nothing, and a put landing after a lowering
        leaves the lowering in place.

        Returns:
            True when this call made the record (it holds ``record``'s own kept and state);
            False when it was there already (a lowering of ``record`` may still be needed:
            ``lower`` it).

        Raises:
            StoreUnavailable: DynamoDB failed; the put may or may not have landed (calling
                again is safe).
        """
        moving = {k: v for k, v in moving_fields(record).items() if v is not None}
        fixed = {**fixed_fields(record), TTL_ATTRIBUTE: self._ttl(record.at_ms)}
        sets = [f"#{k} = :{k}" for k in fixed] + \
               [f"#{k} = if_not_exists(#{k}, :{k})" for k in moving]
        names = {f"#{k}": k for k in (*fixed, *moving)}
        values = {f":{k}": v for k, v in (*fixed.items(), *moving.items())}
        reply = self._call(self.client.update_item, TableName=self.table,
                           Key=self._ser(record_key(record.user_id, record.request_id,
                                                    record.nonce)),
                           UpdateExpression="SET " + ", ".join(sets),
                           ExpressionAttributeNames=names,
                           ExpressionAttributeValues=self._ser(values),
                           ReturnValues="ALL_OLD")
        return not reply.get("Attributes")

    def lower(self, user_id: str, request_id: str, nonce: str, kept: int,
              state: RecordState, at_ms: int) -> bool:
        """Lower a record's ``kept`` to ``kept`` (a settle, refund or support refund).

        Never raises ``kept``: a record at or below it already is left as it is, so a
        re-sent or repeated lowering moves it once. A record not written yet gets a partial
        one (no route or cost) that its put completes.

        Args:
            kept: tokens the charge keeps now (>= 0).
            state: ``settled``, ``refunded`` or ``support-refunded``.
            at_ms: when the lowering happened, ms since the epoch.

        Returns:
            True when this call lowered (or made) the record; False when it was at or
            below ``kept`` already.

        Raises:
            InvalidArgument: a malformed argument (nothing written).
            StoreUnavailable: DynamoDB failed; the lowering may or may not have landed
                (calling again is safe).
        """
        from botocore.exceptions import ClientError

        if isinstance(kept, bool) or not isinstance(kept, int) or kept < 0:
            raise InvalidArgument("kept must be an integer >= 0")
        if state not in ("settled", "refunded", "support-refunded") \
                or (state == "settled") != (kept > 0):
            raise InvalidArgument(f"a lowering to {kept} cannot be {state!r}")
        key = record_key(user_id, request_id, nonce)
        values = {":k": kept, ":s": state, ":t": at_ms, ":u": user_id, ":r": request_id,
                  ":n": nonce, ":ttl": self._ttl(at_ms)}
        try:
            self._call(self.client.update_item, TableName=self.table, Key=self._ser(key),
                       ConditionExpression="attribute_not_exists(kept) OR kept > :k",
                       UpdateExpression="SET kept = :k, #s = :s, changed_at = :t, "
                                        "#at = if_not_exists(#at, :t), user_id = :u, "
                                        "request_id = :r, nonce = :n, "
                                        "#ttl = if_not_exists(#ttl, :ttl)",
                       ExpressionAttributeNames={"#s": "state", "#at": "at",
                                                 "#ttl": TTL_ATTRIBUTE},
                       ExpressionAttributeValues=self._ser(values))
        except ClientError:  # ConditionalCheckFailed: at or below already
            return False
        return True

    def mark_active(self, user_id: str, at_ms: int) -> None:
        """Note that ``user_id`` has records in the UTC hour of ``at_ms`` (idempotent; the
        caller writes it about once per user-hour)."""
        item = {**active_key(user_id, at_ms), TTL_ATTRIBUTE: self._ttl(at_ms)}
        self._call(self.client.put_item, TableName=self.table, Item=self._ser(item))

    # --- reads ------------------------------------------------------------------------------

    def get(self, user_id: str, request_id: str, nonce: str) -> UsageRecord | None:
        """The record of the charge ``nonce`` made for ``request_id``, or None."""
        reply = self._call(self.client.get_item, TableName=self.table, ConsistentRead=True,
                           Key=self._ser(record_key(user_id, request_id, nonce)))
        item = reply.get("Item")
        return record_of(self._de(item)) if item else None

    def history(self, user_id: str, from_ms: int, to_ms: int, cursor: str | None = None,
                limit: int = DEFAULT_PAGE) -> UsagePage:
        """A user's records made in [from, to), newest first, one page at a time.

        Args:
            cursor: the previous page's ``cursor`` (None: the first page); it carries the
                span of its first page, which must be [from_ms, to_ms).
            limit: records per page, 1..``MAX_PAGE``.

        Raises:
            InvalidArgument: a bad span, cursor or limit.
        """
        _check_span(from_ms, to_ms)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= MAX_PAGE:
            raise InvalidArgument(f"limit must be 1 to {MAX_PAGE}")
        pk = user_pk(user_id)
        kwargs: dict[str, Any] = {
            "TableName": self.table, "IndexName": TIME_INDEX, "ConsistentRead": True,
            "ScanIndexForward": False, "Limit": limit,
            "KeyConditionExpression": "pk = :pk AND #at BETWEEN :f AND :t",
            "ExpressionAttributeNames": {"#at": "at"},
            "ExpressionAttributeValues": self._ser({":pk": pk, ":f": from_ms,
                                                    ":t": to_ms - 1})}
        if cursor is not None:
            at = cursor_in_span(cursor, from_ms, to_ms)
            kwargs["ExclusiveStartKey"] = self._ser({"pk": pk, "sk": at.sk, "at": at.at_ms})
        reply = self._call(self.client.query, **kwargs)
        records = tuple(record_of(self._de(i)) for i in reply.get("Items", []))
        last = reply.get("LastEvaluatedKey")
        return UsagePage(records, encode_cursor(self._de(last), from_ms, to_ms)
                         if last else None)

    def records(self, user_id: str, from_ms: int, to_ms: int) -> list[UsageRecord]:
        """Every record of a user made in [from, to), newest first (statements, totals and
        the auditor; reads every page).

        Raises:
            InvalidArgument: a bad span.
        """
        out: list[UsageRecord] = []
        cursor: str | None = None
        while True:
            page = self.history(user_id, from_ms, to_ms, cursor, MAX_PAGE)
            out.extend(page.records)
            if page.cursor is None:
                return out
            cursor = page.cursor

    def active_users(self, since_ms: int, until_ms: int) -> list[str]:
        """The users with records made in [since, until), sorted, read from the hourly
        markers (one Query per UTC hour touched; no scan of all users).

        Raises:
            InvalidArgument: a bad span, or one longer than ``MAX_ACTIVE_HOURS``.
        """
        _check_span(since_ms, until_ms)
        spans = hours(since_ms, until_ms)
        if len(spans) > MAX_ACTIVE_HOURS:
            raise InvalidArgument(f"a span of active users is at most {MAX_ACTIVE_HOURS} hours")
        users: set[str] = set()
        for hour in spans:
            kwargs: dict[str, Any] = {
                "TableName": self.table, "ConsistentRead": True,
                "KeyConditionExpression": "pk = :pk", "ProjectionExpression": "sk",
                "ExpressionAttributeValues": self._ser({":pk": ACTIVE_PREFIX + hour})}
            while True:
                reply = self._call(self.client.query, **kwargs)
                users.update(str(self._de(i)["sk"]) for i in reply.get("Items", []))
                if "LastEvaluatedKey" not in reply:
                    break
                kwargs["ExclusiveStartKey"] = reply["LastEvaluatedKey"]
        return sorted(users)

    # --- setup (tests and the local stack) --------------------------------------------------

    def create_table(self) -> None:
        """Create the table as template.yaml defines it (local stack and tests only)."""
        client = self.client
        client.create_table(TableName=self.table, **TABLE_DEFINITION)
        client.get_waiter("table_exists").wait(TableName=self.table,
                                               WaiterConfig={"Delay": 0.1, "MaxAttempts": 100})
        client.update_time_to_live(TableName=self.table, TimeToLiveSpecification={
            "AttributeName": TTL_ATTRIBUTE, "Enabled": True})


_store: UsageStore | None = None


def default_usage_store() -> UsageStore | None:
    """The process's usage store, made on first use from the environment; None when
    ``ATTO_USAGE_TABLE`` is not set (records are off: a deployment without the table)."""
    global _store
    if _store is None:
        try:
            _store = UsageStore(usage_settings())
        except InvalidArgument:
            return None
    return _store


def set_usage_store(store: UsageStore | None) -> None:
    """Use ``store`` for every call of this process (tests, custom wiring); None resets."""
    global _store
    _store = store
    usage_settings.cache_clear()


@snapstart.after_restore
def _forget_usage_store() -> None:
    """After a SnapStart restore, make the DynamoDB client (and its connections) again."""
    set_usage_store(None)


def now_ms() -> int:
    """Now, ms since the epoch."""
    return int(time.time() * 1000)


__all__ = ["DEFAULT_PAGE", "MAX_PAGE", "TABLE_DEFINITION", "USAGE_RECORDS_DAYS_ENV",
           "USAGE_TABLE_ENV", "UsagePage", "UsageSettings", "UsageStore", "check_id",
           "default_usage_store", "set_usage_store", "usage_settings"]
