"""How a metered route takes over its require_tokens guard from FastAPI, and where it cannot."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from fastapi import APIRouter, Depends, FastAPI
from fastapi.dependencies.models import Dependant
from mangum import Mangum
from pydantic import BaseModel

from local.lambda_events import http_event, invoke, lambda_loop
from local.redis_servers import RedisServer
from tests.integration.test_web_guard import RedisCommands
from usage_limits.web import (
    Charge,
    create_app,
    current_user,
    idempotency,
    require_tokens,
    runtime,
    settings,
)
from usage_limits.web.guard import token_guard
from usage_limits.web.metering import MeteredRoute
from usage_limits.web.runtime import get_budget

calls: list[str] = []


class Item(BaseModel):
    n: int


#: One guard shared by a route's dependencies and its parameter, as a module constant is.
SHARED = require_tokens(cost=4)


async def guarded_user(charge: Annotated[Charge, Depends(require_tokens(cost=6))]) -> str:
    """A dependency of the app's own that depends on the guard (FastAPI has to solve it)."""
    return charge.user_id


def build_app() -> FastAPI:
    app = create_app("metering test")

    @app.post("/listed", dependencies=[Depends(require_tokens(cost=5))])
    async def listed(item: Item) -> dict[str, int]:
        calls.append("listed")
        return {"n": item.n}

    @app.post("/param")
    async def param(item: Item,
                    charge: Annotated[Charge, Depends(require_tokens(cost=7))]) -> dict[str, Any]:
        calls.append("param")
        return {"n": item.n, "cost": charge.cost, "user": charge.user_id}

    @app.post("/default")
    async def default(item: Item,
                      charge: Charge = Depends(require_tokens(cost=7))  # noqa: B008
                      ) -> dict[str, Any]:
        calls.append("default")
        return {"n": item.n, "cost": charge.cost, "user": charge.user_id}

    @app.post("/shared", dependencies=[Depends(SHARED)])
    async def shared(charge: Annotated[Charge, Depends(SHARED)]) -> dict[str, int]:
        calls.append("shared")
        return {"cost": charge.cost}

    @app.post("/sync", dependencies=[Depends(require_tokens(cost=2))])
    def sync() -> dict[str, bool]:
        calls.append("sync")
        return {"ok": True}

    @app.post("/nested")
    async def nested(user: Annotated[str, Depends(guarded_user)]) -> dict[str, str]:
        calls.append("nested")
        return {"user": user}

    router = APIRouter(route_class=MeteredRoute)

    @router.post("/included")
    async def included(charge: Annotated[Charge, Depends(require_tokens(cost=3))]
                       ) -> dict[str, int]:
        calls.append("included")
        return {"cost": charge.cost}

    app.include_router(router, prefix="/r")

    @app.get("/used")
    async def used(user: str = Depends(current_user)) -> dict[str, int]:
        report = await get_budget(settings().plan).usage(user)
        return {"used": report.windows[0].used}

    return app


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer,
        stored_answers: str) -> Iterator[FastAPI]:
    """The test app over the session's redis-server, with a 20-token hourly plan (answers
    stored in the session's local DynamoDB)."""
    monkeypatch.setenv("REDIS_URL", redis_server.url)
    monkeypatch.setenv("ATTO_BUDGET", "20/1h")
    monkeypatch.delenv("ATTO_ENV", raising=False)
    settings.cache_clear()
    runtime.set_redis(None)
    idempotency.reset()
    calls.clear()
    with lambda_loop():
        yield build_app()
    settings.cache_clear()
    runtime.set_redis(None)
    idempotency.reset()


def guards(dependant: Dependant) -> list[Any]:
    """Every require_tokens guard anywhere in ``dependant``'s tree of dependencies."""
    found: list[Any] = []
    stack = list(dependant.dependencies)
    while stack:
        sub = stack.pop()
        if token_guard(sub.call) is not None:
            found.append(sub.call)
        stack.extend(sub.dependencies)
    return found


def route(app: FastAPI, path: str) -> MeteredRoute:
    found = next(r for r in app.routes if getattr(r, "path", None) == path)
    assert isinstance(found, MeteredRoute)
    return found


def used(handler: Any, user: str) -> int:
    return invoke(handler, http_event("GET", "/used", user=user)).body["used"]


@pytest.mark.parametrize("path", ["/listed", "/param", "/default", "/shared", "/sync"])
def test_guard_is_not_in_the_dependant_fastapi_solves(app: FastAPI, path: str) -> None:
    """A route's guard is out of the dependant FastAPI solves per request, and still in the
    dependant OpenAPI and the price list read."""
    metered = route(app, path)
    assert guards(metered.solved_dependant) == []
    assert guards(metered.dependant) != []


@pytest.mark.parametrize(("path", "solved"), [("/param", False), ("/r/included", True)])
def test_fastapi_calls_the_guard_only_where_the_route_could_not_take_it(
        app: FastAPI, path: str, solved: bool) -> None:
    """The dependency function runs for a route of an included router, never for a route
    that took its guard over."""
    codes = {call.__code__ for call in guards(route(app, "/param").dependant)}
    ran: list[str] = []

    def watch(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            ran.append(frame.f_code.co_name)

    handler = Mangum(app, lifespan="off")
    event = http_event("POST", path, body={"n": 1}, user=uuid.uuid4().hex)
    sys.setprofile(watch)
    try:
        res = invoke(handler, event)
    finally:
        sys.setprofile(None)
    assert res.status == 200
    assert bool(ran) is solved


@pytest.mark.parametrize("path", ["/param", "/default"])
def test_parameter_declared_with_the_guard_receives_its_charge(app: FastAPI, path: str) -> None:
    """A route's parameter declared with require_tokens gets the request's reserved Charge."""
    handler, user = Mangum(app, lifespan="off"), uuid.uuid4().hex
    res = invoke(handler, http_event("POST", path, body={"n": 3}, user=user))
    assert res.status == 200 and res.body == {"n": 3, "cost": 7, "user": user}
    assert res.headers["ratelimit"].startswith('"1h";r=13;')
    assert used(handler, user) == 7


def test_one_guard_in_dependencies_and_parameter_charges_once(app: FastAPI) -> None:
    """The same guard declared twice on a route charges once and hands the route its Charge."""
    handler, user = Mangum(app, lifespan="off"), uuid.uuid4().hex
    res = invoke(handler, http_event("POST", "/shared", body={}, user=user))
    assert res.status == 200 and res.body == {"cost": 4}
    assert used(handler, user) == 4


def test_sync_endpoint_is_charged(app: FastAPI) -> None:
    """A plain-function endpoint is charged before it runs in the thread pool."""
    handler, user = Mangum(app, lifespan="off"), uuid.uuid4().hex
    assert invoke(handler, http_event("POST", "/sync", body={}, user=user)).status == 200
    assert calls == ["sync"] and used(handler, user) == 2


@pytest.mark.parametrize("path", ["/listed", "/param", "/nested", "/r/included"])
def test_no_identity_is_401_before_validation_with_no_redis_command(
        app: FastAPI, redis_server: RedisServer, path: str) -> None:
    """Without a user, an invalid request is 401 (not 422), and Redis hears nothing."""
    handler = Mangum(app, lifespan="off")
    with RedisCommands(redis_server) as sent:
        res = invoke(handler, http_event("POST", path, body={"n": "x"}, user=None))
    assert res.status == 401 and res.body["error"]["code"] == "unauthorized"
    assert sent == [] and calls == []


@pytest.mark.parametrize("path", ["/listed", "/param"])
def test_malformed_idempotency_key_is_400_before_validation(app: FastAPI, path: str) -> None:
    """A malformed Idempotency-Key is 400 even when the body is invalid too."""
    res = invoke(Mangum(app, lifespan="off"),
                 http_event("POST", path, body={"n": "x"}, user=uuid.uuid4().hex,
                            headers={"Idempotency-Key": "x" * 200}))
    assert res.status == 400 and res.body["error"]["code"] == "invalid_request"
    assert calls == []


@pytest.mark.parametrize("path", ["/listed", "/param"])
def test_invalid_request_of_an_identified_user_is_422_and_charges_nothing(
        app: FastAPI, redis_server: RedisServer, path: str) -> None:
    """An identified user's invalid request is 422 with no Redis command and no charge."""
    handler, user = Mangum(app, lifespan="off"), uuid.uuid4().hex
    with RedisCommands(redis_server) as sent:
        res = invoke(handler, http_event("POST", path, body={"n": "x"}, user=user))
    assert res.status == 422 and res.body["error"]["code"] == "invalid_request"
    assert sent == [] and used(handler, user) == 0


@pytest.mark.parametrize(("path", "cost"), [("/nested", 6), ("/r/included", 3)])
def test_guard_fastapi_solves_still_charges_once(app: FastAPI, path: str, cost: int) -> None:
    """A guard inside another dependency, or on a route of an included router, is solved by
    FastAPI as before: charged once, after validation."""
    handler, user = Mangum(app, lifespan="off"), uuid.uuid4().hex
    res = invoke(handler, http_event("POST", path, body={}, user=user))
    assert res.status == 200
    assert used(handler, user) == cost
    assert res.headers["ratelimit"].startswith(f'"1h";r={20 - cost};')


def test_included_route_replays_an_idempotent_request(app: FastAPI) -> None:
    """A route of an included router claims the Idempotency-Key too: a repeat is replayed
    and charged once."""
    handler, user, key = Mangum(app, lifespan="off"), uuid.uuid4().hex, str(uuid.uuid4())
    event = http_event("POST", "/r/included", body={}, user=user,
                       headers={"Idempotency-Key": key})
    first, again = invoke(handler, event), invoke(handler, event)
    assert first.status == again.status == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert calls == ["included"] and used(handler, user) == 3
