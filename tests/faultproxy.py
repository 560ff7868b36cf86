"""A fault-injecting TCP proxy between a Redis client and a standalone redis-server.

The proxy understands RESP, so it can hurt one command at a time while every other command
on the same connection passes untouched::

    proxy = FaultProxy(redis_server.port)
    client = redis_from_env(url=proxy.url, retries=1, socket_timeout_s=0.3)
    fault = proxy.inject(Fault.DROP_REPLY)          # the next script call
    await budget.reserve(...)                       # Redis charges; the reply is lost;
    assert fault.hits == 1                          # redis-py times out and re-sends

Faults (each applies to the next ``times`` commands that ``match``; the default match is
any script call, EVALSHA or EVAL):

``DROP_COMMAND``  the command never reaches Redis and nothing answers (the client times out).
``DROP_REPLY``    Redis runs the command; its reply is swallowed (the client times out).
``DUPLICATE``     the command reaches Redis twice; the client gets the second reply only,
                  as after a re-send whose first attempt ran but whose reply was lost.
``DELAY``         the reply is held ``delay_s`` seconds, then sent (a client with a shorter
                  socket timeout has given up and re-sent by then).
``CUT_COMMAND``   the connection is closed before the command reaches Redis.
``CUT_REPLY``     Redis runs the command; half its reply is sent, then the connection closes.

Every command that reached Redis is counted by name in ``proxy.seen``. A connection that
subscribes (pub/sub) is passed through from then on, since its replies no longer pair with
commands. Only standalone servers: a cluster's MOVED replies name the real nodes.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

Matcher = Callable[[list[bytes]], bool]

SCRIPT_COMMANDS = frozenset({b"EVALSHA", b"EVAL", b"EVALSHA_RO", b"EVAL_RO", b"FCALL"})
_SUBSCRIBE = frozenset({b"SUBSCRIBE", b"PSUBSCRIBE", b"SSUBSCRIBE"})


class Fault(enum.Enum):
    """What happens to a matching command; see the module docstring."""

    DROP_COMMAND = "drop_command"
    DROP_REPLY = "drop_reply"
    DUPLICATE = "duplicate"
    DELAY = "delay"
    CUT_COMMAND = "cut_command"
    CUT_REPLY = "cut_reply"


def scripts(args: list[bytes]) -> bool:
    """Matches any script call (EVALSHA, EVAL and their read-only forms)."""
    return args[0].upper() in SCRIPT_COMMANDS


def command(*names: str) -> Matcher:
    """Matches commands by name, e.g. ``command("ZADD", "HSET")``."""
    wanted = {n.upper().encode() for n in names}
    return lambda args: args[0].upper() in wanted


def script_sha(sha: str) -> Matcher:
    """Matches EVALSHA calls of one script (by its SHA1; see ``usage_limits._scripts``)."""
    sha_b = sha.encode()
    return lambda args: args[0].upper() in {b"EVALSHA", b"EVALSHA_RO"} and args[1] == sha_b


@dataclass
class Injection:
    """One armed fault. ``hits`` counts the commands it has hurt so far."""

    fault: Fault
    match: Matcher
    times: int
    delay_s: float = 0.0
    hits: int = 0
    applied: list[list[bytes]] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def wait(self, timeout: float = 5.0) -> bool:
        """Block until the fault has been applied ``times`` times (or ``timeout``)."""
        return self._done.wait(timeout)


# ---------------------------------------------------------------------------- RESP framing

def frame_end(buf: bytes | bytearray, pos: int = 0) -> int | None:
    """The index just past the RESP2/RESP3 frame starting at ``pos``; None if incomplete."""
    nl = buf.find(b"\r\n", pos)
    if nl < 0:
        return None
    kind, after = buf[pos:pos + 1], nl + 2
    if kind in (b"+", b"-", b":", b"_", b",", b"#", b"("):
        return after
    n = int(buf[pos + 1:nl])
    if kind in (b"$", b"!", b"="):
        end = after + n + 2 if n >= 0 else after
        return end if len(buf) >= end else None
    if kind in (b"*", b"~", b">", b"%", b"|"):
        count = max(n, 0) * (2 if kind in (b"%", b"|") else 1) + (1 if kind == b"|" else 0)
        for _ in range(count):
            end = frame_end(buf, after)
            if end is None:
                return None
            after = end
        return after
    raise ValueError(f"not RESP: {bytes(buf[pos:pos + 20])!r}")


def command_args(frame: bytes) -> list[bytes]:
    """The arguments of one RESP array-of-bulk-strings command frame."""
    if not frame.startswith(b"*"):
        return frame.split()  # an inline command
    args, pos = [], frame.index(b"\r\n") + 2
    while pos < len(frame):
        nl = frame.index(b"\r\n", pos)
        n = int(frame[pos + 1:nl])
        args.append(frame[nl + 2:nl + 2 + n])
        pos = nl + 2 + n + 2
    return args


# ---------------------------------------------------------------------------- the proxy

class _Link:
    """One client connection and its upstream connection, with the replies' fates in order."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy, self.client = proxy, client
        self.upstream = socket.create_connection(("127.0.0.1", proxy.upstream_port))
        self.fates: deque[tuple[Fault | None, float]] = deque()  # one per command sent up
        self.passthrough = False
        self.lock = threading.Lock()
        self.closed = False

    def start(self) -> None:
        threading.Thread(target=self._commands, daemon=True).start()
        threading.Thread(target=self._replies, daemon=True).start()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _commands(self) -> None:
        buf = bytearray()
        try:
            while data := self.client.recv(65536):
                if self.passthrough:
                    self.upstream.sendall(data)
                    continue
                buf += data
                while buf and (end := frame_end(buf)) is not None:
                    frame = bytes(buf[:end])
                    del buf[:end]
                    if not self._forward(frame):
                        return
                if self.passthrough and buf:
                    self.upstream.sendall(bytes(buf))
                    buf.clear()
        except (OSError, ValueError):
            pass
        finally:
            self.close()

    def _forward(self, frame: bytes) -> bool:
        """Send one command on (or not); False when the connection was cut."""
        args = command_args(frame)
        injection = self.proxy._take(args)
        fault = injection.fault if injection else None
        if fault is Fault.CUT_COMMAND:
            self.close()
            return False
        if fault is Fault.DROP_COMMAND:
            return True
        name = args[0].upper() if args else b""
        with self.proxy._lock:
            self.proxy.seen[name.decode(errors="replace")] += 2 if fault is Fault.DUPLICATE else 1
        if fault is Fault.DUPLICATE:
            self.fates.append((Fault.DROP_REPLY, 0.0))
            self.fates.append((None, 0.0))
            self.upstream.sendall(frame + frame)
        else:
            self.fates.append((fault, injection.delay_s if injection else 0.0))
            self.upstream.sendall(frame)
        if name in _SUBSCRIBE:
            self.passthrough = True
        return True

    def _replies(self) -> None:
        buf = bytearray()
        try:
            while data := self.upstream.recv(65536):
                buf += data
                while buf:
                    if self.passthrough and not self.fates:
                        self.client.sendall(bytes(buf))  # pub/sub pushes: no command to pair
                        buf.clear()
                        break
                    end = frame_end(buf)
                    if end is None:
                        break
                    reply = bytes(buf[:end])
                    del buf[:end]
                    fate, delay = self.fates.popleft() if self.fates else (None, 0.0)
                    if fate is Fault.DROP_REPLY:
                        continue
                    if fate is Fault.DELAY:
                        time.sleep(delay)
                    if fate is Fault.CUT_REPLY:
                        self.client.sendall(reply[:max(1, len(reply) // 2)])
                        self.close()
                        return
                    self.client.sendall(reply)
        except (OSError, ValueError):
            pass
        finally:
            self.close()


class FaultProxy:
    """A TCP proxy on a free loopback port in front of ``127.0.0.1:upstream_port``.

    Args:
        upstream_port: the redis-server's port.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.seen: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._armed: list[Injection] = []
        self._links: list[_Link] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>`` of the proxy."""
        return f"redis://127.0.0.1:{self.port}"

    def inject(self, fault: Fault, *, match: Matcher = scripts, times: int = 1,
               delay_s: float = 0.0) -> Injection:
        """Arm ``fault`` for the next ``times`` commands that ``match``.

        Args:
            fault: what to do to them.
            match: which commands (``scripts``, ``command(...)``, ``script_sha(...)`` or
                any predicate over the command's arguments, name first).
            times: how many matching commands to hurt.
            delay_s: how long ``Fault.DELAY`` holds the reply.

        Returns:
            The injection, whose ``hits`` and ``wait()`` tell when it was applied.
        """
        if times < 1:
            raise ValueError("times must be >= 1")
        injection = Injection(fault, match, times, delay_s)
        with self._lock:
            self._armed.append(injection)
        return injection

    def clear(self) -> None:
        """Disarm every fault that has not been applied yet."""
        with self._lock:
            self._armed.clear()

    def cut_all(self) -> None:
        """Close every open connection now (clients see a reset)."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    def close(self) -> None:
        """Stop accepting and close every connection."""
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut_all()

    def _take(self, args: list[bytes]) -> Injection | None:
        with self._lock:
            for injection in self._armed:
                if injection.match(args):
                    injection.hits += 1
                    injection.applied.append(args)
                    if injection.hits >= injection.times:
                        self._armed.remove(injection)
                        injection._done.set()
                    return injection
        return None

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                link = _Link(self, client)
            except OSError:
                client.close()
                continue
            link.upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._links = [x for x in self._links if not x.closed] + [link]
            link.start()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def fault_proxy(redis_server: object) -> Iterator[FaultProxy]:
    """A ``FaultProxy`` in front of the session's standalone redis-server."""
    with FaultProxy(redis_server.port) as proxy:  # type: ignore[attr-defined]
        yield proxy
