"""redis_from_env against real servers: standalone, cluster, password, ACL token and TLS."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.auth
import pytest
import redis.asyncio as aioredis
from botocore.credentials import Credentials
from moto import mock_aws
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import AuthenticationError, ConnectionError

from local.redis_servers import Engine, RedisCluster3, RedisServer, free_port
from usage_limits.connection import (
    CachedTokenProvider,
    ElastiCacheIAMProvider,
    clear_secret_cache,
    redis_from_env,
)

PASSWORD = "s3cret"
REGION = "eu-west-1"


@pytest.fixture(scope="module")
def password_server(engine: Engine) -> Iterator[RedisServer]:
    """A private server of the test's engine whose default user needs PASSWORD."""
    with RedisServer(engine=engine) as server:
        # Set after start: RedisServer's readiness probe sends PING without AUTH.
        server.cli("config", "set", "requirepass", PASSWORD)
        yield server


@pytest.fixture
async def admin(password_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A plain client authenticated as the default user, to manage ACL users."""
    client = aioredis.Redis(port=password_server.port, password=PASSWORD)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A mocked Secrets Manager with dummy credentials; the secret cache starts empty."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    clear_secret_cache()
    with mock_aws():
        yield boto3.client("secretsmanager", region_name=REGION)
    clear_secret_cache()


async def test_standalone_client_pings(redis_server: RedisServer) -> None:
    """A URL alone gives a working client for the standalone server."""
    client = redis_from_env({"REDIS_URL": redis_server.url})
    try:
        assert await client.ping() is True
    finally:
        await client.aclose()


async def test_fan_out_beyond_the_pool_waits_instead_of_failing(redis_server: RedisServer) -> None:
    """With one pooled connection, twenty concurrent commands queue for it and all succeed."""
    client = redis_from_env({"REDIS_URL": redis_server.url}, max_connections=1)
    try:
        assert await asyncio.gather(*(client.ping() for _ in range(20))) == [True] * 20
    finally:
        await client.aclose()


@pytest.mark.cluster
async def test_cluster_client_reaches_every_slot(redis_cluster: RedisCluster3, uid: str) -> None:
    """One node's URL with REDIS_CLUSTER=true discovers the cluster and routes by slot."""
    client = redis_from_env({"REDIS_URL": redis_cluster.url, "REDIS_CLUSTER": "true"})
    assert isinstance(client, RedisCluster)
    keys = [f"ul:{{t:{uid}:{i}}}:probe" for i in range(3)]
    try:
        assert await client.ping() is True
        assert len({key_slot(k.encode()) for k in keys}) == 3
        assert len({client.get_node_from_key(k).name for k in keys}) > 1
        for i, key in enumerate(keys):
            await client.set(key, str(i), px=10_000)
        assert [await client.get(k) for k in keys] == [b"0", b"1", b"2"]
    finally:
        await client.delete(*keys)
        await client.aclose()


async def test_server_refuses_clients_without_the_password(password_server: RedisServer) -> None:
    """The password server really requires auth, so the next tests prove something."""
    client = redis_from_env({"REDIS_URL": password_server.url})
    try:
        with pytest.raises(AuthenticationError):
            await client.ping()
    finally:
        await client.aclose()


async def test_secret_auth_with_a_plain_password(password_server: RedisServer, aws: Any) -> None:
    """REDIS_AUTH=secret reads the password from Secrets Manager and authenticates."""
    arn = aws.create_secret(Name="redis-plain", SecretString=PASSWORD)["ARN"]
    client = redis_from_env({"REDIS_URL": password_server.url, "REDIS_AUTH": "secret",
                             "REDIS_SECRET_ARN": arn, "AWS_REGION": REGION})
    try:
        assert await client.ping() is True
        assert await client.acl_whoami() == "default"
    finally:
        await client.aclose()


async def test_secret_auth_with_an_rbac_user(password_server: RedisServer, admin: aioredis.Redis,
                                             aws: Any, uid: str) -> None:
    """A JSON secret's username and password log in as that ACL user."""
    user = f"app-{uid}"
    await admin.acl_setuser(user, enabled=True, passwords=["+rbac-pw"], keys=["*"],
                            commands=["+@all"])
    aws.create_secret(Name="redis-rbac", SecretString=json.dumps(
        {"username": user, "password": "rbac-pw"}))
    client = redis_from_env({"REDIS_URL": password_server.url, "REDIS_AUTH": "secret",
                             "REDIS_SECRET_ARN": "redis-rbac", "AWS_REGION": REGION})
    try:
        assert await client.acl_whoami() == user
    finally:
        await client.aclose()
        await admin.acl_deluser(user)


class Clock:
    """Wall-clock seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


async def test_credential_provider_authenticates_and_renews(
        password_server: RedisServer, admin: aioredis.Redis, uid: str) -> None:
    """A token provider is wired into connections, and new connections get the renewed token."""
    user, clock, made = f"tok-{uid}", Clock(), []

    def make_token() -> str:
        made.append(1)
        return f"token-{len(made)}"

    await admin.acl_setuser(user, enabled=True, passwords=["+token-1"], keys=["*"],
                            commands=["+@all"])
    provider = CachedTokenProvider(user, make_token, refresh_after_s=600, clock=clock)
    client = redis_from_env({"REDIS_URL": password_server.url}, credential_provider=provider)
    try:
        assert await client.acl_whoami() == user
        # Only token-2 is valid from now on; open connections stay authenticated.
        await admin.acl_setuser(user, enabled=True, reset_passwords=True,
                                passwords=["+token-2"])
        assert await client.acl_whoami() == user
        clock.now += 600
        await client.connection_pool.disconnect()
        assert await client.acl_whoami() == user
        assert len(made) == 2
    finally:
        await client.aclose()
        await admin.acl_deluser(user)


# --- TLS and the full IAM path ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(engine: Engine, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[tuple[RedisServer, int, Path]]:
    """A server with a TLS port and a self-signed certificate for 127.0.0.1.

    Its tests are marked ``tls``: they run on the engines built with TLS only.
    """
    if not shutil.which("openssl"):
        pytest.skip("openssl not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    tls_port = free_port()
    with RedisServer(engine=engine, extra=[
            "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]) as server:
        yield server, tls_port, cert


@pytest.mark.tls
async def test_rediss_verifies_the_server_certificate(
        tls_server: tuple[RedisServer, int, Path]) -> None:
    """rediss:// talks TLS with a trusted CA file and refuses an unknown certificate."""
    _, port, cert = tls_server
    url = f"rediss://127.0.0.1:{port}"
    trusted = redis_from_env({"REDIS_URL": url, "REDIS_TLS_CA_FILE": str(cert)})
    untrusted = redis_from_env({"REDIS_URL": url, "REDIS_RETRIES": "0"})
    try:
        assert await trusted.ping() is True
        with pytest.raises(ConnectionError):
            await untrusted.ping()
    finally:
        await trusted.aclose()
        await untrusted.aclose()


@pytest.mark.tls
async def test_iam_auth_from_the_environment_logs_in(
        tls_server: tuple[RedisServer, int, Path], monkeypatch: pytest.MonkeyPatch,
        uid: str) -> None:
    """REDIS_AUTH=iam signs a token with the role's credentials and AUTHs with it over TLS."""
    server, port, cert = tls_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SECRET")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    frozen = dt.datetime(2024, 5, 6, 7, 8, 9)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda remove_tzinfo=True: frozen)
    user = f"iam-{uid}"
    # The same signing time and credentials give the same token ElastiCache would check.
    _, token = ElastiCacheIAMProvider(user, "atto", REGION,
                                      credentials=Credentials("AKID", "SECRET")).get_credentials()
    admin = aioredis.Redis(port=server.port)
    await admin.acl_setuser(user, enabled=True, passwords=[f"+{token}"], keys=["*"],
                            commands=["+@all"])
    client = redis_from_env({"REDIS_URL": f"rediss://127.0.0.1:{port}", "REDIS_AUTH": "iam",
                             "REDIS_USER": user, "ELASTICACHE_CACHE_NAME": "atto",
                             "AWS_REGION": REGION, "REDIS_TLS_CA_FILE": str(cert)})
    try:
        assert await client.acl_whoami() == user
    finally:
        await client.aclose()
        await admin.acl_deluser(user)
        await admin.aclose()
