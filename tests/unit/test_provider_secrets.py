"""Provider credentials come from Secrets Manager (moto) through Powertools Parameters."""

from __future__ import annotations

import json
from collections.abc import Iterator

import boto3
import pytest
from moto import mock_aws

from atto_providers.secrets import provider_secret
from usage_limits.web.errors import ProviderError


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A moto Secrets Manager, with Powertools' parameter cache cleared."""
    from aws_lambda_powertools.utilities import parameters

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    parameters.clear_caches()
    with mock_aws():
        yield
    parameters.clear_caches()


def test_json_secret_gives_every_field(aws: None) -> None:
    """A JSON secret (Adzuna's app id and key) is returned field by field."""
    arn = boto3.client("secretsmanager").create_secret(
        Name="atto/test/adzuna", SecretString=json.dumps({"app_id": "id1", "app_key": "k1"}))["ARN"]
    assert provider_secret("salary", {"SALARY_SECRET_ARN": arn}) == {"app_id": "id1",
                                                                     "app_key": "k1"}


def test_plain_secret_is_the_api_key(aws: None) -> None:
    """A plain-string secret is the provider's API key."""
    boto3.client("secretsmanager").create_secret(Name="atto/test/llm", SecretString="sk-123 ")
    assert provider_secret("llm", {"LLM_SECRET_ARN": "atto/test/llm"}) == {"api_key": "sk-123"}


def test_missing_secret_is_a_provider_error_without_the_value(aws: None) -> None:
    """An unreadable secret becomes a provider error that names the provider, never a value."""
    with pytest.raises(ProviderError) as err:
        provider_secret("search", {"SEARCH_SECRET_ARN": "atto/test/missing"})
    assert "search" in str(err.value)


def test_environment_is_used_without_an_arn() -> None:
    """Locally, with no ARN, the credentials come from the provider's variables only."""
    env = {"SEARCH_API_KEY": "tvly-1", "LLM_API_KEY": "other", "SEARCH_OTHER": "x"}
    assert provider_secret("search", env) == {"api_key": "tvly-1"}
