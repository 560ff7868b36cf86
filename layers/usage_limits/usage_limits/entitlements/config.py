"""Settings of the entitlements store, read once from the environment.

An empty variable counts as unset (SAM passes empty strings for parameters left at their
default). Explicit arguments beat the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache

from ..exceptions import InvalidArgument

#: The DynamoDB table of plan overrides, grants, suspensions and the operator audit log.
ENTITLEMENTS_TABLE_ENV = "ATTO_ENTITLEMENTS_TABLE"
#: Another DynamoDB endpoint (the local stack's); never set in a deployment.
DYNAMODB_ENDPOINT_ENV = "ATTO_DYNAMODB_ENDPOINT"
AWS_REGION_ENV = "AWS_REGION"
AWS_DEFAULT_REGION_ENV = "AWS_DEFAULT_REGION"


@dataclass(frozen=True)
class StoreSettings:
    """Where the entitlements table is.

    Attributes:
        table: the table's name.
        endpoint_url: a DynamoDB endpoint other than AWS's (local serving), else None.
        region: the AWS region (None: botocore's own lookup).
        connect_timeout_s: seconds to wait for a connection.
        read_timeout_s: seconds to wait for an answer.
        max_attempts: attempts per call, retries included (botocore's standard mode).
    """

    table: str
    endpoint_url: str | None = None
    region: str | None = None
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 2.0
    max_attempts: int = 3

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StoreSettings:
        """Read the settings from ``env`` (default ``os.environ``).

        Raises:
            InvalidArgument: ``ATTO_ENTITLEMENTS_TABLE`` is not set.
        """
        get = env_reader(env)
        table = get(ENTITLEMENTS_TABLE_ENV)
        if table is None:
            raise InvalidArgument(f"{ENTITLEMENTS_TABLE_ENV} is not set (the entitlements "
                                  "DynamoDB table)")
        return cls(table=table, endpoint_url=get(DYNAMODB_ENDPOINT_ENV),
                   region=get(AWS_REGION_ENV) or get(AWS_DEFAULT_REGION_ENV))


def env_reader(env: Mapping[str, str] | None = None) -> Callable[[str], str | None]:
    """A lookup of ``env`` (default ``os.environ``) that counts empty or blank as unset."""
    source = os.environ if env is None else env

    def get(name: str) -> str | None:
        return source.get(name, "").strip() or None

    return get


@cache
def store_settings() -> StoreSettings:
    """The process-wide store settings, read once per execution environment."""
    return StoreSettings.from_env()
