"""Redis errors raised inside a budget script are classified by their kind, under real conditions.

A server out of memory (maxmemory with noeviction), a replica (READONLY) and a server busy
running another client's long script (BUSY) are outages: ``LimiterUnavailable``, which the
web layer answers with 503 ``limiter_unavailable`` and Retry-After. A genuine bug in a
script (a Lua runtime error) stays an error.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from local.redis_servers import RedisServer
from tests.breakable import LONG_SCRIPT, outcomes
from tests.conftest import StartEnvironment
from usage_limits import LimiterUnavailable, TokenBudget, Window
from usage_limits._scripts import error_kind, script
from usage_limits.budget import LiveGrant
from usage_limits.keys import user_keys

T0 = 1_700_000_000_000
PLAN = [Window(limit=100, seconds=60)]


def _client(port: int, timeout: float = 2.0) -> aioredis.Redis:
    return aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout,
                          retry=None, decode_responses=False)


async def _every_call(budget: TokenBudget, user: str, nonce: str) -> dict[str, object]:
    """Run each budget script once; what each raised (or returned)."""
    calls = {"reserve": lambda: budget.reserve(user, "r2", 1, now_ms=T0 + 1),
             "refund": lambda: budget.refund(user, "r1", nonce=nonce),
             "settle": lambda: budget.settle(user, "r1", 1, nonce=nonce),
             "usage": lambda: budget.usage(user, now_ms=T0 + 2)}
    return await outcomes(calls)


@pytest.fixture
def server(breakable_server: RedisServer) -> RedisServer:
    """The test's own redis-server, which it may break."""
    return breakable_server


@pytest.fixture
async def charged(server: RedisServer) -> AsyncIterator[tuple[TokenBudget, str, str]]:
    """A budget over ``server`` with one charge ("r1", 5 tokens) already made."""
    client = _client(server.port)
    budget = TokenBudget(client, PLAN)
    user = uuid.uuid4().hex
    d = await budget.reserve(user, "r1", 5, now_ms=T0)
    assert d.allowed
    try:
        yield budget, user, d.nonce
    finally:
        await client.aclose()


async def test_out_of_memory_is_limiter_unavailable(server: RedisServer,
                                                    charged: tuple[TokenBudget, str, str]) -> None:
    """Under maxmemory with noeviction, every script that writes raises LimiterUnavailable."""
    budget, user, nonce = charged
    await budget.redis.config_set("maxmemory-policy", "noeviction")
    await budget.redis.config_set("maxmemory", "1")  # far below what the server uses
    out = await _every_call(budget, user, nonce)
    for name in ("reserve", "refund", "settle", "usage"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "OOM"  # type: ignore[arg-type]
    await budget.redis.config_set("maxmemory", "0")
    assert (await budget.usage(user, now_ms=T0 + 3)).windows[0].used == 5  # nothing changed


async def test_replica_is_limiter_unavailable(server: RedisServer,
                                              charged: tuple[TokenBudget, str, str]) -> None:
    """On a replica (after a failover, say), every script that writes raises
    LimiterUnavailable with the READONLY kind."""
    budget, user, nonce = charged
    await budget.redis.config_set("repl-diskless-sync-delay", "0")  # sync now, not in 5 s
    with RedisServer(extra=["--replicaof", "127.0.0.1", str(server.port)]) as replica:
        client = _client(replica.port)
        try:
            deadline = time.monotonic() + 10
            while await client.exists(*user_keys(user, "log")) == 0:  # replicated
                assert time.monotonic() < deadline, "the replica never synced"
                await asyncio.sleep(0.05)
            on_replica = TokenBudget(client, PLAN)
            out = await _every_call(on_replica, user, nonce)
        finally:
            await client.aclose()
    for name in ("reserve", "refund", "settle", "usage"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "READONLY"  # type: ignore[arg-type]
    assert (await budget.usage(user, now_ms=T0 + 3)).windows[0].used == 5


async def test_busy_server_is_limiter_unavailable(
        server: RedisServer, charged: tuple[TokenBudget, str, str]) -> None:
    """While another client's script runs past busy-reply-threshold, every budget script
    raises LimiterUnavailable with the BUSY kind, and the ledger is unchanged afterwards."""
    budget, user, nonce = charged
    await budget.redis.config_set("busy-reply-threshold", "50")  # ms (lua-time-limit)
    other = redis.Redis(port=server.port, socket_timeout=10)
    runner = threading.Thread(target=other.eval, args=(LONG_SCRIPT, 0, "1.5"), daemon=True)
    runner.start()
    await asyncio.sleep(0.3)  # the long script is running, past the threshold
    out = await _every_call(budget, user, nonce)
    runner.join()
    other.close()
    for name in ("reserve", "refund", "settle", "usage"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "BUSY"  # type: ignore[arg-type]
    assert (await budget.usage(user, now_ms=T0 + 3)).windows[0].used == 5


async def test_a_script_bug_stays_an_error(charged: tuple[TokenBudget, str, str]) -> None:
    """A Lua runtime error inside a script (here: arguments the script cannot compare) is
    raised as the redis error it is, not as an outage."""
    budget, user, _ = charged
    keys = user_keys(user, "log", "ev", "meta")
    with pytest.raises(ResponseError) as info:
        # a cost that is not a number: the script compares nil with a number
        await script("budget_reserve")(budget.redis, keys,
                                       [T0, "r9", "x", "n", "", 0, 60_000, 100])
    assert not isinstance(info.value, LimiterUnavailable)
    assert error_kind(info.value) == "ERR" and "user_script" in str(info.value)


def test_out_of_memory_answers_503_with_retry_after(server: RedisServer,
                                                    lambda_env: StartEnvironment) -> None:
    """Through a real handler, a Redis out of memory answers 503 limiter_unavailable with
    Retry-After on a metered route and on GET /v1/usage, not 500."""
    import importlib

    from local.lambda_events import http_event, invoke

    lambda_env({"REDIS_URL": server.url, "ATTO_BUDGET": "20/1h"}, unset=["ATTO_ENV"])
    embeddings = importlib.import_module("functions.embeddings.app")
    usage = importlib.import_module("functions.usage.app")
    user = uuid.uuid4().hex

    async def seed() -> None:  # the user has spent something: usage has keys to update
        client = _client(server.port)
        try:
            assert (await TokenBudget(client, [Window(20, 3600)]).reserve(user, "s", 1)).allowed
        finally:
            await client.aclose()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(seed())
    finally:
        loop.close()
    admin = redis.Redis(port=server.port)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")
    try:
        metered = invoke(embeddings.handler, http_event(
            "POST", "/v1/embeddings", body={"input": ["a"]}, user=user))
        free = invoke(usage.handler, http_event("GET", "/v1/usage", user=user))
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()
    for res in (metered, free):
        assert res.status == 503, res.body
        assert res.body["error"]["code"] == "limiter_unavailable"
        assert int(res.headers["retry-after"]) >= 1


GRANT_PLAN = [Window(limit=10, seconds=60)]


@pytest.fixture
async def drawn(server: RedisServer) -> AsyncIterator[tuple[TokenBudget, str, str]]:
    """A budget with entitlements over ``server``: the user's quota is full and one charge
    ("d1", 4 tokens) drew from a 10-token grant."""
    client = _client(server.port)
    budget = TokenBudget(client, GRANT_PLAN, entitlements=True)
    user = uuid.uuid4().hex
    assert await budget.load_entitlements(user, epoch=1, plan=None, suspended_until_ms=None,
                                          grants=[LiveGrant("g", 10, 10, None, "paid")])
    assert (await budget.reserve(user, "fill", 10, now_ms=T0)).drawn == 0
    d = await budget.reserve(user, "d1", 4, now_ms=T0 + 1)
    assert d.drawn == 4
    try:
        yield budget, user, d.nonce
    finally:
        await client.aclose()


async def _every_entitlements_call(budget: TokenBudget, user: str,
                                   nonce: str) -> dict[str, object]:
    """Run each script of the entitlements path once; what each raised (or returned)."""
    grant = LiveGrant("g", 10, 10, None, "paid")
    return await outcomes({
        "reserve": lambda: budget.reserve(user, "d2", 2, now_ms=T0 + 2),
        "refund": lambda: budget.refund(user, "d1", nonce=nonce, now_ms=T0 + 2),
        "settle": lambda: budget.settle(user, "d1", 1, nonce=nonce, now_ms=T0 + 2),
        "usage": lambda: budget.usage(user, now_ms=T0 + 2),
        "load": lambda: budget.load_entitlements(user, epoch=2, plan=None,
                                                 suspended_until_ms=None, grants=[grant]),
        "invalidate": lambda: budget.invalidate_entitlements(user, epoch=3)})


async def _state(budget: TokenBudget, user: str) -> tuple[object, ...]:
    """What a caller can see of the user: loaded, epoch, credit, windows and draws."""
    u = await budget.usage(user, now_ms=T0 + 3)
    return (u.loaded, u.epoch, tuple((g.reference, g.remaining) for g in u.grants),
            tuple(w.used for w in u.windows), tuple((e.request_id, e.cost, e.draws)
                                                    for e in u.events))


async def test_entitlements_scripts_out_of_memory_change_nothing(
        server: RedisServer, drawn: tuple[TokenBudget, str, str]) -> None:
    """Under maxmemory with noeviction, a drawing reserve, a credit-returning refund and
    settle and usage each raise LimiterUnavailable of kind OOM, and the grant, the windows
    and the draws are as they were. A load and an invalidation (whose first write frees
    memory, so Redis lets them go on) are all or nothing: refused, or done whole."""
    budget, user, nonce = drawn
    before = await _state(budget, user)
    assert before[2] == (("g", 6),)
    await budget.redis.config_set("maxmemory-policy", "noeviction")
    await budget.redis.config_set("maxmemory", "1")
    try:
        out = await _every_entitlements_call(budget, user, nonce)
        loaded, invalidated = out.pop("load"), out.pop("invalidate")
    finally:
        await budget.redis.config_set("maxmemory", "0")
    for name in ("reserve", "refund", "settle", "usage"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "OOM", name  # type: ignore[arg-type]
    for result in (loaded, invalidated):
        assert result in (True, None) or (isinstance(result, LimiterUnavailable) and error_kind(
            result.__cause__) == "OOM"), result  # type: ignore[arg-type]
    after = await _state(budget, user)
    assert after[3:] == before[3:]  # the ledger's windows and draws are untouched
    if invalidated is None:  # done whole: no copy until the next load
        assert after[0] is False
    elif loaded is True:  # the whole copy of epoch 2
        assert after[:3] == (True, 2, (("g", 10),))
    else:
        assert after == before


async def test_entitlements_scripts_on_a_replica_are_readonly(
        server: RedisServer, drawn: tuple[TokenBudget, str, str]) -> None:
    """On a replica every script of the entitlements path raises LimiterUnavailable of kind
    READONLY, and the primary's grant, windows and draws are unchanged."""
    budget, user, nonce = drawn
    before = await _state(budget, user)
    await budget.redis.config_set("repl-diskless-sync-delay", "0")  # sync now, not in 5 s
    with RedisServer(extra=["--replicaof", "127.0.0.1", str(server.port)]) as replica:
        client = _client(replica.port)
        try:
            deadline = time.monotonic() + 10
            while (await client.info("replication")).get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica never synced"
                await asyncio.sleep(0.05)
            assert await budget.redis.wait(1, 5000) == 1
            on_replica = TokenBudget(client, GRANT_PLAN, entitlements=True)
            out = await _every_entitlements_call(on_replica, user, nonce)
        finally:
            await client.aclose()
    for name in ("reserve", "refund", "settle", "usage", "load", "invalidate"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "READONLY", name  # type: ignore[arg-type]
    assert await _state(budget, user) == before


# ------------------------------------------------------------- budget_hold.lua (confirm, claim)


@pytest.fixture
async def holding(server: RedisServer) -> AsyncIterator[tuple[TokenBudget, str, dict[str, str]]]:
    """A budget over ``server`` whose user has two provisional charges: "mine" (held 60 s,
    to confirm) and "stale" (held 100 ms, long expired by T0 + 10 s: to claim)."""
    client = _client(server.port)
    budget = TokenBudget(client, PLAN)
    user = uuid.uuid4().hex
    stale = await budget.reserve(user, "stale", 3, now_ms=T0, hold_ms=100)
    mine = await budget.reserve(user, "mine", 5, now_ms=T0 + 1, hold_ms=60_000)
    assert stale.allowed and mine.allowed
    try:
        yield budget, user, {"mine": mine.nonce, "stale": stale.nonce}
    finally:
        await client.aclose()


async def _hold_modes(budget: TokenBudget, user: str,
                      nonces: dict[str, str]) -> dict[str, object]:
    """Each mode of ``budget_hold`` once: confirm only, claim only, confirm and claim."""
    later = T0 + 10_000
    return await outcomes({
        "confirm": lambda: budget.hold(user, "mine", nonce=nonces["mine"], now_ms=later,
                                       claim=0),
        "claim": lambda: budget.hold(user, now_ms=later),
        "both": lambda: budget.hold(user, "mine", nonce=nonces["mine"], now_ms=later)})


async def _hold_keys(client: aioredis.Redis, user: str) -> tuple[object, ...]:
    """Every key ``budget_hold`` reads or writes, raw: ev, pv (with scores), log, meta."""
    ev, pv, log, meta = user_keys(user, "ev", "pv", "log", "meta")
    return (await client.hgetall(ev), await client.zrange(pv, 0, -1, withscores=True),
            await client.zrange(log, 0, -1, withscores=True), await client.hgetall(meta))


async def test_hold_on_a_replica_is_readonly_and_writes_nothing(
        server: RedisServer, holding: tuple[TokenBudget, str, dict[str, str]]) -> None:
    """On a replica (a primary demoted by a failover) a confirm, a claim and both at once
    each raise LimiterUnavailable of kind READONLY, and the primary's keys are unchanged:
    the charge is still provisional, the expired one still unclaimed."""
    budget, user, nonces = holding
    before = await _hold_keys(budget.redis, user)
    await budget.redis.config_set("repl-diskless-sync-delay", "0")  # sync now, not in 5 s
    with RedisServer(extra=["--replicaof", "127.0.0.1", str(server.port)]) as replica:
        client = _client(replica.port)
        try:
            deadline = time.monotonic() + 10
            while (await client.info("replication")).get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica never synced"
                await asyncio.sleep(0.05)
            assert await budget.redis.wait(1, 5000) == 1
            out = await _hold_modes(TokenBudget(client, PLAN), user, nonces)
            assert await _hold_keys(client, user) == before  # the replica wrote nothing
        finally:
            await client.aclose()
    for name in ("confirm", "claim", "both"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "READONLY", name  # type: ignore[arg-type]
        assert "user_script" in str(out[name].__cause__), name
    assert await _hold_keys(budget.redis, user) == before


async def test_hold_out_of_memory_is_all_or_nothing(
        server: RedisServer, holding: tuple[TokenBudget, str, dict[str, str]]) -> None:
    """Under maxmemory with noeviction a claim (its first write, ZADD, would grow memory)
    raises LimiterUnavailable of kind OOM and claims nothing; a confirm (its first write,
    ZREM, frees memory, so Redis lets the script go on) is done whole, with its claim:
    never a charge confirmed and claimed, never one half claimed."""
    budget, user, nonces = holding
    before = await _hold_keys(budget.redis, user)
    await budget.redis.config_set("maxmemory-policy", "noeviction")
    await budget.redis.config_set("maxmemory", "1")
    try:
        claim = await outcomes({"claim": lambda: budget.hold(user, now_ms=T0 + 10_000)})
        after_claim = await _hold_keys(budget.redis, user)
        both = await outcomes({"both": lambda: budget.hold(
            user, "mine", nonce=nonces["mine"], now_ms=T0 + 10_000)})
    finally:
        await budget.redis.config_set("maxmemory", "0")
    refused = claim["claim"]
    assert isinstance(refused, LimiterUnavailable), refused
    assert error_kind(refused.__cause__) == "OOM"  # type: ignore[arg-type]
    assert "user_script" in str(refused.__cause__)
    assert after_claim == before  # "stale" not claimed: its score is still its hold's end
    held = both["both"]
    assert not isinstance(held, Exception), held
    assert held.confirmed is True  # type: ignore[attr-defined]
    assert [(c.request_id, c.nonce, c.cost) for c in held.claimed] == [  # type: ignore[attr-defined]
        ("stale", nonces["stale"], 3)]
    pv = user_keys(user, "pv")[0]
    assert await budget.redis.zrange(pv, 0, -1, withscores=True) == [(b"stale", -1.0)]
    # the claimer's refund (by nonce) removes the stale charge once; the confirmed stays
    assert await budget.refund(user, "stale", nonce=nonces["stale"]) is True
    assert (await budget.usage(user, now_ms=T0 + 10_000)).windows[0].used == 5


async def test_hold_on_a_busy_server_is_busy_and_writes_nothing(
        server: RedisServer, holding: tuple[TokenBudget, str, dict[str, str]]) -> None:
    """While another client's script runs past busy-reply-threshold, a confirm, a claim and
    both at once raise LimiterUnavailable of kind BUSY, and nothing changed afterwards."""
    budget, user, nonces = holding
    before = await _hold_keys(budget.redis, user)
    await budget.redis.config_set("busy-reply-threshold", "50")
    other = redis.Redis(port=server.port, socket_timeout=10)
    runner = threading.Thread(target=other.eval, args=(LONG_SCRIPT, 0, "1.0"), daemon=True)
    runner.start()
    await asyncio.sleep(0.3)
    out = await _hold_modes(budget, user, nonces)
    runner.join()
    other.close()
    for name in ("confirm", "claim", "both"):
        assert isinstance(out[name], LimiterUnavailable), (name, out[name])
        assert error_kind(out[name].__cause__) == "BUSY", name  # type: ignore[arg-type]
    assert await _hold_keys(budget.redis, user) == before


def test_a_success_whose_confirm_meets_busy_answers_charged_unknown(
        server: RedisServer, lambda_env: StartEnvironment) -> None:
    """A success whose confirm is refused BUSY (another client's long script) is answered
    503 limiter_unavailable that says the charge may still stand ("charged": "unknown"),
    since its refund is refused too; the refund is kept and made before the environment's
    next request, which alone stays charged."""
    from fastapi import Depends

    from local.lambda_events import http_event, invoke
    from tests.metered import handler, metered_app
    from usage_limits.web import require_tokens

    lambda_env({"REDIS_URL": server.url, "ATTO_BUDGET": "20/1h"}, unset=["ATTO_ENV"])
    admin = redis.Redis(port=server.port, socket_timeout=10)
    admin.config_set("busy-reply-threshold", "50")
    other = redis.Redis(port=server.port, socket_timeout=10)
    runner = threading.Thread(target=other.eval, args=(LONG_SCRIPT, 0, "1.0"), daemon=True)
    app = metered_app("busy confirm")

    @app.post("/then-busy", dependencies=[Depends(require_tokens(cost=5))])
    async def then_busy() -> dict[str, bool]:  # succeeds; Redis is busy when it answers
        runner.start()
        await asyncio.sleep(0.3)
        return {"ok": True}

    fn, user = handler(app), uuid.uuid4().hex
    try:
        res = invoke(fn, http_event("POST", "/then-busy", body={}, user=user))
        runner.join()
        assert res.status == 503, res.body
        err = res.body["error"]
        assert err["code"] == "limiter_unavailable" and err["charged"] == "unknown"
        assert "withheld" in err["message"] and "may still be charged" in err["message"]
        assert int(res.headers["retry-after"]) >= 1
        ev, pv = user_keys(user, "ev", "pv")
        [first] = admin.hkeys(ev)  # it stands, still provisional, until its kept refund
        assert admin.zscore(pv, first) is not None
        assert invoke(fn, http_event("POST", "/ok", body={}, user=user)).status == 200
        assert first not in admin.hkeys(ev)  # the kept refund ran before this request
        assert invoke(fn, http_event("GET", "/used", user=user)).body["used"] == 5
    finally:
        other.close()
        admin.close()


# ------------------------------------------------- budget_audit_read.lua (the auditor's read)


async def _audit_view(client: aioredis.Redis, user: str) -> object:
    """The auditor's one read of ``user``'s ledger and copy (``Auditor.read_ledger``)."""
    from usage_limits.entitlements.auditor import Auditor, AuditSettings

    auditor = Auditor(None, client, settings=AuditSettings())  # type: ignore[arg-type]
    return await auditor.read_ledger(user, T0 + 3)


async def test_the_auditors_read_serves_under_out_of_memory_and_on_a_replica(
        server: RedisServer, drawn: tuple[TokenBudget, str, str]) -> None:
    """The auditor's read writes nothing, so neither maxmemory with noeviction nor a
    replica refuses it: it returns the very view the primary gives (never an error the
    auditor would have to take for an outage, nor a partial view)."""
    budget, user, _ = drawn
    before = await _audit_view(budget.redis, user)
    assert before.epoch == 1 and [c.request_id for c in before.charges] == [  # type: ignore[attr-defined]
        "d1", "fill"]
    await budget.redis.config_set("maxmemory-policy", "noeviction")
    await budget.redis.config_set("maxmemory", "1")
    try:
        with pytest.raises(LimiterUnavailable, match="OOM"):  # a write is refused meanwhile
            await budget.reserve(user, "d9", 1, now_ms=T0 + 2)
        assert await _audit_view(budget.redis, user) == before
    finally:
        await budget.redis.config_set("maxmemory", "0")
    await budget.redis.config_set("repl-diskless-sync-delay", "0")
    with RedisServer(extra=["--replicaof", "127.0.0.1", str(server.port)]) as replica:
        client = _client(replica.port)
        try:
            deadline = time.monotonic() + 10
            while (await client.info("replication")).get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica never synced"
                await asyncio.sleep(0.05)
            assert await budget.redis.wait(1, 5000) == 1
            assert await _audit_view(client, user) == before
        finally:
            await client.aclose()


async def test_the_auditors_read_on_a_busy_server_is_limiter_unavailable(
        server: RedisServer, drawn: tuple[TokenBudget, str, str]) -> None:
    """While another client's script runs past busy-reply-threshold the auditor's read
    raises LimiterUnavailable of kind BUSY (the run then notes the user "not audited"),
    and reads the same view once the script is done."""
    budget, user, _ = drawn
    before = await _audit_view(budget.redis, user)
    await budget.redis.config_set("busy-reply-threshold", "50")
    other = redis.Redis(port=server.port, socket_timeout=10)
    runner = threading.Thread(target=other.eval, args=(LONG_SCRIPT, 0, "0.8"), daemon=True)
    runner.start()
    await asyncio.sleep(0.3)
    out = await outcomes({"read": lambda: _audit_view(budget.redis, user)})
    runner.join()
    other.close()
    assert isinstance(out["read"], LimiterUnavailable), out["read"]
    assert error_kind(out["read"].__cause__) == "BUSY"  # type: ignore[arg-type]
    assert await _audit_view(budget.redis, user) == before
