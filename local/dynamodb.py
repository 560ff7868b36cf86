"""A local DynamoDB for the entitlements table: moto's server, started by the local stack.

The functions reach it over HTTP through ``ATTO_DYNAMODB_ENDPOINT``, with the same boto3
code path as in AWS, so every worker process of ``make serve`` shares one table.
"""

from __future__ import annotations

import os
from types import TracebackType

from .redis_servers import free_port

#: The table's name in the local stack.
LOCAL_TABLE = "atto-local-entitlements"


class DynamoServer:
    """moto's DynamoDB server on a private loopback port, with the entitlements table.

    Attributes:
        url: the endpoint, ``http://127.0.0.1:<port>``.
        table: the entitlements table's name.
    """

    def __init__(self, table: str = LOCAL_TABLE) -> None:
        self.table = table
        self.port = 0
        self.url = ""
        self._server: object | None = None

    def __enter__(self) -> DynamoServer:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from moto.server import ThreadedMotoServer

        self.port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
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
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._server is not None:
            self._server.stop()  # type: ignore[attr-defined]
            self._server = None
