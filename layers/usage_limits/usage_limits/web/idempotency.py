"""Idempotent responses: the same ``Idempotency-Key`` from the same user gets the same answer.

Built on Powertools idempotency with its Redis cache persistence, on the same Redis as the
ledger. For a request carrying ``Idempotency-Key`` from an identified user:

- first time: an INPROGRESS record is written (expiring with the request's deadline, so a
  Lambda killed at timeout leaves an orphan Powertools can take over), the route runs,
  and a 2xx response (status, content type, body) is stored as COMPLETED for
  ``IDEMPOTENCY_TTL_S`` seconds; a failed request deletes its record, so a retry may run;
- a repeat after success: the stored response is returned with ``Idempotent-Replayed:
  true``; no tokens are reserved and no provider is called;
- a repeat while the first is in flight: 409 ``idempotency_conflict``;
- the same key with a different method, path, query or body: 409 ``idempotency_conflict``.

The key is scoped to the user (the user id is part of the hashed record key), so no user
can read or replay another user's responses. Powertools' client is blocking; its calls
run in a worker thread so they never stall the event loop.

A success whose answer could not be stored (Redis out of memory, unreachable, or the
clean-up budget spent) is kept in the execution environment and written again before
the next request it serves, like a kept refund: at most ``MAX_KEPT`` are kept, each for
at most the record's TTL, and before a request up to ``RETRY_BATCH`` are written at once,
each within ``RETRY_EACH_S``. Until it lands, a repeat of the key gets 409: "in progress"
(with Retry-After) while the claim lives, then the ledger's "already charged".
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..exceptions import LimiterUnavailable

IDEMPOTENCY_TTL_S = "IDEMPOTENCY_TTL_S"
DEFAULT_TTL_S = 3600
KEY_PREFIX = "ul:idem"
REPLAY_HEADER = "idempotent-replayed"
_STORED_HEADERS = {"content-type"}

_store: Any = None

#: Successful answers kept to be stored again, per execution environment (oldest dropped).
MAX_KEPT = 100
#: Kept answers written before one request, at most (at once).
RETRY_BATCH = 16
#: The longest one kept answer's write may take before a request.
RETRY_EACH_S = 0.2


@dataclass(frozen=True)
class Replay:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


class InFlight(Exception):
    """The first request with this key is still running."""


class KeyReused(Exception):
    """The key was used with a different request."""


def _persistence() -> Any:
    global _store
    if _store is None:
        import warnings

        from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig
        from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
            CachePersistenceLayer,
        )

        from ..connection import redis_from_env

        # Powertools marks the cache layer's class for renaming; subclassing warns.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)

            class Persistence(CachePersistenceLayer):
                """Powertools' cache layer, keeping the payload hash on COMPLETED records,
                and reading an existing record once per claim.

                Its own ``_update_record`` drops the hash when a record completes, after which
                every repeat fails payload validation; this writes the same record with it.
                Its ``save_inprogress`` reads the record it found (GET) to decide, and
                ``get_record`` would read it again: within ``claim`` the second read reuses
                the first, so a repeat costs two round trips (SET NX, GET), not three.
                """

                reads = threading.local()

                def _get_record(self, idempotency_key: str) -> Any:
                    memo: dict[str, Any] | None = getattr(self.reads, "memo", None)
                    if memo is not None and idempotency_key in memo:
                        return memo.pop(idempotency_key)
                    record = super()._get_record(idempotency_key)
                    if memo is not None:
                        memo[idempotency_key] = record
                    return record

                def _update_record(self, data_record: Any) -> None:
                    item = {self.data_attr: data_record.response_data,
                            self.status_attr: data_record.status,
                            self.expiry_attr: data_record.expiry_timestamp}
                    if self.payload_validation_enabled:
                        item[self.validation_key_attr] = data_record.payload_hash
                    self.client.set(name=data_record.idempotency_key,
                                    value=self._json_serializer(item),
                                    ex=self._get_expiry_second(data_record.expiry_timestamp))

            layer = Persistence(client=redis_from_env(sync=True))
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
    """Forget the store and the kept answers (tests, a restored snapshot, a new environment)."""
    global _store
    _store = None
    _kept.clear()


def record_data(
    user: str, key: str, method: str, path: str, query: bytes, body: bytes
) -> dict[str, Any]:
    """What identifies the record (user, key) and what must match on a repeat (request)."""
    digest = hashlib.sha256(b"\0".join([method.encode(), path.encode(), query, body])).hexdigest()
    return {"user": user, "key": key, "request": digest}


async def begin(data: dict[str, Any], remaining_ms: int) -> Replay | None:
    """Claim the key; None to proceed, a ``Replay`` when a stored response exists.

    Raises:
        InFlight: the first request with this key is still running.
        KeyReused: the key was used for a different request.
        LimiterUnavailable: Redis could not be reached.
    """
    from aws_lambda_powertools.utilities.idempotency import exceptions as ex

    # One worker thread call (the store is created there too: a cluster client connects
    # when made): the claim, and on a repeat the record that the claim already read.
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
    return Replay(int(stored.get("status", 200)),
                  [(k, v) for k, v in stored.get("headers", [])],
                  str(stored.get("body", "")).encode())


def _claim(data: dict[str, Any], remaining_ms: int) -> Any:
    """Save the INPROGRESS record; None when saved, else the existing record (validated
    against this request's payload)."""
    from aws_lambda_powertools.utilities.idempotency import exceptions as ex

    layer = _persistence()
    layer.reads.memo = {}
    try:
        try:
            layer.save_inprogress(data, remaining_ms)
            return None
        except ex.IdempotencyItemAlreadyExistsError:
            pass
        return layer.get_record(data)
    finally:
        layer.reads.memo = None


async def complete(data: dict[str, Any], status: int, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> None:
    """Store a successful response for repeats."""
    kept = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
            if k.decode("latin-1").lower() in _STORED_HEADERS]
    result = {"status": status, "headers": kept, "body": body.decode("utf-8", "replace")}
    await asyncio.to_thread(lambda: _persistence().save_success(data, result))


async def abandon(data: dict[str, Any]) -> None:
    """Delete the record of a failed request so that a retry may run."""
    await asyncio.to_thread(lambda: _persistence().delete_record(data,
                                                                 RuntimeError("request failed")))


@dataclass(frozen=True)
class _Kept:
    data: dict[str, Any]
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_until: float


_kept: list[_Kept] = []


def keep(data: dict[str, Any], status: int, headers: list[tuple[bytes, bytes]],
         body: bytes) -> None:
    """Keep a successful answer whose write failed, to store it before the next request."""
    ttl_s = int(os.environ.get(IDEMPOTENCY_TTL_S, DEFAULT_TTL_S))
    _kept.append(_Kept(data, status, headers, body, time.monotonic() + ttl_s))
    if len(_kept) > MAX_KEPT:
        _kept.pop(0)


def kept() -> int:
    """How many answers wait to be stored."""
    return len(_kept)


async def retry(each_s: float = RETRY_EACH_S, batch: int = RETRY_BATCH) -> int:
    """Store up to ``batch`` kept answers, at once, each within ``each_s``; a write that
    fails again is kept behind the others.

    Returns:
        How many were stored.
    """
    now, tried = time.monotonic(), []
    for item in list(_kept[:batch]):
        _kept.remove(item)
        if item.keep_until > now:
            tried.append(item)

    async def store(item: _Kept) -> int:
        try:
            async with asyncio.timeout(each_s):
                await complete(item.data, item.status, item.headers, item.body)
        except Exception:  # Redis still failing: keep it
            _kept.append(item)
            return 0
        return 1

    return sum(await asyncio.gather(*(store(item) for item in tried)))
