"""A local DynamoDB for the entitlements table: moto's server, started by the local stack.

The functions reach it over HTTP through ``ATTO_DYNAMODB_ENDPOINT``, with the same boto3
code path as in AWS, so every worker process of ``make serve`` shares one table.

moto's backends are not safe to run from several threads at once (two transactions on one
item can interleave, or fail with "dictionary changed size during iteration"), so the
server handles one request at a time, as DynamoDB's own serialisation of writes to an item
would: connections are still accepted concurrently (HTTP/1.0, one request each).
"""

from __future__ import annotations

import json
import os
import sys
from types import TracebackType
from typing import Any

from .redis_servers import free_port

#: The table's name in the local stack.
LOCAL_TABLE = "atto-local-entitlements"


#: How often a kept table is written to its file while the server runs, seconds.
SAVE_EVERY_S = 5.0


class DynamoServer:
    """moto's DynamoDB server on a private loopback port, with the entitlements table.

    Args:
        table: the table's name.
        state_file: keep the table across restarts: its items are read from this JSON file
            at start (when it exists) and written back every ``SAVE_EVERY_S`` and at stop;
            None (the default) keeps nothing.

    Attributes:
        url: the endpoint, ``http://127.0.0.1:<port>``.
        table: the entitlements table's name.
    """

    def __init__(self, table: str = LOCAL_TABLE, *, state_file: str | None = None) -> None:
        self.table = table
        self.state_file = state_file
        self.port = 0
        self.url = ""
        self._server: object | None = None
        self._client: Any = None
        self._stop: Any = None
        self._saver: Any = None

    def __enter__(self) -> DynamoServer:
        import warnings

        self.port = free_port()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = _serial_moto_server(ip_address="127.0.0.1", port=self.port,
                                         verbose=False)
        server.start()
        self._server = server
        self.url = f"http://127.0.0.1:{self.port}"
        import boto3

        from usage_limits.entitlements.config import StoreSettings
        from usage_limits.entitlements.store import EntitlementStore

        region = os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        # The local server accepts any credentials; these keep the shell's real ones unused.
        client = boto3.client("dynamodb", endpoint_url=self.url, region_name=region,
                              aws_access_key_id="local", aws_secret_access_key="local")
        EntitlementStore(StoreSettings(table=self.table, endpoint_url=self.url, region=region),
                         client=client).create_table()
        self._client = client
        if self.state_file:
            self._restore()
            import threading

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
        """Write every item of the table to ``state_file`` (atomically: a new file, then a
        rename), as DynamoDB JSON."""
        if not self.state_file:
            return
        items: list[Any] = []
        for page in self._client.get_paginator("scan").paginate(TableName=self.table,
                                                                ConsistentRead=True):
            items.extend(page["Items"])
        temporary = self.state_file + ".new"
        with open(temporary, "w", encoding="utf-8") as out:
            json.dump({"table": self.table, "items": items}, out)
        os.replace(temporary, self.state_file)

    def _restore(self) -> None:
        """Put back the items ``state_file`` holds (none when it does not exist)."""
        assert self.state_file
        if not os.path.exists(self.state_file):
            return
        with open(self.state_file, encoding="utf-8") as source:
            items = json.load(source)["items"]
        for start in range(0, len(items), 25):
            batch = [{"PutRequest": {"Item": item}} for item in items[start:start + 25]]
            self._client.batch_write_item(RequestItems={self.table: batch})

    def _save_often(self) -> None:
        while not self._stop.wait(SAVE_EVERY_S):
            try:
                self.save()
            except Exception as exc:  # a failed save leaves the previous file; say so once
                print(f"make serve: could not keep the local DynamoDB state: {exc}",
                      file=sys.stderr)


def _serial_moto_server(**kwargs: object) -> Any:
    """moto's threaded server whose application runs one request at a time (moto is
    imported here, when the local stack first needs it)."""
    import threading

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

            def serial(environ: dict[str, object], start_response: object) -> list[bytes]:
                with lock:
                    return list(app(environ, start_response))

            self._server = make_server(self._ip_address, self._port, serial, True,
                                       request_handler=Quiet)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Serial(**kwargs)
