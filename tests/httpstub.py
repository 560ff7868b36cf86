"""A scripted HTTP server on a private loopback port, for provider-client tests.

Each request gets the next ``Reply`` of the script (the last one repeats). A reply may send
its body slowly (``trickle_s`` between chunks), which is how a provider outlives per-phase
timeouts: every chunk resets the read timeout. The server records each request it saw and
whether the client hung up before the whole body was sent.

Example:
    >>> with HttpStub([Reply(429, headers={"Retry-After": "inf"}), Reply(200, body=b"{}")]) as s:
    ...     s.url  # http://127.0.0.1:<port>
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    """One scripted answer.

    Attributes:
        status: HTTP status code.
        body: the body, sent in ``chunks`` pieces.
        headers: extra response headers.
        chunks: pieces the body is cut into.
        trickle_s: seconds before each piece.
    """

    status: int = 200
    body: bytes = b"{}"
    headers: dict[str, str] = field(default_factory=dict)
    chunks: int = 1
    trickle_s: float = 0.0


def chat_reply(content: str) -> Reply:
    """An OpenAI-style chat completion whose message content is ``content``."""
    body = {"model": "stub", "usage": {"prompt_tokens": 3, "completion_tokens": 5},
            "choices": [{"message": {"role": "assistant", "content": content}}]}
    return Reply(200, json.dumps(body).encode())


@dataclass
class Seen:
    """One request the server received."""

    method: str
    path: str
    body: bytes
    at: float
    completed: bool = False
    hung_up: bool = False


class HttpStub:
    """The server; use as a context manager. ``url`` is its base URL."""

    def __init__(self, script: list[Reply]) -> None:
        self.script = list(script)
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self._answer()

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                seen = Seen(self.command, self.path, body, time.time())
                with stub._lock:
                    index = min(len(stub.seen), len(stub.script) - 1)
                    stub.seen.append(seen)
                reply = stub.script[index]
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply.body)))
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                step = max(1, -(-len(reply.body) // max(1, reply.chunks)))
                try:
                    for start in range(0, len(reply.body), step):
                        if reply.trickle_s:
                            time.sleep(reply.trickle_s)
                        self.wfile.write(reply.body[start:start + step])
                        self.wfile.flush()
                    seen.completed = True
                except OSError:
                    seen.hung_up = True

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """Base URL of the server."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HttpStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
