"""``make serve`` and ``make invoke`` run as a newcomer runs them, on private free ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from local.redis_servers import free_port

ROOT = Path(__file__).resolve().parents[1]

#: What the shell may carry that would stop serve/invoke from starting their own stack.
_STACK_VARIABLES = ("REDIS_URL", "LLM_BASE_URL", "ATTO_ENV", "PORT", "EMULATOR_PORT",
                    "ATTO_ENTITLEMENTS_TABLE", "ATTO_DYNAMODB_ENDPOINT", "ATTO_USAGE_TABLE",
                    "ATTO_IDEMPOTENCY_TABLE",
                    "ATTO_LOCAL_DATA")


def fresh_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A newcomer's shell: no stack settings, the emulator on a free port (not 8100)."""
    env = {k: v for k, v in os.environ.items() if k not in _STACK_VARIABLES}
    env["EMULATOR_PORT"] = "0"
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class Served:
    """A running ``make serve``: its URL, the emulator it started, its output."""

    url: str
    emulator_url: str
    log: Path


@contextmanager
def serve(extra: Mapping[str, str] | None = None, timeout_s: float = 90.0) -> Iterator[Served]:
    """Run ``python -m local.serve`` with nothing configured; stop it with Ctrl-C (SIGINT).

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout_s``.
    """
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"serve-{port}-", suffix=".log")[1])
    proc = subprocess.Popen([sys.executable, "-m", "local.serve"], cwd=ROOT,
                            env=fresh_env({"PORT": str(port), **(extra or {})}),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited: {log.read_text()}")
            try:
                if httpx.get(url + "/v1/usage", headers={"X-Atto-User": "probe"},
                             timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start: {log.read_text()}")
            time.sleep(0.2)
        match = re.search(r"EMULATOR_URL=(\S+)", log.read_text())
        assert match, log.read_text()
        yield Served(url, match[1], log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        log.unlink(missing_ok=True)


def invoke(function: str, event: str | Path,
           extra: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m local.invoke FUNCTION EVENT`` (``make invoke``) with nothing configured."""
    return subprocess.run([sys.executable, "-m", "local.invoke", function, str(event)],
                          cwd=ROOT, env=fresh_env(extra), capture_output=True, text=True,
                          timeout=180)
