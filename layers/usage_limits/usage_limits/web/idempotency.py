"""Idempotent responses: the same ``Idempotency-Key`` from the same user gets the same answer.

Built on Powertools idempotency with its DynamoDB persistence layer, in a table of its own
(``ATTO_IDEMPOTENCY_TABLE``; template.yaml ``IdempotencyTable``), so a served answer
outlives the cache: dropping Redis (``FLUSHALL``, a failover) never serves or charges a
served key again. For a request carrying ``Idempotency-Key`` from an identified user:

- first time: an INPROGRESS record is written (one conditional PutItem, expiring with the
  request's deadline, so a Lambda killed at timeout leaves a claim Powertools can take
  over), the route runs, and a 2xx answer (status, content type, body) is stored as
  COMPLETED for ``IDEMPOTENCY_TTL_S`` seconds **before it is sent** (``web.middleware``):
  an answer that could not be stored is never sent (503, refunded), so every answer a
  client received is stored (a store whose reply was lost is read back: found stored, it
  is sent); a failed request deletes its record, so a retry may run;
- a repeat after success: the stored answer with ``Idempotent-Replayed: true``; nothing
  reserved, no provider called. One DynamoDB call: the refused PutItem returns the record
  (``ReturnValuesOnConditionCheckFailure``);
- a repeat while the first is in flight: 409 ``idempotency_conflict`` (retry);
- the same key with another method, path, query or body: 422 ``idempotency_key_reused``;
- a large answer (above ``MAX_STORED_BYTES``, DynamoDB's item limit being 400 KB) is
  stored compressed, in up to ``MAX_PARTS`` items of its own beside the record when
  compressed it is still larger (64 embeddings of 3,072 dimensions: about 4 MB of JSON,
  7 parts); a replay then reads them too (one GetItem each). An answer larger still (the
  Lambda response limit, 6 MB, comes first) is recorded as served without its body: a
  repeat gets 422 ``idempotency_answer_gone`` (served and charged once), never a second
  run.

Why its own table, not the entitlements table under the user's partition: the metered
functions then need PutItem and DeleteItem only on stored answers, never on the table that
holds money (IAM cannot tell a grant from an answer by its sort key); answers of up to
``MAX_STORED_BYTES`` stay out of the partitions the statement and the auditor read; and
Powertools' own key layout and DynamoDB's TTL (``expiration``) apply unchanged. The user is
part of the hashed key (``[user, key]``), so no user can read or replay another's answers.

Without ``ATTO_IDEMPOTENCY_TABLE`` answers are not stored: a repeat of a charged key gets
the ledger's 409 ``idempotency_conflict`` while the ledger holds its charge. boto3 is
blocking: its calls run in a worker thread so they never stall the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any

from ..exceptions import LimiterUnavailable

#: The DynamoDB table of stored answers (unset: answers are not stored).
IDEMPOTENCY_TABLE_ENV = "ATTO_IDEMPOTENCY_TABLE"
#: How long a served answer is kept, seconds.
IDEMPOTENCY_TTL_S = "IDEMPOTENCY_TTL_S"
DEFAULT_TTL_S = 3600
#: The prefix of every record's key, the same in every function: a key reused on another
#: route is a reuse (422), not a second charge.
KEY_PREFIX = "atto"
REPLAY_HEADER = "idempotent-replayed"
_STORED_HEADERS = {"content-type"}
#: The largest answer body stored in one item (DynamoDB's item limit is 400 KB, key and
#: attributes included); a larger body is stored compressed, in parts of this size when
#: even that is larger.
MAX_STORED_BYTES = 300_000
#: The most parts of one compressed answer (4.8 MB: Lambda's 6 MB response limit, JSON
#: numbers compressed); a larger answer is recorded as served without its body.
MAX_PARTS = 16
#: A part's item key: the record's key and this suffix with the part's index.
PART_SUFFIX = "#part"
#: The client's bounds: a claim or a store waits at most this long per attempt.
CONNECT_TIMEOUT_S, READ_TIMEOUT_S, MAX_ATTEMPTS = 1.0, 2.0, 2

_store: Any = None


@dataclass(frozen=True)
class Replay:
    """A stored answer.

    Attributes:
        status: its HTTP status.
        headers: its stored headers (the content type).
        body: its body.
    """

    status: int
    headers: list[tuple[str, str]]
    body: bytes


class InFlight(Exception):
    """The first request with this key is still running."""


class KeyReused(Exception):
    """The key was used with a different request."""


class AnswerGone(Exception):
    """The key's request was served and charged once; its answer is not kept."""


def enabled() -> bool:
    """Whether answers are stored (``ATTO_IDEMPOTENCY_TABLE`` is set)."""
    return bool(os.environ.get(IDEMPOTENCY_TABLE_ENV, "").strip())


def _persistence() -> Any:
    global _store
    if _store is None:
        import boto3
        from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig
        from aws_lambda_powertools.utilities.idempotency.persistence.dynamodb import (
            DynamoDBPersistenceLayer,
        )
        from botocore.config import Config

        from ..entitlements.config import (
            AWS_DEFAULT_REGION_ENV,
            AWS_REGION_ENV,
            DYNAMODB_ENDPOINT_ENV,
            env_reader,
        )

        get = env_reader()
        client = boto3.client(
            "dynamodb", endpoint_url=get(DYNAMODB_ENDPOINT_ENV),
            region_name=get(AWS_REGION_ENV) or get(AWS_DEFAULT_REGION_ENV),
            config=Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                          retries={"total_max_attempts": MAX_ATTEMPTS, "mode": "standard"}))
        layer = DynamoDBPersistenceLayer(table_name=get(IDEMPOTENCY_TABLE_ENV) or "",
                                         boto3_client=client)
        layer.configure(
            IdempotencyConfig(event_key_jmespath="[user, key]",
                              payload_validation_jmespath="request",
                              expires_after_seconds=int(os.environ.get(IDEMPOTENCY_TTL_S,
                                                                       DEFAULT_TTL_S)),
                              hash_function="sha256"),
            key_prefix=KEY_PREFIX)
        _store = layer
    return _store


def reset() -> None:
    """Forget the store (tests, a restored snapshot, a new environment)."""
    global _store
    _store = None


def record_data(
    user: str, key: str, method: str, path: str, query: bytes, body: bytes
) -> dict[str, Any]:
    """What identifies the record (user, key) and what must match on a repeat (request)."""
    digest = hashlib.sha256(b"\0".join([method.encode(), path.encode(), query, body])).hexdigest()
    return {"user": user, "key": key, "request": digest}


async def begin(data: dict[str, Any], remaining_ms: int) -> Replay | None:
    """Claim the key; None to proceed, a ``Replay`` when a stored answer exists.

    Raises:
        InFlight: the first request with this key is still running.
        KeyReused: the key was used for a different request.
        AnswerGone: the key's request was served and charged once; its answer is not kept.
        LimiterUnavailable: DynamoDB could not be reached (nothing was charged).
    """
    from aws_lambda_powertools.utilities.idempotency import exceptions as ex

    try:
        record = await asyncio.to_thread(_claim, data, remaining_ms)
        if record is None:
            return None
    except ex.IdempotencyValidationError as exc:
        raise KeyReused() from exc
    except ex.IdempotencyItemNotFoundError:
        return await begin(data, remaining_ms)  # deleted between our two calls: try again
    except Exception as exc:
        raise LimiterUnavailable(f"idempotency store unavailable: {exc}") from exc
    if record.status != "COMPLETED":
        raise InFlight()
    stored = record.response_json_as_dict() or {}
    body = stored.get("body")
    packed = stored.get("zbody")
    if "parts" in stored:
        try:
            packed = await asyncio.to_thread(_read_parts, record.idempotency_key,
                                             int(stored["parts"]))
        except Exception as exc:
            raise LimiterUnavailable(f"idempotency store unavailable: {exc}") from exc
    if packed is not None:
        body = zlib.decompress(base64.b64decode(packed)).decode("utf-8", "replace")
    if body is None:
        raise AnswerGone()
    return Replay(int(stored.get("status", 200)),
                  [(k, v) for k, v in stored.get("headers", [])], str(body).encode())


def _claim(data: dict[str, Any], remaining_ms: int) -> Any:
    """Save the INPROGRESS record; None when saved, else the existing record (validated
    against this request's payload): the one the refused PutItem returned, else read."""
    from aws_lambda_powertools.utilities.idempotency import exceptions as ex

    layer = _persistence()
    try:
        layer.save_inprogress(data, remaining_ms)
        return None
    except ex.IdempotencyItemAlreadyExistsError as exc:
        if exc.old_data_record is not None:
            return exc.old_data_record
    return layer.get_record(data)


def _read_parts(idempotency_key: str, count: int) -> str | None:
    """The compressed answer stored in ``count`` parts; None when one is gone."""
    layer = _persistence()
    parts = []
    for i in range(count):
        item = layer.client.get_item(
            TableName=layer.table_name, ConsistentRead=True,
            Key={layer.key_attr: {"S": f"{idempotency_key}{PART_SUFFIX}{i}"}}).get("Item")
        if item is None:
            return None
        parts.append(item[layer.data_attr]["S"])
    return "".join(parts)


def stored_result(status: int, headers: list[tuple[bytes, bytes]],
                  body: bytes) -> tuple[dict[str, Any], list[str]]:
    """What is stored of a successful answer: status, content type and body (compressed
    when large, and then in parts when still larger; left out, and so "gone" on a repeat,
    beyond ``MAX_PARTS``).

    Returns:
        The record's data, and the parts to store beside it (none for a small answer).
    """
    kept = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
            if k.decode("latin-1").lower() in _STORED_HEADERS]
    result: dict[str, Any] = {"status": status, "headers": kept}
    if len(body) <= MAX_STORED_BYTES:
        result["body"] = body.decode("utf-8", "replace")
        return result, []
    packed = base64.b64encode(zlib.compress(body, 6)).decode("ascii")
    if len(packed) <= MAX_STORED_BYTES:
        result["zbody"] = packed
        return result, []
    parts = [packed[i:i + MAX_STORED_BYTES] for i in range(0, len(packed), MAX_STORED_BYTES)]
    if len(parts) > MAX_PARTS:
        return result, []
    result["parts"] = len(parts)
    return result, parts


def _save(data: dict[str, Any], result: dict[str, Any], parts: list[str]) -> None:
    """Write an answer's parts (each expiring with the record), then the record."""
    layer = _persistence()
    if parts:
        key = layer._get_hashed_idempotency_key(data)
        expiry = str(layer._get_expiry_timestamp())
        for i, part in enumerate(parts):
            layer.client.put_item(TableName=layer.table_name, Item={
                layer.key_attr: {"S": f"{key}{PART_SUFFIX}{i}"},
                layer.expiry_attr: {"N": expiry}, layer.status_attr: {"S": "PART"},
                layer.data_attr: {"S": part}})
    layer.save_success(data, result)


async def complete(data: dict[str, Any], status: int, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> None:
    """Store a successful answer for repeats (before it is sent).

    A store that failed may still have applied (its reply lost after botocore's last
    attempt): the record is then read back, and an answer found stored is as good as one
    confirmed. Withholding it would delete the record, and its repeat would run again.

    Raises:
        Exception: whatever the store raised, when the answer is not found stored either;
            the answer must then not be sent.
    """
    result, parts = stored_result(status, headers, body)
    try:
        await asyncio.to_thread(_save, data, result, parts)
    except Exception:
        if not await asyncio.to_thread(_stored, data, result):
            raise


def _stored(data: dict[str, Any], result: dict[str, Any]) -> bool:
    """Whether the record holds ``result`` as its COMPLETED answer (False when it cannot
    be read). Its parts were written before it, each confirmed, so they stand with it."""
    try:
        record = _persistence().get_record(data)
    except Exception:
        return False
    return (record is not None and record.status == "COMPLETED"
            and record.response_json_as_dict() == json.loads(json.dumps(result)))


async def abandon(data: dict[str, Any]) -> None:
    """Delete the record of a failed request so that a retry may run."""
    await asyncio.to_thread(lambda: _persistence().delete_record(data,
                                                                 RuntimeError("request failed")))


def create_table(client: Any, table: str) -> None:
    """Create the stored answers' table as template.yaml declares it (the local stack, tests):
    ``id`` (string) the only key, DynamoDB's TTL on ``expiration``. An existing table is
    left as it is."""
    try:
        client.create_table(TableName=table, BillingMode="PAY_PER_REQUEST",
                            AttributeDefinitions=[{"AttributeName": "id",
                                                   "AttributeType": "S"}],
                            KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}])
    except client.exceptions.ResourceInUseException:
        return
    client.update_time_to_live(TableName=table, TimeToLiveSpecification={
        "Enabled": True, "AttributeName": "expiration"})
