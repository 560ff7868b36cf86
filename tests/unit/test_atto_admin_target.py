"""Where ``atto-admin`` connects: a stack only when one is named; otherwise the ``make serve``
on ``$PORT``, waited for while it is busy; with neither, an error naming the URL and ``PORT``.

Each test runs the CLI as an operator does (``python -m atto_admin``) against loopback HTTP
servers that stand in for ``make serve`` and for AWS (every AWS call of the CLI is sent to a
recorder, with credentials that would work)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from atto_admin.client import LOCAL_TITLE
from local.redis_servers import free_port

ROOT = Path(__file__).resolve().parents[2]


class Stub(BaseHTTPRequestHandler):
    """Records each request; ``/openapi.json`` answers after ``delay_s`` with ``title``."""

    requests: list[str]
    delay_s = 0.0
    title: str | None = LOCAL_TITLE

    def do_GET(self) -> None:
        self.requests.append(f"{self.command} {self.path}")
        if self.path == "/openapi.json":
            time.sleep(self.delay_s)
            body: Any = {"openapi": "3.1.0", "info": {"title": self.title}}
        else:
            body = {"user_id": "alice", "plan": {"name": "default", "source": "default"},
                    "windows": [], "credit": 0, "grants": [], "events": []}
        self._answer(body)

    def do_POST(self) -> None:
        """Any AWS query-protocol call (CloudFormation's): refused, as AWS refuses it."""
        self.requests.append(f"{self.command} {self.path}")
        self._answer("<ErrorResponse><Error><Type>Sender</Type><Code>AccessDenied</Code>"
                     "<Message>recorded</Message></Error><RequestId>r</RequestId>"
                     "</ErrorResponse>", status=403, kind="text/xml")

    def _answer(self, body: Any, status: int = 200, kind: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _start(handler: type[Stub]) -> Iterator[tuple[int, list[str]]]:
    handler.requests = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1], handler.requests
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def aws() -> Iterator[tuple[int, list[str]]]:
    """A recorder that every AWS call of the CLI goes to (``AWS_ENDPOINT_URL``)."""
    yield from _start(type("Aws", (Stub,), {}))


def run_cli(*args: str, port: int, aws_port: int,
            extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m atto_admin ARGS`` with ``PORT`` set, nothing else named (but ``extra``),
    and working AWS credentials whose every call reaches the recorder on ``aws_port``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and k not in ("ATTO_ADMIN_URL", "ATTO_STACK")}
    env.update({"PYTHONPATH": str(ROOT / "tools"), "PORT": str(port),
                "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_MAX_ATTEMPTS": "1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{aws_port}",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                **(extra or {})})
    return subprocess.run([sys.executable, "-m", "atto_admin", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=60)


def test_with_nothing_named_and_no_make_serve_it_fails_naming_url_and_port(
        aws: tuple[int, list[str]]) -> None:
    """No --url, --stack or variable and nothing on $PORT: a change fails (exit 1) with the
    URL and PORT it tried, and no AWS call is made: no stack is acted on unnamed."""
    aws_port, aws_calls = aws
    port = free_port()
    out = run_cli("grant", "add", "alice", "--tokens", "5", "--kind", "promo",
                  "--reference", "r1", "--reason", "r", port=port, aws_port=aws_port)
    assert out.returncode == 1
    assert f"no make serve at http://127.0.0.1:{port} (PORT={port})" in out.stderr
    assert "--stack" in out.stderr and "Traceback" not in out.stderr
    assert aws_calls == []


def test_a_stack_is_used_when_named_by_the_documented_variable(
        aws: tuple[int, list[str]]) -> None:
    """ATTO_STACK names the stack: the CLI reads its outputs from AWS (here refused)."""
    aws_port, aws_calls = aws
    out = run_cli("show", "alice", port=free_port(), aws_port=aws_port,
                  extra={"ATTO_STACK": "atto-cloud-dev"})
    assert out.returncode == 1 and "cannot read stack 'atto-cloud-dev'" in out.stderr
    assert aws_calls == ["POST /"]


def test_a_busy_make_serve_is_waited_for(aws: tuple[int, list[str]]) -> None:
    """A make serve that takes 2 s to answer the probe (four times the old wait) is used:
    the command reaches it, unsigned, and nothing reaches AWS."""
    aws_port, aws_calls = aws
    slow = type("Slow", (Stub,), {"delay_s": 2.0})
    for port, requests in _start(slow):
        out = run_cli("show", "alice", port=port, aws_port=aws_port)
        assert out.returncode == 0, out.stderr
        assert f"using make serve at http://127.0.0.1:{port}" in out.stderr
        assert requests == ["GET /openapi.json", "GET /admin/v1/users/alice"]
    assert aws_calls == []


def test_a_server_on_port_that_is_not_make_serve_is_not_used(
        aws: tuple[int, list[str]]) -> None:
    """Something else answering on $PORT is neither used nor a reason to try a stack."""
    aws_port, aws_calls = aws
    other = type("Other", (Stub,), {"title": "Some other API"})
    for port, requests in _start(other):
        out = run_cli("show", "alice", port=port, aws_port=aws_port)
        assert out.returncode == 1
        assert f"(PORT={port}): what answers there is not make serve" in out.stderr
        assert requests == ["GET /openapi.json"]
    assert aws_calls == []
