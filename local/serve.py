"""``make serve``: every function's app on the routes declared in template.yaml.

Like ``sam local start-api`` but without containers: one uvicorn server dispatches each
request to the FastAPI app of the function whose route matches, in local mode
(``ATTO_ENV=local``, so ``X-Atto-User`` names the user), with a Lambda context whose time
runs from the request's arrival for the function's ``Timeout`` in template.yaml (or
``ATTO_REQUEST_TIMEOUT_S``). ``WORKERS`` > 1 runs that many
processes, each like one Lambda execution environment with its own Redis client.

Environment: ``PORT`` (8000), ``HOST`` (127.0.0.1), ``WORKERS`` (1), ``WORKER_CONCURRENCY``
(1: like a Lambda execution environment, a worker runs one request at a time and queues the
rest; 0 for no limit); ``REDIS_URL`` and ``LLM_BASE_URL`` unset start a private
redis-server and the offline provider emulator.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import sys
from typing import Any

from starlette.types import Receive, Scope, Send


class Dispatcher:
    """An ASGI app that routes by path (and method) to each function's own app."""

    def __init__(self, routes: dict[tuple[str, str], Any], concurrency: int = 1,
                 timeouts: dict[tuple[str, str], float] | None = None) -> None:
        self.routes = routes
        self.timeouts = timeouts or {}
        self.paths = {path for _, path in routes}
        # Routes with {parameters} (the operator API), matched as API Gateway does: a
        # parameter is one path segment.
        self.templates = [(_template_pattern(path), method, path)
                          for method, path in routes if "{" in path]
        self.concurrency = concurrency
        self._gate: asyncio.Semaphore | None = None

    def match(self, method: str, path: str) -> tuple[tuple[str, str] | None, bool]:
        """The route key (method, template path) for a request, and whether the path is
        known at all (for 405 versus 404)."""
        if (method, path) in self.routes:
            return (method, path), True
        known = path in self.paths
        for pattern, route_method, template in self.templates:
            if pattern.match(path):
                known = True
                if route_method == method:
                    return (route_method, template), True
        return None, known

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            while message["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
                message = await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope.get("path", "")
        route, known = self.match(scope.get("method", ""), path)
        app = self.routes.get(route) if route is not None else None
        if app is None or route is None:
            from usage_limits.web.errors import error_response

            status, code = (405, "method_not_allowed") if known else (404, "not_found")
            await error_response(status, code, f"no route for {scope.get('method')} {path}")(
                scope, receive, send)
            return
        # As API Gateway does, the request's time runs from its arrival, queueing included.
        from .lambda_events import FakeContext

        scope = {**scope, "aws.context": FakeContext(timeout_s=self.timeouts.get(route, 29.0),
                                                     function_name=path)}
        if self.concurrency <= 0:
            await app(scope, receive, send)
            return
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.concurrency)
        async with self._gate:  # one request at a time, as in one Lambda environment
            await app(scope, receive, send)


def _template_pattern(path: str) -> re.Pattern[str]:
    """``/a/{b}/c`` as a regex in which ``{b}`` is one path segment."""
    return re.compile(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path)) + "$")


def load_function_app(code_dir: str) -> Any:
    """Import ``<code_dir>/app.py`` as a uniquely named module and return its ``app``."""
    module = importlib.import_module(code_dir.strip("/").replace("/", ".") + ".app")
    return module.app


def create_dispatcher() -> Dispatcher:
    """The dispatcher for every function in template.yaml (uvicorn factory)."""
    from .template import functions

    routes, timeouts = {}, {}
    apps: dict[str, Any] = {}
    override = os.environ.get("ATTO_REQUEST_TIMEOUT_S")
    for fn in functions():
        if fn.code_dir not in apps:
            apps[fn.code_dir] = load_function_app(fn.code_dir)
        routes[(fn.method, fn.path)] = apps[fn.code_dir]
        timeouts[(fn.method, fn.path)] = float(override) if override else float(fn.timeout)
    return Dispatcher(routes, concurrency=int(os.environ.get("WORKER_CONCURRENCY", "1")),
                      timeouts=timeouts)


def main() -> int:
    import uvicorn

    from .stack import local_stack
    from .template import functions

    port = int(os.environ.get("PORT", "8000"))
    host = os.environ.get("HOST", "127.0.0.1")
    workers = int(os.environ.get("WORKERS", "1"))
    with local_stack() as started:
        url = f"http://{host}:{port}"
        print(f"Atto Cloud (local) on {url} with {workers} worker(s)")
        for name in ("REDIS_URL", "EMULATOR_URL", "ATTO_DYNAMODB_ENDPOINT"):
            if name in started:
                print(f"  {name}={started[name]} (started for this session)")
        for fn in functions():
            print(f"  {fn.method:5} {url}{fn.path}")
        print("Try:\n"
              f"  curl -i -X POST {url}/v1/structured -H 'X-Atto-User: alice' "
              "-H 'Content-Type: application/json' \\\n"
              "    -d '{\"prompt\": \"Summarise: senior Python engineer, Berlin\", "
              "\"schema\": {\"type\": \"object\", "
              "\"properties\": {\"title\": {\"type\": \"string\"}}, "
              "\"required\": [\"title\"]}}'\n"
              f"  curl -s {url}/v1/usage -H 'X-Atto-User: alice'", flush=True)
        uvicorn.run("local.serve:create_dispatcher", factory=True, host=host, port=port,
                    workers=workers, log_level=os.environ.get("LOG_LEVEL", "warning").lower(),
                    access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
