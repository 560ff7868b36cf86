"""Redis password from Secrets Manager (moto): formats, caching and error classes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from moto import mock_aws

from usage_limits import connection
from usage_limits.connection import clear_secret_cache, read_redis_secret, redis_from_env
from usage_limits.exceptions import InvalidArgument, LimiterUnavailable

REGION = "eu-west-1"


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A mocked AWS account with dummy credentials; secret caches start empty."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION,
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    clear_secret_cache()
    with mock_aws():
        yield boto3.client("secretsmanager", region_name=REGION)
    clear_secret_cache()


def put(sm: Any, name: str, value: str) -> str:
    arn: str = sm.create_secret(Name=name, SecretString=value)["ARN"]
    return arn


def test_plain_string_is_the_password(aws: Any) -> None:
    """A secret that is not a JSON object is used whole as the password, with no user."""
    arn = put(aws, "plain", "s3cret{not-json")
    assert read_redis_secret(arn, REGION) == (None, "s3cret{not-json")


def test_json_secret_gives_username_and_password(aws: Any) -> None:
    """The RDS/ElastiCache rotation format {"username", "password"} is understood."""
    put(aws, "rbac", json.dumps({"username": "app", "password": "pw", "engine": "valkey"}))
    assert read_redis_secret("rbac", REGION) == ("app", "pw")


def test_json_without_username_uses_password_only(aws: Any) -> None:
    """A JSON secret may omit the username."""
    put(aws, "pw-only", json.dumps({"password": "pw"}))
    assert read_redis_secret("pw-only", REGION) == (None, "pw")


@pytest.mark.parametrize("value", [json.dumps({"user": "x"}), json.dumps({"password": ""}),
                                   json.dumps({"password": 5}),
                                   json.dumps({"password": "p", "username": 7})])
def test_json_without_a_usable_password_is_a_configuration_error(aws: Any, value: str) -> None:
    """A JSON object without a non-empty password string raises InvalidArgument."""
    put(aws, "bad", value)
    with pytest.raises(InvalidArgument, match="'bad'"):
        read_redis_secret("bad", REGION)


def test_missing_secret_is_a_configuration_error(aws: Any) -> None:
    """A secret that does not exist raises InvalidArgument naming it and the AWS error code."""
    with pytest.raises(InvalidArgument, match="'nope'.*ResourceNotFoundException"):
        read_redis_secret("nope", REGION)


def test_secret_is_read_once_per_process(aws: Any) -> None:
    """After the first read the cached value is used, even if the secret is gone."""
    put(aws, "once", "pw1")
    assert read_redis_secret("once", REGION) == (None, "pw1")
    aws.delete_secret(SecretId="once", ForceDeleteWithoutRecovery=True)
    assert read_redis_secret("once", REGION) == (None, "pw1")
    clear_secret_cache()
    with pytest.raises(InvalidArgument):
        read_redis_secret("once", REGION)


class FailingClient:
    """Stands in for the boto3 client and raises the error it was given."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def get_secret_value(self, **_: Any) -> Any:
        raise self.error


@pytest.mark.parametrize(("error", "expected"), [
    (EndpointConnectionError(endpoint_url="https://secretsmanager"), LimiterUnavailable),
    (ClientError({"Error": {"Code": "ThrottlingException"}}, "GetSecretValue"), LimiterUnavailable),
    (ClientError({"Error": {"Code": "InternalServiceError"}}, "GetSecretValue"),
     LimiterUnavailable),
    (ClientError({"Error": {"Code": "AccessDeniedException"}}, "GetSecretValue"), InvalidArgument),
])
def test_aws_failures_are_classified(monkeypatch: pytest.MonkeyPatch, error: Exception,
                                     expected: type[Exception]) -> None:
    """Unreachable or failing AWS is LimiterUnavailable; a denied read is InvalidArgument."""
    clear_secret_cache()
    monkeypatch.setattr(connection, "_secrets_client", lambda region: FailingClient(error))
    with pytest.raises(expected) as info:
        read_redis_secret("s", REGION)
    assert info.value.__cause__ is error
    clear_secret_cache()


def test_secret_auth_puts_the_secret_into_the_pool(aws: Any) -> None:
    """REDIS_AUTH=secret passes the secret's user and password to every connection."""
    arn = put(aws, "rbac", json.dumps({"username": "app", "password": "pw"}))
    client = redis_from_env({"REDIS_URL": "rediss://cache:6379", "REDIS_AUTH": "secret",
                             "REDIS_SECRET_ARN": arn, "AWS_REGION": REGION})
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"]) == ("app", "pw")


def test_redis_user_beats_the_secret_username(aws: Any) -> None:
    """An explicit REDIS_USER wins over the username stored in the secret."""
    put(aws, "rbac", json.dumps({"username": "app", "password": "pw"}))
    client = redis_from_env({"REDIS_URL": "redis://h:1", "REDIS_AUTH": "secret",
                             "REDIS_SECRET_ARN": "rbac", "REDIS_USER": "other",
                             "AWS_REGION": REGION})
    assert client.connection_pool.connection_kwargs["username"] == "other"
