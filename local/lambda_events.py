"""API Gateway HTTP API (payload v2) events and a Lambda context, for calling handlers."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode


@dataclass
class FakeContext:
    """The parts of a Lambda context that the handlers read."""

    timeout_s: float = 29.0
    function_name: str = "test-function"
    aws_request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    memory_limit_in_mb: int = 512
    invoked_function_arn: str = "arn:aws:lambda:us-east-1:123456789012:function:test-function"
    _start: float = field(default_factory=time.monotonic)

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self.timeout_s - (time.monotonic() - self._start)) * 1000))


def http_event(method: str, path: str, *, body: Any = None, query: dict[str, str] | None = None,
               headers: dict[str, str] | None = None, user: str | None = "user-123",
               request_id: str | None = None, raw_body: str | None = None,
               base64_body: bool = False) -> dict[str, Any]:
    """A payload-v2 event as API Gateway sends it, with JWT claims for ``user``."""
    hdrs = {"content-type": "application/json", "host": "api.example.com",
            "user-agent": "atto-local/1.0"}
    hdrs.update({k.lower(): v for k, v in (headers or {}).items()})
    text = raw_body if raw_body is not None else (None if body is None else json.dumps(body))
    if text is not None and base64_body:
        text = base64.b64encode(text.encode()).decode()
    request_context: dict[str, Any] = {
        "accountId": "123456789012", "apiId": "api1234567", "domainName": "api.example.com",
        "domainPrefix": "api",
        "http": {"method": method, "path": path, "protocol": "HTTP/1.1",
                 "sourceIp": "203.0.113.10", "userAgent": "atto-local/1.0"},
        "requestId": request_id or uuid.uuid4().hex[:16],
        "routeKey": f"{method} {path}", "stage": "$default",
        "time": time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime()),
        "timeEpoch": int(time.time() * 1000),
    }
    if user is not None:
        request_context["authorizer"] = {"jwt": {"claims": {"sub": user, "iss": "https://issuer"},
                                                 "scopes": None}}
    event: dict[str, Any] = {
        "version": "2.0", "routeKey": f"{method} {path}", "rawPath": path,
        "rawQueryString": urlencode(query or {}), "headers": hdrs,
        "requestContext": request_context, "isBase64Encoded": base64_body,
    }
    if query:
        event["queryStringParameters"] = query
    if text is not None:
        event["body"] = text
    return event


@dataclass
class Result:
    status: int
    headers: dict[str, str]
    body: Any


def invoke(handler: Callable[..., dict[str, Any]], event: dict[str, Any],
           context: FakeContext | None = None) -> Result:
    """Call a Mangum handler like Lambda does and decode its answer."""
    out = handler(event, context or FakeContext())
    raw = out.get("body") or ""
    if out.get("isBase64Encoded"):
        raw = base64.b64decode(raw).decode()
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw
    headers = {k.lower(): v for k, v in (out.get("headers") or {}).items()}
    return Result(out["statusCode"], headers, body)


@contextmanager
def lambda_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A current event loop for sync handler calls, as a Lambda environment has one."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield loop
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        asyncio.set_event_loop(None)


def fresh_environment() -> None:
    """Forget every per-execution-environment singleton, as a new Lambda environment starts.

    Settings are read again, and every reset a SnapStart restore runs (``usage_limits.
    snapstart``) runs: the Redis client, the idempotency store, pending refunds, cached
    secrets and the provider clients are made again, from the current environment
    variables, on next use.
    """
    import atto_providers  # noqa: F401  (registers the provider clients' resets)
    from usage_limits import snapstart, thresholds
    from usage_limits.web import observability, settings

    settings.cache_clear()
    thresholds.configured.cache_clear()
    observability.reset()
    snapstart.restore()
