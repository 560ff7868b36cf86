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
        self.concurrency = concurrency
        self._gate: asyncio.Semaphore | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            while message["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
                message = await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope.get("path", "")
        route = (scope.get("method", ""), path)
        app = self.routes.get(route)
        if app is None:
            from usage_limits.web.errors import error_response

            status, code = (405, "method_not_allowed") if path in self.paths else (404, "not_found")
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


def load_function_app(code_dir: str) -> Any:
    """Import ``<code_dir>/app.py`` as a uniquely named module and return its ``app``."""
    module = importlib.import_module(code_dir.strip("/").replace("/", ".") + ".app")
    return module.app


def create_dispatcher() -> Dispatcher:
    """The dispatcher for every function in template.yaml (uvicorn factory)."""
    from .template import functions

    routes, timeouts = {}, {}
    override = os.environ.get("ATTO_REQUEST_TIMEOUT_S")
    for fn in functions():
        routes[(fn.method, fn.path)] = load_function_app(fn.code_dir)
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
        for name in ("REDIS_URL", "EMULATOR_URL"):
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
