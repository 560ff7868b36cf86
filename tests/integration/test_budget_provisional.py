"""Provisional charges: confirmed by their request's success, else undone by the user's next
request anywhere, once their hold ended (``budget_hold.lua``, ``web.holds``).

The ledger's part runs on standalone and 3-master cluster servers of both engines; the
HTTP part serves one user from two execution environments, the first reaching Redis through
the fault proxy and never serving again after its fault, as a Lambda environment that is
not reused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from local.lambda_events import FakeContext, http_event, invoke, lambda_loop
from local.redis_servers import RedisServer
from tests.faultproxy import Fault, FaultProxy, script_sha
from tests.metered import handler, metered_app
from tests.resend import Resending
from usage_limits import TokenBudget, Window
from usage_limits._scripts import script
from usage_limits.budget import LiveGrant
from usage_limits.connection import redis_from_env
from usage_limits.keys import user_keys
from usage_limits.web import holds, idempotency, refunds, runtime, settings

T0 = 1_800_000_000_000
PLAN = [Window(100, 3600)]


# ---------------------------------------------------------------------------- the ledger


async def test_an_unconfirmed_charge_is_claimed_when_its_hold_ends(redis_client: Any,
                                                                  uid: str) -> None:
    """A held charge is not claimed before its hold ends, is claimed from then on (and can no
    longer be confirmed), and its refund by nonce clears it."""
    budget = TokenBudget(redis_client, PLAN)
    d = await budget.reserve(uid, "r1", 8, now_ms=T0, hold_ms=1_000)
    assert d.allowed and not d.duplicate
    assert (await budget.hold(uid, now_ms=T0 + 999)).claimed == ()
    held = await budget.hold(uid, now_ms=T0 + 1_000)
    assert [(c.request_id, c.nonce, c.cost, c.drew) for c in held.claimed] == [
        ("r1", d.nonce, 8, False)]
    assert (await budget.hold(uid, "r1", nonce=d.nonce, now_ms=T0 + 1_000)).confirmed is False
    assert await budget.refund(uid, "r1", nonce=d.nonce)
    assert (await budget.hold(uid, now_ms=T0 + 5_000)).claimed == ()
    assert await redis_client.zcard(user_keys(uid, "pv")[0]) == 0


async def test_a_confirmed_charge_is_never_claimed(redis_client: Any, uid: str) -> None:
    """A confirm sent twice (a lost reply) answers confirmed both times, and no later claim,
    however late, takes the charge."""
    budget = TokenBudget(redis_client, PLAN)
    twice = TokenBudget(Resending(redis_client), PLAN)
    d = await budget.reserve(uid, "r1", 8, now_ms=T0, hold_ms=1_000)
    assert (await twice.hold(uid, "r1", nonce=d.nonce, now_ms=T0 + 10)).confirmed is True
    assert (await budget.hold(uid, now_ms=T0 + 10**6)).claimed == ()
    assert (await budget.usage(uid, now_ms=T0 + 10)).windows[0].used == 8


async def test_a_resent_claim_claims_nothing_more(redis_client: Any, uid: str) -> None:
    """A claim sent twice tells the same charges both times; a foreign nonce confirms none."""
    budget = TokenBudget(redis_client, PLAN)
    resending = Resending(redis_client)
    first = await budget.reserve(uid, "a", 3, now_ms=T0, hold_ms=100)
    await budget.reserve(uid, "b", 4, now_ms=T0 + 50, hold_ms=100)
    held = await TokenBudget(resending, PLAN).hold(uid, now_ms=T0 + 120)
    assert [(c.request_id, c.cost) for c in held.claimed] == [("a", 3)]
    again = await resending.replay(resending.calls[-1])
    assert again[1:] == [b"a", first.nonce.encode(), 3, 0]
    assert (await budget.hold(uid, "b", nonce="foreign", now_ms=T0 + 120)).confirmed is False
    assert (await budget.hold(uid, "b", nonce="foreign", now_ms=T0 + 200)).claimed[-1] \
        .request_id == "b"


async def test_a_confirm_with_its_claim_run_twice_moves_nothing_more(redis_client: Any,
                                                                   uid: str) -> None:
    """A confirm that also claims (the middleware's call), with credit drawn, sent twice and
    then once more late: each run confirms the charge and tells the same claimed charge
    (drew=True), the keys are as after one run, and a claimed charge's confirm run twice
    is refused both times."""
    budget = TokenBudget(redis_client, [Window(10, 60)], entitlements=True)
    assert await budget.load_entitlements(uid, epoch=1, plan=None, suspended_until_ms=None,
                                          grants=[LiveGrant("g", 20, 20, None, "paid")])
    assert (await budget.reserve(uid, "fill", 10, now_ms=T0)).drawn == 0
    stale = await budget.reserve(uid, "stale", 3, now_ms=T0 + 1, hold_ms=100)
    mine = await budget.reserve(uid, "mine", 4, now_ms=T0 + 2, hold_ms=60_000)
    assert (stale.drawn, mine.drawn) == (3, 4)
    resending = Resending(redis_client)
    twice = TokenBudget(resending, [Window(10, 60)], entitlements=True)
    held = await twice.hold(uid, "mine", nonce=mine.nonce, now_ms=T0 + 1_000)
    assert held.confirmed is True
    assert [(c.request_id, c.nonce, c.cost, c.drew) for c in held.claimed] == [
        ("stale", stale.nonce, 3, True)]
    keys = user_keys(uid, "ev", "pv", "dr", "log", "meta", "ent")

    async def state() -> list[Any]:
        return [await redis_client.dump(k) for k in keys]

    after_one = await state()
    late = await resending.replay(resending.calls[-1])
    assert late == [1, b"stale", stale.nonce.encode(), 3, 1]
    assert await state() == after_one
    assert await redis_client.zrange(keys[1], 0, -1, withscores=True) == [(b"stale", -1.0)]
    assert (await twice.hold(uid, "stale", nonce=stale.nonce, now_ms=T0 + 1_000,
                             claim=0)).confirmed is False
    assert await state() == after_one


async def test_a_retry_after_the_claim_is_a_new_charge(redis_client: Any, uid: str) -> None:
    """Once a claimed charge is refunded, a retry of its id is charged anew (no 409), and
    a charge that is not provisional is never claimed by the id's old entry."""
    budget = TokenBudget(redis_client, PLAN)
    d = await budget.reserve(uid, "k", 8, now_ms=T0, hold_ms=100)
    [claimed] = (await budget.hold(uid, now_ms=T0 + 100)).claimed
    again = await budget.reserve(uid, "k", 8, now_ms=T0 + 101)
    assert again.duplicate  # still charged: the claimer has not refunded yet
    assert await budget.refund(uid, "k", nonce=claimed.nonce)
    retry = await budget.reserve(uid, "k", 8, now_ms=T0 + 102)
    assert retry.allowed and not retry.duplicate and retry.nonce != d.nonce
    assert (await budget.hold(uid, now_ms=T0 + 10**6)).claimed == ()


async def test_pv_lives_as_long_as_the_charge_counts(redis_client: Any, uid: str) -> None:
    """The provisional index expires no sooner than the log, so a charge never outlives its
    entry."""
    budget = TokenBudget(redis_client, PLAN)
    await budget.reserve(uid, "r", 1, hold_ms=35_000)
    log, pv = user_keys(uid, "log", "pv")
    assert await redis_client.pttl(pv) >= await redis_client.pttl(log) > 0


# ---------------------------------------------------------------------------- over HTTP

RESERVE = script_sha(script("budget_reserve").sha)
REFUND = script_sha(script("budget_refund").sha)
HOLD = script_sha(script("budget_hold").sha)
TIMEOUT_S = 1.0  # the function's timeout: a charge's hold ends this long after it is made


class Rig:
    """Two execution environments of one function; the first reaches Redis through the
    fault proxy. Each keeps its own pending refunds."""

    def __init__(self, app: Any, proxy: FaultProxy, redis_url: str) -> None:
        self.handler = handler(app)
        self.proxy = proxy
        self.redis_url = redis_url
        self.clients = {"faulty": redis_from_env(url=proxy.url, retries=1, socket_timeout_s=0.25),
                        "direct": redis_from_env(url=redis_url, retries=1, socket_timeout_s=2.0)}
        self.pending: dict[str, list[Any]] = {"faulty": [], "direct": []}
        self.current: str | None = None

    def call(self, env: str, method: str, path: str, *, timeout_s: float = TIMEOUT_S,
             **kwargs: Any) -> Any:
        """Serve one request in ``env`` (a Lambda invocation with a ``timeout_s`` timeout)."""
        if self.current != env:
            if self.current is not None:
                self.pending[self.current] = list(refunds._pending)
            refunds._pending[:] = self.pending[env]
            runtime.set_redis(self.clients[env])
            self.current = env
        return invoke(self.handler, http_event(method, path, **kwargs),
                      FakeContext(timeout_s=timeout_s))

    def used(self, user: str) -> int:
        return int(self.call("direct", "GET", "/used", user=user).body["used"])

    def after_the_hold(self, timeout_s: float = TIMEOUT_S) -> None:
        """Wait until every charge made so far (with at most ``timeout_s``) is past its hold."""
        time.sleep(timeout_s + holds.HOLD_MARGIN_S + 0.05)


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer,
        fault_proxy: FaultProxy, stored_answers: str) -> Iterator[Rig]:
    """The two environments, as production configures their clients (one retry)."""
    monkeypatch.setenv("REDIS_URL", redis_server.url)
    monkeypatch.setenv("ATTO_BUDGET", "20/1h")
    monkeypatch.delenv("ATTO_ENV", raising=False)
    monkeypatch.setattr(holds, "HOLD_MARGIN_S", 0.1)
    settings.cache_clear()
    idempotency.reset()
    with lambda_loop():
        yield Rig(metered_app("provisional charges"), fault_proxy, redis_server.url)
    runtime.set_redis(None)
    settings.cache_clear()
    idempotency.reset()
    refunds.clear()


def test_a_lost_reservation_reply_blocks_a_retry_only_until_the_hold_ends(rig: Rig) -> None:
    """A reservation that charged but lost its replies answers "may have been charged"; a
    retry of the key elsewhere gets 409 until the hold ends, then is served, and the user
    pays once, though the first environment never serves again."""
    user, key = uuid.uuid4().hex, {"Idempotency-Key": uuid.uuid4().hex}
    rig.proxy.inject(Fault.DROP_REPLY, match=RESERVE, times=2)
    # a 3 s hold: the retry below comes well before its end, however busy the machine
    first = rig.call("faulty", "POST", "/ok", body={}, user=user, headers=key, timeout_s=3.0)
    assert first.status == 503 and first.body["error"]["charged"] == "unknown"
    assert rig.used(user) == 5
    early = rig.call("direct", "POST", "/ok", body={}, user=user, headers=key)
    assert early.status == 409
    rig.after_the_hold(3.0)
    retried = rig.call("direct", "POST", "/ok", body={}, user=user, headers=key)
    assert retried.status == 200 and rig.used(user) == 5
    replay = rig.call("direct", "POST", "/ok", body={}, user=user, headers=key)
    assert replay.status == 200 and replay.headers.get("idempotent-replayed") == "true"
    assert rig.used(user) == 5


def test_a_lost_refund_is_made_by_the_users_next_request_elsewhere(rig: Rig) -> None:
    """A failed request whose refund never reached Redis stays charged only until the hold
    ends: the user's next request, in another environment, refunds it."""
    user = uuid.uuid4().hex
    rig.proxy.inject(Fault.DROP_COMMAND, match=REFUND, times=2)
    failed = rig.call("faulty", "POST", "/fails", body={}, user=user)
    assert failed.status == 502 and failed.body["error"]["charged"] == "unknown"
    assert rig.used(user) == 5
    rig.after_the_hold()
    assert rig.call("direct", "POST", "/ok", body={}, user=user).status == 200
    assert rig.used(user) == 5  # the new request's charge only


def test_a_refused_request_first_undoes_expired_charges(rig: Rig) -> None:
    """A request the budget would refuse only because of unconfirmed expired charges is
    served once they are undone."""
    user = uuid.uuid4().hex
    rig.proxy.inject(Fault.DROP_COMMAND, match=REFUND, times=1000)  # kept ones too
    for _ in range(4):  # 4 x 5 = the whole 20/1h budget, every refund lost
        assert rig.call("faulty", "POST", "/fails", body={}, user=user).status == 502
    assert rig.used(user) == 20
    rig.after_the_hold()
    assert rig.call("direct", "POST", "/ok", body={}, user=user).status == 200
    assert rig.used(user) == 5


@pytest.mark.parametrize("fault", [Fault.DROP_COMMAND, Fault.DROP_REPLY])
def test_a_success_whose_confirm_is_lost_is_answered_503_and_refunded(rig: Rig,
                                                                       fault: Fault) -> None:
    """When a success's confirm gets no answer (it never ran, or ran and lost its replies),
    the answer is withheld: 503, the charge refunded, and a retry of the key is served."""
    user, key = uuid.uuid4().hex, {"Idempotency-Key": uuid.uuid4().hex}
    rig.proxy.inject(fault, match=HOLD, times=2)
    # time enough after the lost confirm (two socket timeouts) for the refund, under load
    first = rig.call("faulty", "POST", "/ok", body={}, user=user, headers=key, timeout_s=5.0)
    assert first.status == 503 and first.body["error"]["code"] == "limiter_unavailable"
    assert "withheld" in first.body["error"]["message"]
    assert "charged" not in first.body["error"]  # the refund landed: nothing charged
    assert rig.used(user) == 0
    retried = rig.call("direct", "POST", "/ok", body={}, user=user, headers=key)
    assert retried.status == 200 and rig.used(user) == 5


def test_a_success_is_confirmed_and_stays_charged(rig: Rig) -> None:
    """A served request's charge is confirmed: no later request of the user undoes it."""
    user = uuid.uuid4().hex
    assert rig.call("faulty", "POST", "/ok", body={}, user=user).status == 200
    rig.after_the_hold()
    assert rig.call("direct", "POST", "/ok", body={}, user=user).status == 200
    assert rig.used(user) == 10
    assert redis.Redis.from_url(rig.redis_url).zcard(user_keys(user, "pv")[0]) == 0
