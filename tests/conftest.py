"""Session-wide real servers: one redis-server and one 3-master Redis Cluster.

Both run on private loopback ports and are started by the test session itself (no docker).
Tests get a fresh async client per test (``redis_client`` runs each test on both
topologies) and unique ids (``uid``) so tests never share keys. ``fault_proxy`` (from
``tests/faultproxy.py``) puts a fault-injecting proxy in front of the standalone server.

Property tests use the Hypothesis profile named by ``ATTO_PROPERTY_PROFILE``: ``ci`` (the
default: a fixed seed, so ``make test`` explores the same few thousand steps every run) or
``long`` (random seeds and many more examples; ``make fleet`` runs it).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any, Protocol

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from local.redis_servers import RedisCluster3, RedisServer
from tests.faultproxy import fault_proxy  # noqa: F401  (a fixture)

PROPERTY_PROFILE_ENV = "ATTO_PROPERTY_PROFILE"
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", deadline=None, derandomize=True, database=None,
                          max_examples=100, suppress_health_check=_SLOW_OK, print_blob=True)
settings.register_profile("long", deadline=None, max_examples=2000,
                          suppress_health_check=_SLOW_OK, print_blob=True)
settings.load_profile(os.environ.get(PROPERTY_PROFILE_ENV, "ci"))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private standalone redis-server for the whole session."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster3]:
    """A private 3-master Redis Cluster for the whole session."""
    with RedisCluster3() as cluster:
        yield cluster


def client_for(server: RedisServer | RedisCluster3) -> aioredis.Redis | RedisCluster:
    """An async client with explicit timeouts and no retries (tests see every failure)."""
    common = dict(socket_timeout=2.0, socket_connect_timeout=2.0,
                  retry=Retry(NoBackoff(), 0), decode_responses=False)
    if isinstance(server, RedisCluster3):
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in server.startup_nodes],
                            **common)
    return aioredis.Redis(host="127.0.0.1", port=server.port, **common)


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
async def redis_client(
        request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis | RedisCluster]:
    """An async client, once against the standalone server and once against the cluster."""
    server = request.getfixturevalue("redis_server" if request.param == "standalone"
                                     else "redis_cluster")
    client = client_for(server)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def standalone_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """An async client to the standalone server only."""
    client = client_for(redis_server)
    try:
        yield client  # type: ignore[misc]
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def emulator() -> Iterator[Any]:
    """One offline provider emulator process per test module (tests reset it as needed)."""
    from local.emulator import EmulatorProcess

    with EmulatorProcess() as emu:
        yield emu


@pytest.fixture
def uid() -> str:
    """A unique id for keys of this test (user, provider, request)."""
    return uuid.uuid4().hex[:12]


@pytest.fixture(autouse=True)
def _forget_pending_refunds() -> Iterator[None]:
    """Refunds a test leaves pending (its Redis gone) must not be retried by the next test."""
    yield
    from usage_limits.web import refunds

    refunds.clear()


class StartEnvironment(Protocol):
    """``lambda_env(values, unset=...)``: see the fixture."""

    def __call__(self, values: Mapping[str, str], *, unset: Iterable[str] = ()) -> None: ...


@pytest.fixture
def lambda_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[StartEnvironment]:
    """Set a function's environment variables and start it as a fresh Lambda environment.

    The test then calls handlers on one event loop, as Mangum does in Lambda; settings,
    clients and singletons are made again from the variables given here.
    """
    from local.lambda_events import fresh_environment, lambda_loop

    stack = contextlib.ExitStack()

    def start(values: Mapping[str, str], *, unset: Iterable[str] = ()) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        for name in unset:
            monkeypatch.delenv(name, raising=False)
        fresh_environment()
        stack.enter_context(lambda_loop())

    yield start
    stack.close()
    fresh_environment()
