"""Run the emulator for tests and tools: in a child process or in a background thread.

``EmulatorProcess`` (preferred: its own interpreter, exact counters, no shared GIL) binds
a free loopback port itself, hands the listening socket to ``python -m local.emulator``
and returns once the server answers. ``EmulatorThread`` serves the same app in this
process. Both offer the same control methods (``stats``, ``configure``, ``fail_next``,
``spike_next``, ``reset``) over the HTTP control endpoints.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from .config import EmulatorConfig

HOST = "127.0.0.1"
_ROOT = Path(__file__).resolve().parents[2]


def _listening_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    return sock


class _Control:
    """URLs and control calls shared by both runners."""

    host = HOST
    port = 0

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        """Base URL for OpenAI clients (``.../v1``)."""
        return f"{self.url}/v1"

    @property
    def adzuna_base_url(self) -> str:
        """Base URL replacing ``https://api.adzuna.com`` (``.../adzuna``)."""
        return f"{self.url}/adzuna"

    @property
    def tavily_base_url(self) -> str:
        """Base URL replacing ``https://api.tavily.com`` (``.../tavily``)."""
        return f"{self.url}/tavily"

    @property
    def brave_base_url(self) -> str:
        """Base URL replacing ``https://api.search.brave.com`` (``.../brave``)."""
        return f"{self.url}/brave"

    @property
    def pages_url(self) -> str:
        """Where the emulated web pages live (``.../pages``)."""
        return f"{self.url}/pages"

    def job_page_url(self, slug: str = "senior-python-developer-london") -> str:
        """A job-posting page."""
        return f"{self.pages_url}/job/{slug}"

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = httpx.request(method, f"{self.url}/_emulator/{path}", timeout=10.0,
                                 trust_env=False, **kwargs)
        if response.status_code >= 400:
            raise ValueError(response.json().get("error", {}).get("message", response.text))
        result: dict[str, Any] = response.json()
        return result

    def health(self) -> dict[str, Any]:
        """``GET /_emulator/health``."""
        return self._call("GET", "health")

    def stats(self, *, window_s: float = 1.0, times: bool = True) -> dict[str, Any]:
        """``GET /_emulator/stats``: ``{"now", "started_at", "seed", "window_s",
        "families": {name: {...}}}``."""
        return self._call("GET", "stats", params={"window_s": window_s, "times": int(times)})

    def family_stats(self, family: str, *, window_s: float = 1.0) -> dict[str, Any]:
        """The stats of one family (``llm``, ``salary``, ``search``, ``pages``)."""
        stats: dict[str, Any] = self.stats(window_s=window_s)["families"][family]
        return stats

    def configure(self, family: str | list[str] | None = None, **knobs: Any) -> dict[str, Any]:
        """``POST /_emulator/config``: knobs for ``family`` (all if ``None``); also accepts
        ``families=``, ``seed=``, ``fail_next=`` and ``spike_next=``.

        Raises:
            ValueError: the emulator rejected the change (unknown knob, bad value).
        """
        body = dict(knobs)
        if family is not None:
            body["family"] = family
        return self._call("POST", "config", json=body)

    def fail_next(self, count: int = 1, status: int = 500, *, family: str | None = None,
                  retry_after_s: float | None = None,
                  kind: str | None = None) -> dict[str, Any]:
        """The next ``count`` requests of ``family`` (each family if ``None``) fail with
        ``status`` (429 gets ``Retry-After: retry_after_s``, 1 s by default), or with the
        named failure ``kind`` (``dialects.FAILURE_KINDS``: ``quota``, ``refusal``, ...)."""
        spec: dict[str, Any] = {"count": count, "status": status}
        if kind is not None:
            spec = {"count": count, "kind": kind}
        if retry_after_s is not None:
            spec["retry_after_s"] = retry_after_s
        return self.configure(family, fail_next=spec)

    def spike_next(self, count: int = 1, latency_ms: float = 1000.0, *,
                   family: str | None = None) -> dict[str, Any]:
        """The next ``count`` responses of ``family`` take ``latency_ms`` longer."""
        return self.configure(family, spike_next={"count": count, "latency_ms": latency_ms})

    def reset(self, *, keep_config: bool = False) -> dict[str, Any]:
        """``POST /_emulator/reset``: counters, windows and queues cleared; start-up knobs
        restored unless ``keep_config``."""
        return self._call("POST", "reset", json={"keep_config": keep_config})

    def _wait_ready(self, timeout_s: float, alive: Any) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError(f"emulator exited during start-up{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/_emulator/health", timeout=2.0,
                             trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.05)
        raise RuntimeError(f"emulator not ready after {timeout_s} s ({last}){self._log_tail()}")

    def _log_tail(self) -> str:
        return ""


class EmulatorProcess(_Control):
    """``python -m local.emulator`` as a child process on a private loopback port.

    Usage::

        with EmulatorProcess(rate="5/s", families={"pages": {"latency_ms": 0}}) as emu:
            httpx.post(f"{emu.openai_base_url}/chat/completions", ...)
            emu.family_stats("llm")["arrivals"]

    Args:
        port: the port to bind (0: a free one, chosen and held by this process).
        seed: seeds failure draws and jitter.
        families: per-family knobs, e.g. ``{"llm": {"rate": "5/s"}}``.
        startup_timeout_s: how long ``start`` waits for the server.
        log_level: uvicorn's log level in the child.
        **knobs: knobs for every family (``latency_ms``, ``jitter_ms``, ``failure_rate``,
            ``failure_status``, ``rate``, ``token_rate``, ``count_rejected``,
            ``require_auth``).

    Raises:
        ConfigError: an unknown knob or invalid value (before anything starts).
    """

    def __init__(self, *, port: int = 0, seed: int = 0,
                 families: Mapping[str, Mapping[str, Any]] | None = None,
                 startup_timeout_s: float = 20.0, log_level: str = "warning",
                 **knobs: Any) -> None:
        self.config = EmulatorConfig.build(seed=seed, families=families, **knobs)
        self.requested_port = port
        self.startup_timeout_s = startup_timeout_s
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self) -> EmulatorProcess:
        """Start the child and wait until it answers.

        Raises:
            RuntimeError: the child exited or did not answer in time (its log attached).
        """
        import json

        sock = _listening_socket(self.host, self.requested_port)
        self.port = sock.getsockname()[1]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT),
                                                          env.get("PYTHONPATH", "")]))
        args = [sys.executable, "-m", "local.emulator", "--fd", str(sock.fileno()),
                "--config-json", json.dumps(self.config.as_dict()),
                "--log-level", self.log_level, "--exit-with-parent"]
        try:
            self.proc = subprocess.Popen(args, cwd=_ROOT, env=env, pass_fds=(sock.fileno(),),
                                         stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            sock.close()  # the child holds its own copy
        try:
            self._wait_ready(self.startup_timeout_s, self.alive)
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        """Whether the child is running."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Stop the child (SIGTERM, then SIGKILL after ``timeout_s``); its exit code."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            code = self.proc.returncode
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def log(self) -> str:
        """What the child printed so far."""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        text: str = self._log.read().decode(errors="replace")
        return text

    def _log_tail(self) -> str:
        text = self.log().strip()
        return f"\n--- emulator log ---\n{text[-4000:]}" if text else ""

    def __enter__(self) -> EmulatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmulatorThread(_Control):
    """The emulator served by uvicorn in a background thread of this process.

    Same arguments and methods as ``EmulatorProcess``; handy for debugging in one
    process. Counters are exact here too (one event loop), but the server shares the
    GIL with the caller.
    """

    def __init__(self, *, port: int = 0, seed: int = 0,
                 families: Mapping[str, Mapping[str, Any]] | None = None,
                 startup_timeout_s: float = 20.0, log_level: str = "warning",
                 **knobs: Any) -> None:
        self.config = EmulatorConfig.build(seed=seed, families=families, **knobs)
        self.requested_port = port
        self.startup_timeout_s = startup_timeout_s
        self.log_level = log_level
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> EmulatorThread:
        """Start serving and wait until the server answers.

        Raises:
            RuntimeError: the server did not answer in time.
        """
        import uvicorn

        from .app import create_app

        sock = _listening_socket(self.host, self.requested_port)
        self.port = sock.getsockname()[1]
        self.app = create_app(self.config)
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, log_level=self.log_level, access_log=False, lifespan="off",
            timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"emulator-{self.port}", daemon=True)
        self._thread.start()
        try:
            self._wait_ready(self.startup_timeout_s, self.alive)
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        """Whether the server thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the server to exit and wait for its thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._server = None
        self._thread = None

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
