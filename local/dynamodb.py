"""A local DynamoDB for the entitlements table: moto's server, started by the local stack.

The functions reach it over HTTP through ``ATTO_DYNAMODB_ENDPOINT``, with the same boto3
code path as in AWS, so every worker process of ``make serve`` shares one table.

moto's backends are not safe to run from several threads at once (two transactions on one
item can interleave, or fail with "dictionary changed size during iteration"), so the
server handles one request at a time, as DynamoDB's own serialisation of writes to an item
would: connections are still accepted concurrently (HTTP/1.0, one request each).
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

from .redis_servers import free_port

#: The table's name in the local stack.
LOCAL_TABLE = "atto-local-entitlements"
#: The usage records' table in the local stack.
LOCAL_USAGE_TABLE = "atto-local-usage"


class DynamoServer:
    """moto's DynamoDB server on a private loopback port, with the entitlements table and
    the usage records' table.

    Attributes:
        url: the endpoint, ``http://127.0.0.1:<port>``.
        table: the entitlements table's name.
        usage_table: the usage records' table's name.
    """

    def __init__(self, table: str = LOCAL_TABLE, usage_table: str = LOCAL_USAGE_TABLE) -> None:
        self.table = table
        self.usage_table = usage_table
        self.port = 0
        self.url = ""
        self._server: object | None = None

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
        from usage_limits.entitlements.usage_store import UsageSettings, UsageStore

        region = os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        # The local server accepts any credentials; these keep the shell's real ones unused.
        client = boto3.client("dynamodb", endpoint_url=self.url, region_name=region,
                              aws_access_key_id="local", aws_secret_access_key="local")
        EntitlementStore(StoreSettings(table=self.table, endpoint_url=self.url, region=region),
                         client=client).create_table()
        UsageStore(UsageSettings(table=self.usage_table, endpoint_url=self.url, region=region),
                   client=client).create_table()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._server is not None:
            self._server.stop()  # type: ignore[attr-defined]
            self._server = None


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
