"""``make serve``: every function's app on the routes declared in template.yaml.

Like ``sam local start-api`` but without containers: one uvicorn server dispatches each
request to the FastAPI app of the function whose route matches, in local mode
(``ATTO_ENV=local``, so ``X-Atto-User`` names the user), with a Lambda context whose time
runs from the request's arrival for the function's ``Timeout`` in template.yaml (or
``ATTO_REQUEST_TIMEOUT_S``). ``WORKERS`` > 1 runs that many
processes, each like one Lambda execution environment with its own Redis client.

Each request runs with its function's own environment from template.yaml (Globals merged
with the function's ``Environment``), under what the shell and the local stack set, as
``make invoke`` does: embeddings gets its 1 MiB body cap, every function its service name.
One process serves every function, so the variables that differ between functions are
applied per request (web settings, log and metrics names; requests of two different
environments never overlap in a worker); any other variable must be the same for all.

Environment: ``PORT`` (8000), ``HOST`` (127.0.0.1), ``WORKERS`` (1), ``WORKER_CONCURRENCY``
(1: like a Lambda execution environment, a worker runs one request at a time and queues the
rest; 0 for no limit); ``REDIS_URL`` and ``LLM_BASE_URL`` unset start a private
redis-server and the offline provider emulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import re
import socket
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.types import Receive, Scope, Send

from .stack import DATA_ENV

#: Variables read per request under ``make serve``, so each function may set its own.
PER_REQUEST_VARIABLES = frozenset({
    "ATTO_ENV", "ATTO_BUDGET", "ATTO_MAX_BODY_BYTES", "ATTO_DEADLINE_MARGIN_S",
    "ATTO_REQUEST_TIMEOUT_S", "POWERTOOLS_SERVICE_NAME", "POWERTOOLS_METRICS_NAMESPACE",
    "LOG_LEVEL",
})

Route = tuple[str, str]


class ServeError(Exception):
    """``make serve`` cannot start; the message says why in one line."""


def split_environments(envs: Mapping[Route, Mapping[str, str]]
                       ) -> tuple[dict[str, str], dict[Route, dict[str, str | None]]]:
    """Split each function's environment into what all share and what is its own.

    Args:
        envs: every route's full environment.

    Returns:
        The variables every function has with the same value, and for each route the
        variables that differ between functions (None: the function does not set it).

    Raises:
        ServeError: a variable outside ``PER_REQUEST_VARIABLES`` differs between functions;
            one process cannot give two functions two values of it.
    """
    names = set().union(*(env.keys() for env in envs.values())) if envs else set()
    varying = {name for name in names if len({env.get(name) for env in envs.values()}) > 1}
    fixed = sorted(varying - PER_REQUEST_VARIABLES)
    if fixed:
        raise ServeError(f"functions of template.yaml differ in {', '.join(fixed)}, which "
                         "make serve reads once per process; use make invoke for such a "
                         "function")
    first = next(iter(envs.values()), {})
    common = {name: value for name, value in first.items() if name not in varying}
    own = {route: {name: env.get(name) for name in sorted(varying)} for route, env in envs.items()}
    return common, own


def _apply(variables: Mapping[str, str | None]) -> None:
    """Put one function's own variables into the process and forget what was read from them."""
    from usage_limits.web import settings

    for name, value in variables.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    settings.cache_clear()


class EnvironmentGate:
    """Lets requests of one function environment overlap; a switch waits for the others.

    Switching resets the web settings (re-read from the new variables) and swaps in the
    logger and metrics made under that environment (made on first use, then kept).
    """

    def __init__(self, own: Mapping[Route, Mapping[str, str | None]]) -> None:
        self.own = own
        keys: dict[tuple[tuple[str, str | None], ...], int] = {}
        self.key = {route: keys.setdefault(tuple(sorted(env.items())), len(keys))
                    for route, env in own.items()}
        self.active: int | None = None
        self.running = 0
        self.waiting: Counter[int] = Counter()
        self._cond: asyncio.Condition | None = None
        self._observers: dict[int, tuple[Any, Any]] = {}

    def _may_enter(self, key: int) -> bool:
        if self.running == 0:
            return True
        others_waiting = any(n for k, n in self.waiting.items() if k != self.active)
        return self.active == key and not others_waiting

    def _switch(self, key: int, route: Route) -> None:
        from usage_limits.web import observability

        if self.active is not None:
            self._observers[self.active] = (observability._logger, observability._metrics)
        _apply(self.own[route])
        observability._logger, observability._metrics = self._observers.get(key, (None, None))
        self.active = key

    @contextlib.asynccontextmanager
    async def enter(self, route: Route) -> AsyncIterator[None]:
        """Run the block with ``route``'s function environment in place."""
        key = self.key.get(route)
        if key is None:  # not a function of the template
            yield
            return
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            self.waiting[key] += 1
            await self._cond.wait_for(lambda: self._may_enter(key))
            self.waiting[key] -= 1
            if self.active != key:
                self._switch(key, route)
            self.running += 1
        try:
            yield
        finally:
            async with self._cond:
                self.running -= 1
                self._cond.notify_all()


class Dispatcher:
    """An ASGI app that routes by path (and method) to each function's own app."""

    def __init__(self, routes: dict[Route, Any], concurrency: int = 1,
                 timeouts: dict[Route, float] | None = None,
                 environments: Mapping[Route, Mapping[str, str | None]] | None = None) -> None:
        self.routes = routes
        self.timeouts = timeouts or {}
        self.environments = EnvironmentGate(environments or {})
        self.paths = {path for _, path in routes}
        # Routes with {parameters} (the operator API), matched as API Gateway does: a
        # parameter is one path segment.
        self.templates = [(_template_pattern(path), method, path)
                          for method, path in routes if "{" in path]
        self.concurrency = concurrency
        self._gate: asyncio.Semaphore | None = None
        self._openapi: dict[str, Any] | None = None

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

    def allowed(self, path: str) -> list[str]:
        """The methods some route serves on ``path`` (a 405's ``Allow``), sorted."""
        methods = {m for m, p in self.routes if p == path}
        methods.update(m for pattern, m, _ in self.templates if pattern.match(path))
        return sorted(methods)

    def openapi(self) -> dict[str, Any]:
        """One OpenAPI document for every function's routes (each app's own, merged)."""
        if self._openapi is None:
            merged: dict[str, Any] = {"openapi": "3.1.0", "info": {
                "title": "Atto Cloud (local)", "version": "1.0.0",
                "description": "Every function's routes as make serve mounts them. Locally the "
                               "X-Atto-User header names the user (Authorize: AttoUser, and "
                               "AttoPlan to choose a plan); in AWS the JWT authorizer does "
                               "(and IAM on /admin/v1/, served unsigned here)."},
                "paths": {}}
            schemas: dict[str, Any] = {}
            for n, app in enumerate(dict.fromkeys(self.routes.values())):  # each app once
                document = _without_collisions(app.openapi(), schemas, f"_{n}")
                for path, item in document.get("paths", {}).items():
                    merged["paths"].setdefault(path, {}).update(
                        {m: op for m, op in item.items() if (m.upper(), path) in self.routes})
                schemas.update(document.get("components", {}).get("schemas", {}))
            merged["components"] = {"schemas": dict(sorted(schemas.items()))}
            from .openapi import metered_routes, with_local_security

            self._openapi = with_local_security(
                merged, metered_routes(dict.fromkeys(self.routes.values())))
        return self._openapi

    async def _documentation(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answer ``GET /openapi.json`` and ``GET /docs``; False for any other request."""
        if scope.get("method") not in ("GET", "HEAD") or scope.get("path") not in (
                "/openapi.json", "/docs"):
            return False
        from fastapi.openapi.docs import get_swagger_ui_html
        from starlette.responses import JSONResponse

        if scope["path"] == "/openapi.json":
            response: Any = JSONResponse(self.openapi())
        else:
            response = get_swagger_ui_html(openapi_url="/openapi.json",
                                           title="Atto Cloud (local)")
        await response(scope, receive, send)
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            while message["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
                message = await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if await self._documentation(scope, receive, send):
            return
        path = scope.get("path", "")
        route, known = self.match(scope.get("method", ""), path)
        app = self.routes.get(route) if route is not None else None
        if app is None or route is None:
            from usage_limits.web.errors import error_response

            headers = {"X-Request-Id": uuid.uuid4().hex}
            if known:
                allow = ", ".join(self.allowed(path))
                status, code, message = (405, "method_not_allowed",
                                         f"{path} answers {allow}, not {scope.get('method')}")
                headers["Allow"] = allow
            else:
                status, code, message = 404, "not_found", f"no route for {path}"
            await error_response(status, code, message, headers=headers,
                                 request_id=headers["X-Request-Id"])(scope, receive, send)
            return
        # As API Gateway does, the request's time runs from its arrival, queueing included.
        from .lambda_events import FakeContext

        scope = {**scope, "aws.context": FakeContext(timeout_s=self.timeouts.get(route, 29.0),
                                                     function_name=path)}
        if self.concurrency <= 0:
            async with self.environments.enter(route):
                await app(scope, receive, send)
            return
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.concurrency)
        # one request at a time, as in one Lambda environment
        async with self._gate, self.environments.enter(route):
            await app(scope, receive, send)


def _without_collisions(document: dict[str, Any], schemas: Mapping[str, Any],
                        suffix: str) -> dict[str, Any]:
    """``document`` with each schema whose name ``schemas`` already holds for another
    schema renamed (``suffix`` appended), its references with it (two functions may each
    have a model of the same name)."""
    own = document.get("components", {}).get("schemas", {})
    clashing = [name for name, schema in own.items()
                if name in schemas and schemas[name] != schema]
    if not clashing:
        return document
    text = json.dumps(document)
    for name in clashing:
        text = text.replace(f'"#/components/schemas/{name}"',
                            f'"#/components/schemas/{name}{suffix}"')
    renamed: dict[str, Any] = json.loads(text)
    found = renamed["components"]["schemas"]
    for name in clashing:
        found[name + suffix] = found.pop(name)
    return renamed


def _template_pattern(path: str) -> re.Pattern[str]:
    """``/a/{b}/c`` as a regex in which ``{b}`` is one path segment."""
    return re.compile(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path)) + "$")


def load_function_app(code_dir: str) -> Any:
    """Import ``<code_dir>/app.py`` as a uniquely named module and return its ``app``."""
    module = importlib.import_module(code_dir.strip("/").replace("/", ".") + ".app")
    return module.app


def create_dispatcher() -> Dispatcher:
    """The dispatcher for every function in template.yaml (uvicorn factory)."""
    from .template import functions, local_environment

    specs = functions()
    base = dict(os.environ)
    common, own = split_environments({(fn.method, fn.path): local_environment(fn, base)
                                      for fn in specs})
    os.environ.update(common)
    routes, timeouts = {}, {}
    apps: dict[str, Any] = {}
    override = os.environ.get("ATTO_REQUEST_TIMEOUT_S")
    for fn in specs:
        if fn.code_dir not in apps:
            apps[fn.code_dir] = load_function_app(fn.code_dir)
        routes[(fn.method, fn.path)] = apps[fn.code_dir]
        timeouts[(fn.method, fn.path)] = float(override) if override else float(fn.timeout)
    return Dispatcher(routes, concurrency=int(os.environ.get("WORKER_CONCURRENCY", "1")),
                      timeouts=timeouts, environments=own)


def check_port(host: str, port: int) -> None:
    """Make sure ``host:port`` can be listened on, as uvicorn will (``SO_REUSEADDR``).

    Raises:
        ServeError: the port is taken or the address cannot be used.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ServeError(f"HOST={host} cannot be resolved: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
            s.listen(1)
        except OSError as exc:
            reason = ("is already in use (another make serve?)"
                      if exc.errno in (98, 48) else f"cannot be used: {exc.strerror}")
            raise ServeError(f"port {port} on {host} {reason}; "
                             "choose another with PORT=...") from None


def state_line(data: str | None) -> str:
    """Where the banner says the state is kept: ``data`` (``ATTO_LOCAL_DATA``, make serve's
    ``.local``) keeps it across restarts; without it, it is lost when the server stops."""
    what = "State (budgets, grants, usage records, the audit log)"
    if data:
        return (f"{what} is kept in {data} across restarts; `make reset-local` forgets "
                "it.")
    return f"{what} is in memory: it goes when this stops (ATTO_LOCAL_DATA is unset)."


def main() -> int:
    import uvicorn

    from .stack import local_stack
    from .template import functions, local_environment

    port = int(os.environ.get("PORT", "8000"))
    host = os.environ.get("HOST", "127.0.0.1")
    workers = int(os.environ.get("WORKERS", "1"))
    try:
        check_port(host, port)
        split_environments({(fn.method, fn.path): local_environment(fn, os.environ)
                            for fn in functions()})
    except ServeError as exc:
        print(f"make serve: {exc}", file=sys.stderr)
        return 2
    with local_stack() as started:
        url = f"http://{host}:{port}"
        print(f"Atto Cloud (local) on {url} with {workers} worker(s)")
        for name in ("REDIS_URL", "EMULATOR_URL", "ATTO_DYNAMODB_ENDPOINT"):
            if name in started:
                print(f"  {name}={started[name]} (started for this session)")
        for fn in functions():
            print(f"  {fn.method:5} {url}{fn.path}")
        print(f"  API docs: {url}/docs (Swagger UI, loaded from a CDN; OpenAPI: "
              f"{url}/openapi.json)")
        print("  " + state_line(os.environ.get(DATA_ENV)))
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
