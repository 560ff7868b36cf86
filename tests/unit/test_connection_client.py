"""redis_from_env builds the right client with every limit set explicitly (no network)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry  # the asyncio clients need the asyncio Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.credentials import UsernamePasswordCredentialProvider

import usage_limits
from usage_limits.config import ConnectionSettings
from usage_limits.connection import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    ElastiCacheIAMProvider,
    redis_from_env,
)
from usage_limits.exceptions import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]
IAM = {"REDIS_URL": "rediss://atto-abc.serverless.euw1.cache.amazonaws.com:6379",
       "REDIS_CLUSTER": "true", "REDIS_AUTH": "iam", "REDIS_USER": "app",
       "ELASTICACHE_CACHE_NAME": "atto", "AWS_REGION": "eu-west-1"}


def expected_retry(retries: int) -> Retry:
    return Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries)


@pytest.fixture
def dummy_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy static AWS credentials in the environment, as Lambda provides them."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SECRET")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_standalone_client_has_explicit_limits() -> None:
    """Timeouts, retries, health checks, pool size and db come from the settings."""
    client = redis_from_env({"REDIS_URL": "redis://h.example:6390/4",
                             "REDIS_SOCKET_TIMEOUT_S": "0.3", "REDIS_RETRIES": "2"})
    assert isinstance(client, Redis)
    pool = client.connection_pool
    assert isinstance(pool, BlockingConnectionPool)
    assert pool.max_connections == 32 and pool.timeout == pytest.approx(1.3)
    kw = pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"]) == ("h.example", 6390, 4)
    assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (0.3, 1.0)
    assert kw["health_check_interval"] == 30.0 and kw["decode_responses"] is False
    assert client.get_retry() == expected_retry(2)
    assert pool.connection_class is not SSLConnection


def test_rediss_uses_verified_tls() -> None:
    """rediss:// selects SSLConnection with certificate and host name checks."""
    client = redis_from_env({"REDIS_URL": "rediss://h.example:6379",
                             "REDIS_TLS_CA_FILE": "/etc/ca.pem"})
    pool = client.connection_pool
    assert pool.connection_class is SSLConnection
    kw = pool.connection_kwargs
    assert kw["ssl_cert_reqs"] == "required" and kw["ssl_check_hostname"] is True
    assert kw["ssl_ca_certs"] == "/etc/ca.pem"


def test_url_credentials_reach_the_connection() -> None:
    """With REDIS_AUTH=none the URL's user and password are used."""
    kw = redis_from_env({"REDIS_URL": "redis://bob:p%40ss@h:1"}).connection_pool.connection_kwargs
    assert (kw["username"], kw["password"]) == ("bob", "p@ss")


def test_cluster_client_has_explicit_limits() -> None:
    """REDIS_CLUSTER=true gives a RedisCluster with the same limits on every node."""
    client = redis_from_env({"REDIS_URL": "rediss://cfg.example:7000", "REDIS_CLUSTER": "yes",
                             "REDIS_RETRIES": "0", "REDIS_MAX_CONNECTIONS": "4"})
    assert isinstance(client, RedisCluster)
    assert client.retry == expected_retry(0)
    kw = client.get_connection_kwargs()
    assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (0.5, 1.0)
    assert kw["max_connections"] == 4 and kw["health_check_interval"] == 30.0
    assert kw["connection_class"] is SSLConnection
    node = client.startup_nodes[0]
    assert (node.host, node.port) == ("cfg.example", 7000)


def test_iam_auth_wires_the_elasticache_provider(dummy_aws: None) -> None:
    """REDIS_AUTH=iam puts an ElastiCacheIAMProvider for the user and cache on each node."""
    client = redis_from_env(IAM)
    provider = client.get_connection_kwargs()["credential_provider"]
    assert isinstance(provider, ElastiCacheIAMProvider)
    assert (provider.username, provider.cache_name, provider.region, provider.serverless) == (
        "app", "atto", "eu-west-1", True)
    user, token = provider.get_credentials()
    assert user == "app" and token.startswith("atto/?Action=connect&User=app")


def test_iam_for_a_node_based_cache(dummy_aws: None) -> None:
    """ELASTICACHE_SERVERLESS=false signs for a replication group."""
    client = redis_from_env({**IAM, "ELASTICACHE_SERVERLESS": "false"})
    provider = client.get_connection_kwargs()["credential_provider"]
    assert provider.serverless is False
    assert "ResourceType" not in provider.get_credentials()[1]


def test_explicit_credential_provider_wins() -> None:
    """A caller's provider replaces REDIS_AUTH's choice."""
    mine = UsernamePasswordCredentialProvider("u", "p")
    client = redis_from_env({"REDIS_URL": "redis://h:1"}, credential_provider=mine)
    assert client.connection_pool.connection_kwargs["credential_provider"] is mine


def test_explicit_provider_and_url_password_conflict() -> None:
    """Two sources of credentials are refused instead of one silently winning."""
    with pytest.raises(InvalidArgument, match="credential provider"):
        redis_from_env({"REDIS_URL": "redis://u:p@h:1"},
                       credential_provider=UsernamePasswordCredentialProvider("u", "p"))


def test_explicit_arguments_beat_variables() -> None:
    """Keyword arguments override the environment mapping."""
    client = redis_from_env({"REDIS_URL": "redis://h:1", "REDIS_SOCKET_TIMEOUT_S": "3"},
                            socket_timeout_s=0.2, retries=0, max_connections=2)
    assert client.connection_pool.connection_kwargs["socket_timeout"] == 0.2
    assert client.connection_pool.max_connections == 2
    assert client.get_retry() == expected_retry(0)


def test_prebuilt_settings_are_used_as_given() -> None:
    """settings= skips the environment; mixing it with env or arguments is a TypeError."""
    settings = ConnectionSettings(url="redis://h:2/1", retries=3)
    client = redis_from_env(settings=settings)
    assert client.connection_pool.connection_kwargs["db"] == 1
    with pytest.raises(TypeError):
        redis_from_env({"REDIS_URL": "redis://h:1"}, settings=settings)
    with pytest.raises(TypeError):
        redis_from_env(settings=settings, retries=1)


def test_configuration_errors_surface_from_the_factory() -> None:
    """A bad variable raises InvalidArgument from redis_from_env itself."""
    with pytest.raises(InvalidArgument, match="REDIS_CONNECT_TIMEOUT_S"):
        redis_from_env({"REDIS_URL": "redis://h:1", "REDIS_CONNECT_TIMEOUT_S": "slow"})


def test_redis_from_env_is_exported_lazily() -> None:
    """usage_limits.redis_from_env is the connection module's function."""
    assert usage_limits.redis_from_env is redis_from_env
    assert "redis_from_env" in usage_limits.__all__


def test_import_and_build_without_aws_does_not_load_boto3() -> None:
    """Importing the module and building a client with REDIS_AUTH=none loads no boto3/botocore."""
    code = ("import sys\n"
            "from usage_limits import redis_from_env\n"
            "redis_from_env({'REDIS_URL': 'rediss://h:1', 'REDIS_CLUSTER': 'true'})\n"
            "redis_from_env({'REDIS_URL': 'redis://h:1'})\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore')))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "layers" / "usage_limits")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
