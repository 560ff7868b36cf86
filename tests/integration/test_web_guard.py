"""require_tokens and the middleware, through a real Mangum handler and a real redis-server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

import pytest
from fastapi import Depends
from fastapi.responses import JSONResponse, StreamingResponse
from mangum import Mangum
from pydantic import BaseModel

from local.lambda_events import FakeContext, http_event, invoke, lambda_loop
from local.redis_servers import RedisServer
from usage_limits.deadline import remaining_s
from usage_limits.web import (
    Charge,
    create_app,
    current_user,
    idempotency,
    require_tokens,
    runtime,
    settings,
)
from usage_limits.web.costs import per_started
from usage_limits.web.runtime import get_budget

calls: list[str] = []


class Item(BaseModel):
    n: int


class Batch(BaseModel):
    items: list[str]


#: One token per item: the cost of a /batch request comes from its validated body.
PER_ITEM = per_started(Batch, lambda batch: len(batch.items), size=1, what="items")


def build_app() -> Any:
    app = create_app("guard test")

    @app.post("/ok", dependencies=[Depends(require_tokens(cost=5))])
    async def ok() -> dict[str, Any]:
        calls.append("ok")
        return {"ok": True, "deadline_s": remaining_s(default=-1)}

    @app.post("/raises", dependencies=[Depends(require_tokens(cost=5))])
    async def raises() -> dict[str, Any]:
        calls.append("raises")
        raise RuntimeError("boom")

    @app.post("/returns-502", dependencies=[Depends(require_tokens(cost=5))])
    async def returns_502() -> JSONResponse:
        calls.append("returns-502")
        return JSONResponse({"error": {"code": "provider_error", "message": "x"}}, status_code=502)

    @app.post("/streams-then-raises", dependencies=[Depends(require_tokens(cost=5))])
    async def streams_then_raises() -> StreamingResponse:
        calls.append("streams-then-raises")

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"part": 1'
            raise RuntimeError("the stream broke")

        return StreamingResponse(chunks(), media_type="application/json")

    @app.post("/validated", dependencies=[Depends(require_tokens(cost=5))])
    async def validated(item: Item) -> dict[str, int]:
        calls.append("validated")
        return {"n": item.n}

    @app.post("/settles")
    async def settles(
            charge: Annotated[Charge, Depends(require_tokens(cost=10))]) -> dict[str, int]:
        await charge.settle(3)
        return {"cost": charge.cost}

    @app.post("/settles-then-fails")
    async def settles_then_fails(
            charge: Annotated[Charge, Depends(require_tokens(cost=10))]) -> JSONResponse:
        await charge.settle(3)
        return JSONResponse({"error": {"code": "provider_error", "message": "x"}},
                            status_code=502)

    @app.post("/batch")
    async def batch(body: Batch,
                    charge: Annotated[Charge, Depends(require_tokens(cost=PER_ITEM))]
                    ) -> dict[str, int]:
        calls.append("batch")
        return {"items": len(body.items), "cost": charge.cost}

    @app.get("/used")
    async def used(user: str = Depends(current_user)) -> dict[str, int]:
        report = await get_budget(settings().plan).usage(user)
        return {"used": report.windows[0].used}

    return Mangum(app, lifespan="off")


@pytest.fixture
def web(monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer,
        stored_answers: str) -> Iterator[Any]:
    """A guarded test app over the session's redis-server, with a 20-token hourly plan, its
    answers stored in the session's local DynamoDB."""
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


def used(handler: Any, user: str) -> int:
    return invoke(handler, http_event("GET", "/used", user=user)).body["used"]


def test_allowed_request_is_charged_and_carries_ratelimit_headers(web: Any) -> None:
    """A 200 charges the route's cost and reports the remaining tokens in IETF headers."""
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/ok", body={}, user=user))
    assert res.status == 200
    assert res.headers["ratelimit-policy"] == '"1h";q=20;w=3600;atto-qu="tokens"'
    assert res.headers["ratelimit"].startswith('"1h";r=15;t=')
    assert used(web, user) == 5


def test_over_budget_gets_429_with_retry_after_and_fields(web: Any) -> None:
    """The request that does not fit gets 429 budget_exceeded with every documented field."""
    user = uuid.uuid4().hex
    for _ in range(4):
        assert invoke(web, http_event("POST", "/ok", body={}, user=user)).status == 200
    res = invoke(web, http_event("POST", "/ok", body={}, user=user))
    assert res.status == 429
    err = res.body["error"]
    assert err["code"] == "budget_exceeded"
    assert err["limit"] == 20 and err["remaining"] == 0 and err["window_s"] == 3600
    assert 3590 < err["retry_after_s"] <= 3600
    assert 3590 < int(res.headers["retry-after"]) <= 3601
    assert res.headers["ratelimit"].startswith('"1h";r=0;')
    assert calls == ["ok"] * 4
    assert used(web, user) == 20


def test_raised_error_is_refunded_and_shaped(web: Any) -> None:
    """A route that raises answers 500 in the error shape, with the request's id, and gives
    the tokens back."""
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/raises", body={}, user=user, request_id="gw-500"))
    assert res.status == 500
    assert res.body == {"error": {"code": "internal_error", "message": "internal error",
                                  "request_id": "gw-500"}}
    assert res.headers["x-request-id"] == "gw-500"
    assert calls == ["raises"]
    assert used(web, user) == 0


def test_returned_5xx_is_refunded(web: Any) -> None:
    """A 5xx that the route returns (not raises) is refunded too, and r counts the refund."""
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/returns-502", body={}, user=user))
    assert res.status == 502
    assert res.headers["ratelimit"].startswith('"1h";r=20;')
    assert used(web, user) == 0


def test_invalid_body_is_refunded_with_invalid_request(web: Any) -> None:
    """Body validation fails before any reservation: 422 invalid_request, nothing charged."""
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/validated", body={"n": "not a number"}, user=user))
    assert res.status == 422
    assert res.body["error"]["code"] == "invalid_request"
    assert res.body["error"]["details"][0]["loc"] == ["body", "n"]
    assert calls == []
    assert used(web, user) == 0


def test_no_identity_is_401_and_runs_nothing(web: Any) -> None:
    """Without JWT claims the request is 401 unauthorized and no route runs."""
    res = invoke(web, http_event("POST", "/ok", body={}, user=None))
    assert res.status == 401
    assert res.body["error"]["code"] == "unauthorized"
    assert calls == []


def test_local_user_header_is_ignored_outside_local_mode(web: Any) -> None:
    """X-Atto-User names nobody unless ATTO_ENV=local."""
    event = http_event("POST", "/ok", body={}, user=None, headers={"X-Atto-User": "mallory"})
    assert invoke(web, event).status == 401


def test_local_user_header_works_in_local_mode(web: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """In local mode X-Atto-User identifies the caller."""
    monkeypatch.setenv("ATTO_ENV", "local")
    settings.cache_clear()
    user = uuid.uuid4().hex
    event = http_event("POST", "/ok", body={}, user=None, headers={"X-Atto-User": user})
    assert invoke(web, event).status == 200
    assert used(web, user) == 5


def test_jwt_wins_over_local_header(web: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even in local mode a JWT subject is never overridden by the header."""
    monkeypatch.setenv("ATTO_ENV", "local")
    settings.cache_clear()
    user, other = uuid.uuid4().hex, uuid.uuid4().hex
    event = http_event("POST", "/ok", body={}, user=user, headers={"X-Atto-User": other})
    assert invoke(web, event).status == 200
    assert used(web, user) == 5 and used(web, other) == 0


def test_repeated_idempotency_key_replays_and_is_charged_once(web: Any) -> None:
    """The same Idempotency-Key from the same user returns the stored answer, charged once."""
    user, key = uuid.uuid4().hex, str(uuid.uuid4())
    first = invoke(web, http_event("POST", "/ok", body={}, user=user,
                                   headers={"Idempotency-Key": key}))
    second = invoke(web, http_event("POST", "/ok", body={}, user=user,
                                    headers={"Idempotency-Key": key}))
    assert first.status == 200 and "idempotent-replayed" not in first.headers
    assert second.status == 200 and second.headers["idempotent-replayed"] == "true"
    assert second.body == first.body
    assert calls == ["ok"]
    assert used(web, user) == 5


def test_idempotency_key_with_another_body_is_422(web: Any) -> None:
    """Reusing a key for a different request is refused (422 idempotency_key_reused, the
    IETF draft's answer) and charges nothing more."""
    user, key = uuid.uuid4().hex, str(uuid.uuid4())
    assert invoke(web, http_event("POST", "/validated", body={"n": 1}, user=user,
                                  headers={"Idempotency-Key": key})).status == 200
    res = invoke(web, http_event("POST", "/validated", body={"n": 2}, user=user,
                                 headers={"Idempotency-Key": key}))
    assert res.status == 422 and res.body["error"]["code"] == "idempotency_key_reused"
    assert used(web, user) == 5


def test_idempotency_key_in_flight_is_409(web: Any) -> None:
    """A repeat while the first request with the key still runs gets 409, not a second call."""
    import asyncio

    from usage_limits.web import idempotency as idem

    user, key = uuid.uuid4().hex, "in-flight"
    record = idem.record_data(user, "k:" + key, "POST", "/ok", b"", b"{}")
    asyncio.get_event_loop().run_until_complete(idem.begin(record, 10_000))
    res = invoke(web, http_event("POST", "/ok", body={}, user=user,
                                 headers={"Idempotency-Key": key}))
    assert res.status == 409 and res.body["error"]["code"] == "idempotency_conflict"
    assert calls == [] and used(web, user) == 0


def test_guard_still_refuses_a_charged_id_without_a_stored_answer(web: Any) -> None:
    """If the stored answer is gone, the ledger still charges the key only once (409: a
    charge for it stands)."""
    from usage_limits.web import idempotency as idem

    user, key = uuid.uuid4().hex, "lost-record"
    assert invoke(web, http_event("POST", "/ok", body={}, user=user,
                                  headers={"Idempotency-Key": key})).status == 200
    record = idem.record_data(user, "k:" + key, "POST", "/ok", b"", b"{}")
    import asyncio

    asyncio.get_event_loop().run_until_complete(idem.abandon(record))
    res = invoke(web, http_event("POST", "/ok", body={}, user=user,
                                 headers={"Idempotency-Key": key}))
    assert res.status == 409 and res.body["error"]["code"] == "idempotency_conflict"
    assert "retry-after" not in res.headers and calls == ["ok"] and used(web, user) == 5


def test_idempotency_key_is_scoped_to_the_user(web: Any) -> None:
    """Another user's use of the same key neither blocks nor charges this user."""
    alice, bob, key = uuid.uuid4().hex, uuid.uuid4().hex, "shared-key"
    assert invoke(web, http_event("POST", "/ok", body={}, user=alice,
                                  headers={"Idempotency-Key": key})).status == 200
    assert invoke(web, http_event("POST", "/ok", body={}, user=bob,
                                  headers={"Idempotency-Key": key})).status == 200
    assert used(web, alice) == 5 and used(web, bob) == 5


def test_a_keyed_answer_cut_short_is_a_500_refunded_and_the_key_freed(web: Any) -> None:
    """A keyed success whose body breaks half way is never sent (nor stored): the client
    gets 500 internal_error, the charge is refunded and the key runs again."""
    user, key = uuid.uuid4().hex, {"Idempotency-Key": uuid.uuid4().hex}
    res = invoke(web, http_event("POST", "/streams-then-raises", body={}, user=user,
                                 headers=key))
    assert res.status == 500 and res.body["error"]["code"] == "internal_error"
    assert used(web, user) == 0
    again = invoke(web, http_event("POST", "/streams-then-raises", body={}, user=user,
                                   headers=key))
    assert again.status == 500 and calls == ["streams-then-raises"] * 2


def test_failed_request_can_be_retried_with_the_same_key(web: Any) -> None:
    """A refunded attempt does not block a retry under the same Idempotency-Key."""
    user, key = uuid.uuid4().hex, "retry-me"
    assert invoke(web, http_event("POST", "/raises", body={}, user=user,
                                  headers={"Idempotency-Key": key})).status == 500
    assert invoke(web, http_event("POST", "/ok", body={}, user=user,
                                  headers={"Idempotency-Key": key})).status == 200
    assert used(web, user) == 5


@pytest.mark.parametrize("key", ["", "x" * 129, "tab\there", "naïve"])
def test_malformed_idempotency_key_is_400(web: Any, key: str) -> None:
    """Empty, too long or non-printable-ASCII keys get 400 invalid_request, nothing charged."""
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/ok", body={}, user=user,
                                 headers={"Idempotency-Key": key}))
    assert res.status == 400 and res.body["error"]["code"] == "invalid_request"
    assert used(web, user) == 0


def test_oversized_body_is_413_and_charges_nothing(
        web: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body above ATTO_MAX_BODY_BYTES is refused before any charge or route."""
    monkeypatch.setenv("ATTO_MAX_BODY_BYTES", "1000")
    settings.cache_clear()
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/ok", raw_body="x" * 1001, user=user))
    assert res.status == 413 and res.body["error"]["code"] == "payload_too_large"
    assert calls == []
    assert used(web, user) == 0


def test_settle_lowers_the_charge(web: Any) -> None:
    """A route may settle a lower actual cost than it reserved; its RateLimit header counts
    the settled cost."""
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/settles", body={}, user=user))
    assert res.status == 200 and res.body == {"cost": 3}
    assert res.headers["ratelimit"].startswith('"1h";r=17;')
    assert used(web, user) == 3


def test_deadline_comes_from_the_lambda_context(web: Any) -> None:
    """The route sees a deadline no later than the Lambda's remaining time minus the margin."""
    res = invoke(web, http_event("POST", "/ok", body={}, user=uuid.uuid4().hex),
                 FakeContext(timeout_s=3.0))
    assert 0 < res.body["deadline_s"] <= 2.5


def test_redis_down_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Redis stopped the request gets 503 limiter_unavailable and no route runs."""
    server = RedisServer().start()
    monkeypatch.setenv("REDIS_URL", server.url)
    monkeypatch.setenv("ATTO_BUDGET", "20/1h")
    settings.cache_clear()
    runtime.set_redis(None)
    calls.clear()
    try:
        with lambda_loop():
            handler = build_app()
            assert invoke(handler, http_event("POST", "/ok", body={})).status == 200
            server.stop(kill=True)
            res = invoke(handler, http_event("POST", "/ok", body={}))
            assert res.status == 503
            assert res.body["error"]["code"] == "limiter_unavailable"
            assert "retry-after" in res.headers
            assert calls == ["ok"]
            # Redis may have charged and lost only the reply: a refund waits for its return.
            from usage_limits.web import refunds

            assert refunds.pending() == 1
    finally:
        server.close()
        settings.cache_clear()
        runtime.set_redis(None)


def test_refund_missed_while_redis_is_down_lands_with_the_next_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A refund that fails because Redis went down is retried before the environment's next
    request."""
    from usage_limits.web import refunds

    server = RedisServer(extra=["--appendonly", "yes", "--appendfsync", "always"]).start()
    monkeypatch.setenv("REDIS_URL", server.url)
    monkeypatch.setenv("ATTO_BUDGET", "20/1h")
    settings.cache_clear()
    runtime.set_redis(None)
    refunds.clear()
    app = create_app("refund retry")

    @app.post("/fails-after-outage", dependencies=[Depends(require_tokens(cost=5))])
    async def fails_after_outage() -> dict[str, Any]:
        server.stop(kill=True)  # Redis dies while the request is being served
        raise RuntimeError("upstream broke too")

    @app.get("/used")
    async def used_route(user: str = Depends(current_user)) -> dict[str, int]:
        report = await get_budget(settings().plan).usage(user)
        return {"used": report.windows[0].used}

    user = uuid.uuid4().hex
    try:
        with lambda_loop():
            handler = Mangum(app, lifespan="off")
            assert invoke(handler, http_event("POST", "/fails-after-outage", body={},
                                              user=user)).status == 500
            assert refunds.pending() == 1
            server.start()  # same port, same data (append-only file)
            assert invoke(handler, http_event("GET", "/used", user=user)).body["used"] == 0
            assert refunds.pending() == 0
    finally:
        refunds.clear()
        server.close()
        settings.cache_clear()
        runtime.set_redis(None)


class ReplyDroppingProxy:
    """A TCP proxy to Redis that can swallow Redis's replies (commands still arrive)."""

    def __init__(self, port: int) -> None:
        import socket
        import threading

        self.target, self.drop = port, False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: Any, dst: Any, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if not (replies and self.drop):
                    dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


def test_charge_whose_reply_was_lost_is_refunded(monkeypatch: pytest.MonkeyPatch,
                                                 redis_server: RedisServer) -> None:
    """A reservation that Redis made but whose reply was lost is refunded, not left charged."""
    import redis as sync_redis

    from usage_limits.keys import user_keys
    from usage_limits.web import refunds

    proxy = ReplyDroppingProxy(redis_server.port)
    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{proxy.port}/0")
    monkeypatch.setenv("ATTO_BUDGET", "20/1h")
    monkeypatch.setenv("REDIS_SOCKET_TIMEOUT_S", "0.3")
    monkeypatch.setenv("REDIS_RETRIES", "0")
    settings.cache_clear()
    runtime.set_redis(None)
    user = uuid.uuid4().hex
    ledger = sync_redis.Redis(port=redis_server.port)
    calls.clear()
    try:
        with lambda_loop():
            handler = build_app()
            # The scripts are loaded before Redis's replies start to go missing (by another
            # user: the session's Redis may already hold the default user's charges).
            warm = http_event("POST", "/ok", body={}, user=uuid.uuid4().hex)
            assert invoke(handler, warm).status == 200
            assert invoke(handler, http_event("GET", "/used", user=user)).body["used"] == 0
            proxy.drop = True
            res = invoke(handler, http_event("POST", "/ok", body={}, user=user))
            assert res.status == 503 and res.body["error"]["code"] == "limiter_unavailable"
            assert ledger.zcard(user_keys(user, "log")[0]) == 1  # Redis did charge
            assert refunds.pending() == 1
            proxy.drop = False
            assert invoke(handler, http_event("GET", "/used", user=user)).body["used"] == 0
            assert ledger.zcard(user_keys(user, "log")[0]) == 0
            assert refunds.pending() == 0 and calls == ["ok"]
    finally:
        proxy.close()
        settings.cache_clear()
        runtime.set_redis(None)


def test_unreachable_cluster_with_an_idempotency_key_fails_closed_in_json(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When no cluster node answers, a request with a key still gets 503 limiter_unavailable in
    the error shape."""
    from local.redis_servers import free_port

    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    monkeypatch.setenv("REDIS_CLUSTER", "true")
    monkeypatch.setenv("ATTO_BUDGET", "20/1h")
    settings.cache_clear()
    runtime.set_redis(None)
    idempotency.reset()
    calls.clear()
    try:
        with lambda_loop():
            res = invoke(build_app(), http_event("POST", "/ok", body={},
                                                 headers={"Idempotency-Key": "k-1"}))
        assert res.status == 503 and res.body["error"]["code"] == "limiter_unavailable"
        assert calls == []
    finally:
        settings.cache_clear()
        runtime.set_redis(None)
        idempotency.reset()


class RedisCommands:
    """The commands clients send to a redis-server while the block runs (MONITOR), leaving
    out those that scripts issue: one entry per round trip."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.names: list[str] = []

    def __enter__(self) -> list[str]:
        import threading

        import redis as sync_redis

        self.marker = f"marker-{uuid.uuid4().hex}"
        self.client = sync_redis.Redis(port=self.server.port)
        started = threading.Event()

        def watch() -> None:
            with sync_redis.Redis(port=self.server.port).monitor() as monitor:
                self.client.echo(self.marker + "-start")
                while True:
                    entry = monitor.next_command()
                    command = str(entry["command"])
                    if command == f"ECHO {self.marker}-start":
                        started.set()
                    elif command == f"ECHO {self.marker}-end":
                        return
                    elif started.is_set() and entry.get("client_type") != "lua":
                        self.names.append(command.split()[0].lower())

        self.thread = threading.Thread(target=watch, daemon=True)
        self.thread.start()
        started.wait(5)
        return self.names

    def __exit__(self, *exc: object) -> None:
        self.client.echo(self.marker + "-end")
        self.thread.join(5)
        self.client.close()


@pytest.mark.parametrize("headers", [{}, {"Idempotency-Key": "malformed-1"}])
def test_malformed_body_sends_no_command_to_redis(
        web: Any, redis_server: RedisServer, headers: dict[str, str]) -> None:
    """A body that fails validation is answered 422 without a single Redis command."""
    user = uuid.uuid4().hex
    assert invoke(web, http_event("POST", "/ok", body={}, user=uuid.uuid4().hex)).status == 200
    with RedisCommands(redis_server) as sent:
        res = invoke(web, http_event("POST", "/validated", body={"n": "x"}, user=user,
                                     headers=headers))
    assert res.status == 422 and res.body["error"]["code"] == "invalid_request"
    assert sent == []
    assert calls == ["ok"]


def test_malformed_body_is_422_for_a_user_without_budget(web: Any) -> None:
    """A user whose budget is spent still learns that the body is malformed (422, not 429)."""
    user = uuid.uuid4().hex
    for _ in range(4):
        assert invoke(web, http_event("POST", "/ok", body={}, user=user)).status == 200
    res = invoke(web, http_event("POST", "/validated", body={"n": "x"}, user=user))
    assert res.status == 422 and res.body["error"]["details"][0]["loc"] == ["body", "n"]
    assert invoke(web, http_event("POST", "/validated", body={"n": 1}, user=user)).status == 429


@pytest.mark.parametrize("cluster", ["false", "true"])
@pytest.mark.parametrize("headers", [{}, {"Idempotency-Key": "malformed-2"}])
def test_malformed_body_is_422_while_redis_is_unreachable(
        monkeypatch: pytest.MonkeyPatch, headers: dict[str, str], cluster: str) -> None:
    """With Redis (standalone or cluster) unreachable a malformed body still gets its 422; a
    valid one gets 503."""
    from local.redis_servers import free_port

    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    monkeypatch.setenv("REDIS_CLUSTER", cluster)
    monkeypatch.setenv("ATTO_BUDGET", "20/1h")
    settings.cache_clear()
    runtime.set_redis(None)
    idempotency.reset()
    calls.clear()
    try:
        with lambda_loop():
            handler = build_app()
            bad = invoke(handler, http_event("POST", "/validated", body={"n": "x"},
                                             headers=headers))
            good = invoke(handler, http_event("POST", "/validated", body={"n": 1},
                                              headers=headers))
        assert bad.status == 422 and bad.body["error"]["code"] == "invalid_request"
        assert good.status == 503 and good.body["error"]["code"] == "limiter_unavailable"
        assert calls == []
    finally:
        settings.cache_clear()
        runtime.set_redis(None)
        idempotency.reset()


def test_replay_carries_the_users_current_ratelimit_headers(web: Any) -> None:
    """A replayed answer shows the budget as it is now, and charges nothing again."""
    user, key = uuid.uuid4().hex, str(uuid.uuid4())
    first = invoke(web, http_event("POST", "/ok", body={}, user=user,
                                   headers={"Idempotency-Key": key}))
    assert first.headers["ratelimit"].startswith('"1h";r=15;')
    assert invoke(web, http_event("POST", "/ok", body={}, user=user)).status == 200
    replay = invoke(web, http_event("POST", "/ok", body={}, user=user,
                                    headers={"Idempotency-Key": key}))
    assert replay.status == 200 and replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["ratelimit-policy"] == '"1h";q=20;w=3600;atto-qu="tokens"'
    assert replay.headers["ratelimit"].startswith('"1h";r=10;')
    assert replay.body == first.body
    assert used(web, user) == 10 and calls == ["ok", "ok"]


@pytest.mark.parametrize("repeat", ["replay", "other-body"])
def test_replay_and_reuse_cost_one_dynamodb_call_and_one_redis_round_trip(
        web: Any, redis_server: RedisServer, repeat: str) -> None:
    """A replay or a 422 reuse reads the key's record in one DynamoDB call (the refused
    claim returns it) and the usage in one Redis script call, nothing more."""
    user, key = uuid.uuid4().hex, str(uuid.uuid4())
    assert invoke(web, http_event("POST", "/validated", body={"n": 1}, user=user,
                                  headers={"Idempotency-Key": key})).status == 200
    assert used(web, user) == 5  # Redis has the usage script now (no NOSCRIPT reload below)
    calls_made: list[str] = []
    idempotency._persistence().client.meta.events.register(
        "before-call.dynamodb", lambda model, **_: calls_made.append(model.name))
    n = 1 if repeat == "replay" else 2
    with RedisCommands(redis_server) as sent:
        res = invoke(web, http_event("POST", "/validated", body={"n": n}, user=user,
                                     headers={"Idempotency-Key": key}))
    assert res.status == (200 if repeat == "replay" else 422)
    assert "ratelimit" in res.headers
    assert sorted(sent) == ["evalsha"] and calls_made == ["PutItem"]


@pytest.mark.parametrize("conflict", ["other-body", "in-flight"])
def test_idempotency_conflicts_carry_ratelimit_headers(web: Any, conflict: str) -> None:
    """A 409 idempotency_conflict and a 422 reuse show the user's budget, and charge
    nothing."""
    import asyncio

    from usage_limits.web import idempotency as idem

    user, key = uuid.uuid4().hex, str(uuid.uuid4())
    assert invoke(web, http_event("POST", "/ok", body={}, user=user)).status == 200
    if conflict == "other-body":
        assert invoke(web, http_event("POST", "/validated", body={"n": 1}, user=user,
                                      headers={"Idempotency-Key": key})).status == 200
        res = invoke(web, http_event("POST", "/validated", body={"n": 2}, user=user,
                                     headers={"Idempotency-Key": key}))
        spent = 10
    else:
        record = idem.record_data(user, "k:" + key, "POST", "/ok", b"", b"{}")
        asyncio.get_event_loop().run_until_complete(idem.begin(record, 10_000))
        res = invoke(web, http_event("POST", "/ok", body={}, user=user,
                                     headers={"Idempotency-Key": key}))
        spent = 5
    assert (res.status, res.body["error"]["code"]) == (
        (422, "idempotency_key_reused") if conflict == "other-body"
        else (409, "idempotency_conflict"))
    assert res.headers["ratelimit-policy"] == '"1h";q=20;w=3600;atto-qu="tokens"'
    assert res.headers["ratelimit"].startswith(f'"1h";r={20 - spent};')
    assert used(web, user) == spent


def test_cost_computed_from_the_validated_body_is_charged(web: Any) -> None:
    """A route priced per item charges what its validated body counts, and says so."""
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/batch", body={"items": ["a", "b", "c"]}, user=user))
    assert res.status == 200 and res.body == {"items": 3, "cost": 3}
    assert res.headers["ratelimit"].startswith('"1h";r=17;')
    assert used(web, user) == 3
    assert invoke(web, http_event("POST", "/batch", body={"items": []}, user=user)).body == {
        "items": 0, "cost": 1}
    assert used(web, user) == 4


def test_computed_cost_over_budget_gets_429_with_that_cost(web: Any) -> None:
    """A computed cost that does not fit what is left is refused with that cost."""
    user = uuid.uuid4().hex
    assert invoke(web, http_event("POST", "/batch", body={"items": ["x"] * 15},
                                  user=user)).status == 200
    res = invoke(web, http_event("POST", "/batch", body={"items": ["x"] * 6}, user=user))
    assert res.status == 429 and res.body["error"]["cost"] == 6
    assert res.body["error"]["remaining"] == 5
    assert used(web, user) == 15 and calls == ["batch"]


def test_computed_cost_that_can_never_fit_is_refused_and_charges_nothing(web: Any) -> None:
    """A body whose cost is above the plan's limit is refused as never fitting, not run."""
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/batch", body={"items": ["x"] * 21}, user=user))
    assert res.status in (422, 429) and res.body["error"]["cost"] == 21
    assert res.body["error"]["code"] in ("cost_exceeds_plan", "budget_exceeded")
    assert calls == [] and used(web, user) == 0


def test_guard_on_a_route_that_does_not_meter_fails_closed(web: Any) -> None:
    """require_tokens on a route that does not meter (a plain APIRouter's) answers 500 and
    never runs the route for free."""
    from fastapi import APIRouter

    plain = APIRouter()

    @plain.post("/unmetered", dependencies=[Depends(require_tokens(cost=5))])
    async def unmetered() -> dict[str, bool]:
        calls.append("unmetered")
        return {"ok": True}

    app = create_app("plain router")
    app.include_router(plain)
    user = uuid.uuid4().hex
    res = invoke(Mangum(app, lifespan="off"), http_event("POST", "/unmetered", body={},
                                                         user=user))
    assert res.status == 500 and res.body["error"]["code"] == "internal_error"
    assert calls == [] and used(web, user) == 0


def test_settled_then_failed_request_is_refunded_in_full(web: Any) -> None:
    """A request that settled a lower cost and then failed gets that cost back, and its
    RateLimit header already counts the refund."""
    user = uuid.uuid4().hex
    res = invoke(web, http_event("POST", "/settles-then-fails", body={}, user=user,
                                 headers={"Idempotency-Key": uuid.uuid4().hex}))
    assert res.status == 502
    assert res.headers["ratelimit"].startswith('"1h";r=20;')
    assert used(web, user) == 0
