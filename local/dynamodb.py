"""A local DynamoDB for the entitlements table: moto's server, started by the local stack.

The functions reach it over HTTP through ``ATTO_DYNAMODB_ENDPOINT``, with the same boto3
code path as in AWS, so every worker process of ``make serve`` shares one table.

moto's backends are not safe to run from several threads at once (two transactions on one
item can interleave, or fail with "dictionary changed size during iteration"), so the
server handles one request at a time, as DynamoDB's own serialisation of writes to an item
would: connections are still accepted concurrently (HTTP/1.0, one request each).

Faults (``DynamoServer.inject``), for harnesses whose DynamoDB clients live in other
processes: for a while, calls of the named operations are refused as DynamoDB refuses them
(``REFUSALS``: a transaction cancelled for a conflict, throttling, the service unavailable),
or applied with their answer lost (the connection is closed before the reply). ``refusal``
gives the error response of each kind, the one botocore raises as a ``ClientError``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from .redis_servers import free_port

#: The table's name in the local stack.
LOCAL_TABLE = "atto-local-entitlements"
#: The usage records' table in the local stack.
LOCAL_USAGE_TABLE = "atto-local-usage"
#: The stored answers' table (``Idempotency-Key``) in the local stack.
LOCAL_IDEMPOTENCY_TABLE = "atto-local-idempotency"
#: How DynamoDB refuses a call: fault kind -> (HTTP status, error code).
REFUSALS = {
    "conflict": (400, "TransactionCanceledException"),  # TransactionConflict on every item
    "throttle": (400, "ThrottlingException"),
    "capacity": (400, "ProvisionedThroughputExceededException"),
    "down": (503, "ServiceUnavailable"),
}
#: Every fault kind: a refusal, or ``lost`` (the call is applied, its answer never sent).
FAULT_KINDS = (*REFUSALS, "lost")


def refusal(kind: str, items: int = 1) -> dict[str, Any]:
    """The error response DynamoDB gives for a call refused as ``kind`` (``REFUSALS``).

    Args:
        kind: ``conflict``, ``throttle``, ``capacity`` or ``down``.
        items: the transaction's item count (a conflict names a reason per item).

    Returns:
        ``{"Error": {"Code", "Message"}}``, with ``CancellationReasons`` for a conflict:
        what ``ClientError.response`` holds.

    Raises:
        KeyError: ``kind`` is not a refusal.
    """
    status, code = REFUSALS[kind]
    out: dict[str, Any] = {"Error": {"Code": code, "Message": f"injected {kind}"},
                           "ResponseMetadata": {"HTTPStatusCode": status}}
    if kind == "conflict":
        out["CancellationReasons"] = [{"Code": "TransactionConflict",
                                       "Message": "Transaction is ongoing for the item"}
                                      ] * max(1, items)
    return out


@dataclass
class Fault:
    """One injected fault: ``kind`` on ``operations`` until ``until`` (epoch s), for at
    most ``count`` calls (None: every call meanwhile)."""

    kind: str
    operations: frozenset[str]
    until: float
    count: int | None = None
    hits: int = 0


#: How often kept tables are written to their file while the server runs, seconds.
SAVE_EVERY_S = 5.0


class DynamoServer:
    """moto's DynamoDB server on a private loopback port, with the entitlements table, the
    usage records' table and the stored answers' table (``Idempotency-Key``).

    Args:
        table, usage_table: the tables' names (the usage table's default: ``atto-local-usage``
            beside the default table, else ``<table>-usage``; the stored answers' table
            follows the same rule: ``atto-local-idempotency``, else ``<table>-idempotency``).
        state_file: keep the tables across restarts: their items are read from this JSON
            file at start (when it exists) and written back every ``SAVE_EVERY_S`` and at
            stop; None (the default) keeps nothing.

    Attributes:
        url: the endpoint, ``http://127.0.0.1:<port>``.
        table: the entitlements table's name.
        usage_table: the usage records' table's name.
        idempotency_table: the stored answers' table's name.
    """

    def __init__(self, table: str = LOCAL_TABLE, usage_table: str | None = None, *,
                 state_file: str | None = None) -> None:
        self.table = table
        # moto keeps one backend per process, whatever the port: two servers of one
        # process see each other's tables, so a server's usage table follows its own name
        self.usage_table = usage_table or (LOCAL_USAGE_TABLE if table == LOCAL_TABLE
                                           else f"{table}-usage")
        self.idempotency_table = (LOCAL_IDEMPOTENCY_TABLE if table == LOCAL_TABLE
                                  else f"{table}-idempotency")
        self.state_file = state_file
        self._client: Any = None
        self._stop: Any = None
        self._saver: Any = None
        self.port = 0
        self.url = ""
        self._server: object | None = None
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        #: calls met by a fault, per kind
        self.injected: dict[str, int] = {}

    def inject(self, kind: str, *, operations: tuple[str, ...] = ("TransactWriteItems",),
               seconds: float = 1.0, count: int | None = None) -> Fault:
        """Fail calls of ``operations`` as ``kind`` for ``seconds`` (at most ``count`` calls).

        Raises:
            ValueError: ``kind`` is not one of ``FAULT_KINDS``.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown DynamoDB fault {kind!r}; one of {FAULT_KINDS}")
        fault = Fault(kind, frozenset(operations), time.time() + seconds, count)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """End every injected fault now."""
        with self._lock:
            self._faults.clear()

    def _fault_for(self, operation: str) -> Fault | None:
        now = time.time()
        with self._lock:
            self._faults = [f for f in self._faults if f.until > now
                            and (f.count is None or f.hits < f.count)]
            for fault in self._faults:
                if operation in fault.operations:
                    fault.hits += 1
                    self.injected[fault.kind] = self.injected.get(fault.kind, 0) + 1
                    return fault
        return None

    def __enter__(self) -> DynamoServer:
        import warnings

        self.port = free_port()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = _serial_moto_server(ip_address="127.0.0.1", port=self.port,
                                         verbose=False, faults=self._fault_for)
        server.start()
        self._server = server
        self.url = f"http://127.0.0.1:{self.port}"
        import boto3

        from usage_limits.entitlements.config import StoreSettings
        from usage_limits.entitlements.store import EntitlementStore
        from usage_limits.entitlements.usage_store import UsageSettings, UsageStore
        from usage_limits.web import idempotency

        region = os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        # The local server accepts any credentials; these keep the shell's real ones unused.
        client = boto3.client("dynamodb", endpoint_url=self.url, region_name=region,
                              aws_access_key_id="local", aws_secret_access_key="local")
        EntitlementStore(StoreSettings(table=self.table, endpoint_url=self.url, region=region),
                         client=client).create_table()
        UsageStore(UsageSettings(table=self.usage_table, endpoint_url=self.url, region=region),
                   client=client).create_table()
        idempotency.create_table(client, self.idempotency_table)
        self._client = client
        if self.state_file:
            self._restore()
            self._stop = threading.Event()
            self._saver = threading.Thread(target=self._save_often, daemon=True,
                                           name="dynamodb-state")
            self._saver.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._saver is not None:
            self._stop.set()
            self._saver.join(10)
            self._saver = None
            self.save()
        if self._server is not None:
            self._server.stop()  # type: ignore[attr-defined]
            self._server = None

    def save(self) -> None:
        """Write every item of the three tables to ``state_file`` (atomically: a new file, then a
        rename), as DynamoDB JSON."""
        if not self.state_file:
            return
        tables: dict[str, list[Any]] = {}
        for table in (self.table, self.usage_table, self.idempotency_table):
            items = tables[table] = []
            for page in self._client.get_paginator("scan").paginate(TableName=table,
                                                                    ConsistentRead=True):
                items.extend(page["Items"])
        temporary = self.state_file + ".new"
        with open(temporary, "w", encoding="utf-8") as out:
            json.dump({"tables": tables}, out)
        os.replace(temporary, self.state_file)

    def _restore(self) -> None:
        """Put back the items ``state_file`` holds (none when it does not exist)."""
        assert self.state_file
        if not os.path.exists(self.state_file):
            return
        with open(self.state_file, encoding="utf-8") as source:
            tables = json.load(source)["tables"]
        for table, items in tables.items():
            if table not in (self.table, self.usage_table, self.idempotency_table):
                continue
            for start in range(0, len(items), 25):
                batch = [{"PutRequest": {"Item": item}} for item in items[start:start + 25]]
                self._client.batch_write_item(RequestItems={table: batch})

    def _save_often(self) -> None:
        while not self._stop.wait(SAVE_EVERY_S):
            try:
                self.save()
            except Exception as exc:  # a failed save leaves the previous file; say so
                print(f"make serve: could not keep the local DynamoDB state: {exc}",
                      file=sys.stderr)


def _refused(kind: str, environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """Answer the request as DynamoDB refusing it (its body is read, then ignored)."""
    length = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(length) if length else b""
    try:
        items = len(json.loads(body or b"{}").get("TransactItems") or ())
    except ValueError:
        items = 1
    error = refusal(kind, items)
    status, code = REFUSALS[kind]
    payload: dict[str, Any] = {"__type": f"com.amazonaws.dynamodb.v20120810#{code}",
                               "message": error["Error"]["Message"]}
    if "CancellationReasons" in error:
        payload["CancellationReasons"] = error["CancellationReasons"]
    data = json.dumps(payload).encode()
    start_response(f"{status} {'Bad Request' if status == 400 else 'Service Unavailable'}",
                   [("Content-Type", "application/x-amz-json-1.0"),
                    ("Content-Length", str(len(data)))])
    return [data]


def _serial_moto_server(*, faults: Any = None, **kwargs: object) -> Any:
    """moto's threaded server whose application runs one request at a time (moto is
    imported here, when the local stack first needs it); ``faults(operation)`` gives the
    fault to apply to a call, or None."""

    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    class Quiet(MotoRequestHandler):  # type: ignore[misc]
        """No access log: one line per request (red for a conditional write refused, which
        is normal here) would flood the make serve terminal. Errors are still logged."""

        def log_request(self, *args: object) -> None:
            pass

    class Serial(ThreadedMotoServer):  # type: ignore[misc]
        def _server_entry(self) -> None:
            app = DomainDispatcherApplication(create_backend_app)
            lock = threading.Lock()

            def serial(environ: dict[str, Any], start_response: Any) -> list[bytes]:
                target = str(environ.get("HTTP_X_AMZ_TARGET", ""))
                fault = faults(target.rpartition(".")[2]) if faults and target else None
                if fault is not None and fault.kind != "lost":
                    return _refused(fault.kind, environ, start_response)
                with lock:
                    body = list(app(environ, start_response))
                if fault is not None:  # applied; the answer never reaches the caller
                    sock = environ.get("werkzeug.socket")
                    if sock is not None:
                        sock.shutdown(socket.SHUT_RDWR)
                return body

            self._server = make_server(self._ip_address, self._port, serial, True,
                                       request_handler=Quiet)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Serial(**kwargs)
