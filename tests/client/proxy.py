"""A small HTTP/1.1 proxy that forwards requests to a server and can drop its answers.

It reads each request (headers and a Content-Length body), sends it to the server on a
connection of its own, reads the whole answer, and then either passes the answer on or,
for the first ``drop`` answers, closes the client's connection without a byte: the server
did the work, the client never hears of it, as when a connection breaks on the way back.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field


@dataclass
class Exchange:
    """One request that went through, its answer, and whether the answer was dropped."""

    request_head: bytes
    request_body: bytes
    response: bytes
    dropped: bool

    def header(self, name: str) -> str | None:
        """A request header's value (case-insensitive), or None."""
        for line in self.request_head.decode("latin-1").split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None

    @property
    def response_body(self) -> bytes:
        return self.response.partition(b"\r\n\r\n")[2]


@dataclass
class DroppingProxy:
    """Forward to ``upstream`` (host, port); drop the first ``drop`` answers."""

    upstream: tuple[str, int]
    drop: int = 1
    exchanges: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> DroppingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            reader = conn.makefile("rb")
            while True:
                head, body = _read_message(reader)
                if head is None:
                    return
                with socket.create_connection(self.upstream, timeout=60) as up:
                    up.sendall(head + body)
                    up_reader = up.makefile("rb")
                    rhead, rbody = _read_message(up_reader)
                answer = (rhead or b"") + rbody
                with self._lock:
                    dropped = sum(e.dropped for e in self.exchanges) < self.drop
                    self.exchanges.append(Exchange(head, body, answer, dropped))
                if dropped:
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)
                    return
                conn.sendall(answer)


def _read_message(reader: object) -> tuple[bytes | None, bytes]:
    """One HTTP/1.1 message (head with its blank line, and its Content-Length body)."""
    lines = []
    while True:
        line = reader.readline()  # type: ignore[attr-defined]
        if not line:
            return None, b""
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
    head = b"".join(lines)
    length = 0
    for line in lines[1:]:
        key, _, value = line.decode("latin-1").partition(":")
        if key.strip().lower() == "content-length":
            length = int(value.strip())
    body = reader.read(length) if length else b""  # type: ignore[attr-defined]
    return head, body
