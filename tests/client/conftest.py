"""The local stack for the client's tests: ``python -m local.serve`` as ``make serve`` runs it.

One server per test module, on a private port, with the session's redis-server and the
module's emulator standing in for every provider; each test uses its own user.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from local.emulator import EmulatorProcess
from local.redis_servers import RedisServer, free_port
from local.stack import EMULATOR_KEYS, EMULATOR_ROUTES

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    """A running ``local.serve`` process."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path


def start_serve(env: dict[str, str], timeout_s: float = 60.0) -> Served:
    """Start ``python -m local.serve`` with ``env`` and wait until it answers."""
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"client-serve-{port}.log"
    full_env = {**os.environ, "PORT": str(port), **env}
    full_env.pop("ATTO_ENV", None)  # local.serve switches local mode on by itself
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "local.serve"], cwd=ROOT, env=full_env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited: {log.read_text()}")
        try:
            if httpx.get(url + "/v1/usage", headers={"X-Atto-User": "probe"},
                         timeout=1).status_code in (200, 503):
                return Served(proc, url, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_serve(Served(proc, url, log))
    raise RuntimeError(f"serve did not start: {log.read_text()}")


def stop_serve(served: Served) -> None:
    """Stop the server's process group (SIGINT, then SIGKILL)."""
    try:
        os.killpg(served.proc.pid, signal.SIGINT)
        served.proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(served.proc.pid, signal.SIGKILL)
        served.proc.wait(5)
    except ProcessLookupError:
        pass


def stack_env(redis_url: str, emulator: EmulatorProcess) -> dict[str, str]:
    """What ``make serve`` would set for a private Redis and the emulator, fast providers."""
    env = {name: emulator.url + suffix for name, suffix in EMULATOR_ROUTES.items()}
    env.update(EMULATOR_KEYS)
    env.update({"REDIS_URL": redis_url, "ATTO_BUDGET": "100/1h,1000/30d",
                "LLM_RATE": "1000/s", "LLM_BURST": "50", "SALARY_RATE": "1000/s",
                "SALARY_BURST": "50", "SEARCH_RATE": "1000/s", "SEARCH_BURST": "50",
                "PAGES_RATE": "1000/s"})
    return env


@pytest.fixture(scope="module")
def served(redis_server: RedisServer, emulator: EmulatorProcess) -> Iterator[Served]:
    """``make serve`` on a private port: real Redis, the emulator, a 100/1h,1000/30d plan."""
    served = start_serve(stack_env(redis_server.url, emulator))
    try:
        yield served
    finally:
        stop_serve(served)


@pytest.fixture
def user() -> str:
    """A user of this test alone."""
    return "client-" + uuid.uuid4().hex[:12]
