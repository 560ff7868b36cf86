"""The local DynamoDB server a test module starts, with the credentials boto3 needs for it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from local.dynamodb import DynamoServer


@contextmanager
def local_dynamo(table: str) -> Iterator[DynamoServer]:
    """A local DynamoDB server (moto over HTTP) with the project's tables, ``table`` naming
    the entitlements table; local credentials and region are set while it runs."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            mp.setenv(name, "local")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        with DynamoServer(table=table) as server:
            yield server
