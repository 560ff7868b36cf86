"""What the entitlements and usage stores share: one lazily made DynamoDB client, errors
mapped to ``StoreUnavailable``, and items (de)serialized.

A refused condition (``ConditionalCheckFailedException``, and for the entitlements store a
cancelled transaction) is re-raised as it is: what it means is the caller's to decide.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from .exceptions import StoreUnavailable

T = TypeVar("T")


class ClientSettings(Protocol):
    """The settings a store's DynamoDB client is made from (read-only, as the frozen
    settings classes have them)."""

    @property
    def table(self) -> str: ...
    @property
    def endpoint_url(self) -> str | None: ...
    @property
    def region(self) -> str | None: ...
    @property
    def connect_timeout_s(self) -> float: ...
    @property
    def read_timeout_s(self) -> float: ...
    @property
    def max_attempts(self) -> int: ...


class DynamoTable:
    """One DynamoDB table reached through a boto3 client.

    Args:
        settings: where the table is and how the client times out and retries.
        client: a boto3 DynamoDB client to use instead of making one.
        name: how errors name the store ("the entitlements store ...").
        passthrough: error codes re-raised as they are.
    """

    def __init__(self, settings: ClientSettings, client: Any, *, name: str,
                 passthrough: frozenset[str]) -> None:
        self.table = settings.table
        self._client_settings = settings
        self._client = client
        self._name = name
        self._passthrough = passthrough

    @property
    def client(self) -> Any:
        """The DynamoDB client, made on first use."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            s = self._client_settings
            self._client = boto3.client(
                "dynamodb", region_name=s.region, endpoint_url=s.endpoint_url,
                config=Config(connect_timeout=s.connect_timeout_s,
                              read_timeout=s.read_timeout_s,
                              retries={"total_max_attempts": s.max_attempts,
                                       "mode": "standard"}))
        return self._client

    def _call(self, fn: Callable[..., T], **kwargs: Any) -> T:
        """Call the client; botocore errors become ``StoreUnavailable``."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in self._passthrough:
                raise
            raise StoreUnavailable(f"the {self._name} store refused the call: {code}") from exc
        except BotoCoreError as exc:
            raise StoreUnavailable(f"the {self._name} store is unreachable: {exc}") from exc

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
