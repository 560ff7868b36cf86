"""Paid credit exact across Redis and DynamoDB: the scenarios of an adversarial trial, each
through the real handlers (real Redis on both topologies, moto DynamoDB, the emulator).

Plan ``free`` has a 30-day quota of 4 tokens; each embeddings request costs 1 token, so
from the fifth request on every charge draws from the user's grants. After every scenario,
for every grant: consumed = the sum of its charge records, and the credit the user sees is
DynamoDB's.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from local.emulator import EmulatorProcess
from local.lambda_events import http_event, invoke
from tests.integration.test_entitlements_hotpath import (  # noqa: F401  (env: a fixture)
    admin,
    consumed,
    embed,
    embed_one,
    env,
    grant,
    op,
    remaining,
    store,
    usage,
)
from usage_limits.entitlements import StoreUnavailable
from usage_limits.web import runtime


@pytest.fixture
def patch() -> Any:
    """A MonkeyPatch of the test's own: undoing it leaves the environment's settings."""
    with pytest.MonkeyPatch.context() as mp:
        yield mp


class Down:
    """A store that answers nothing: every call raises StoreUnavailable, after running the
    real call for the names in ``applied`` (a write that landed, its answer lost)."""

    def __init__(self, applied: dict[str, Any] | None = None) -> None:
        self.applied = applied or {}

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            if name in self.applied:
                self.applied[name](*args, **kwargs)
            raise StoreUnavailable("unreachable")
        return fail


def books_balance(user: str) -> None:
    """Every grant's consumed is what its charge records hold, and the user's copy shows
    DynamoDB's remaining credit."""
    held: dict[str, int] = {}
    for record in store().charge_records(user):
        for reference, tokens in record.consumed.items():
            held[reference] = held.get(reference, 0) + tokens
    truth = {g.reference: g for g in store().load(user).grants}
    for reference, g in truth.items():
        assert g.consumed == held.get(reference, 0), (reference, g.consumed, held)
    live = {r: g.tokens - g.consumed for r, g in truth.items() if g.voided is None}
    assert remaining(user) == live


def fill_quota(user: str) -> None:
    assert embed(user, 4) == [200] * 4


def charge_ids(user: str) -> list[str]:
    """The request ids of the user's charges that drew credit, oldest first."""
    return [r.request_id for r in sorted(store().charge_records(user), key=lambda r: r.at_ms)
            if r.draws]


def fail_once(patch: pytest.MonkeyPatch) -> None:
    """The next embeddings call fails upstream (a 502 for the request, refunded)."""
    from atto_providers import llm
    from usage_limits.web.errors import ProviderError

    async def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ProviderError("the llm provider failed")

    patch.setattr(llm.LLMClient, "embed", failing)


def support_refund(user: str, request_id: str) -> Any:
    event = http_event("POST", f"/admin/v1/users/{user}/refunds", user=None,
                       body={"request_id": request_id, "reason": "support"})
    event["requestContext"]["authorizer"] = {"iam": {"userArn": "arn:aws:iam::1:user/jane"}}
    return invoke(admin.handler, event)


def test_support_refunds_after_a_reload_give_back_exactly_what_was_drawn(env: Any) -> None:
    """Two charges drawn from a grant, each support-refunded (every operator change reloads
    the copy): both give their credit back, in DynamoDB and in what the user sees."""
    user = uuid.uuid4().hex
    grant(user, "inv", 100)
    fill_quota(user)
    assert embed(user, 2) == [200, 200]
    first, second = charge_ids(user)
    for rid in (first, second):
        res = support_refund(user, rid)
        assert res.status == 201, res.body
        assert res.body["refund"]["tokens"] == 1
    assert consumed(user) == {"inv": 0} and remaining(user) == {"inv": 100}
    assert support_refund(user, first).status == 200  # once only
    assert consumed(user) == {"inv": 0}
    books_balance(user)


def test_a_support_refund_after_flushall_finds_the_draw_in_dynamodb(env: Any) -> None:
    """After the cache lost everything, a charge that drew credit is still found through its
    record, and its credit comes back."""
    user = uuid.uuid4().hex
    grant(user, "inv", 10)
    fill_quota(user)
    assert embed(user, 1) == [200]
    [rid] = charge_ids(user)
    env.flushall()
    res = support_refund(user, rid)
    assert res.status == 201, res.body
    assert consumed(user) == {"inv": 0} and remaining(user) == {"inv": 10}
    books_balance(user)


def test_a_support_refund_gives_the_quota_window_its_part_back(env: Any) -> None:
    """A charge covered partly by the quota and partly by credit, support-refunded, gives
    the quota its part and the grant its part."""
    user = uuid.uuid4().hex
    op("PUT", f"/admin/v1/users/{user}/plan", {"plan": "team", "reason": "test"})  # quota 20
    grant(user, "inv", 30)
    assert embed(user, 4) == [200] * 4
    res = invoke(importlib_research().handler, http_event(
        "POST", "/v1/company-research", body={"company": "Acme"}, user=user))
    assert res.status == 200, res.body  # 20 tokens: 16 from the quota, 4 from "inv"
    [rid] = charge_ids(user)
    assert consumed(user) == {"inv": 4}
    assert support_refund(user, rid).status == 201
    assert consumed(user) == {"inv": 0}
    assert [w["used"] for w in usage(user).body["windows"]] == [4, 4]
    books_balance(user)


def importlib_research() -> Any:
    import importlib

    return importlib.import_module("functions.company_research.app")


def test_a_support_refund_finds_a_charge_far_back_in_the_log(env: Any) -> None:
    """A charge more than a thousand events back is still found by its id."""
    user = uuid.uuid4().hex
    op("PUT", f"/admin/v1/users/{user}/plan", {"plan": "pro", "reason": "test"})
    assert embed(user, 1) == [200]
    [event] = usage(user).body["events"]
    import os

    from redis.asyncio import Redis, RedisCluster

    from usage_limits.budget import TokenBudget, Window

    async def pad() -> None:
        url = os.environ["REDIS_URL"]
        client: Any = (RedisCluster.from_url(url) if os.environ["REDIS_CLUSTER"] == "true"
                       else Redis.from_url(url))
        budget = TokenBudget(client, [Window(100000, 3600)])
        try:
            for i in range(1001):
                await budget.reserve(user, f"pad-{i}", 1)
        finally:
            await client.aclose()

    loop = asyncio.new_event_loop()  # not asyncio.run: the handlers keep their own loop
    try:
        loop.run_until_complete(pad())
    finally:
        loop.close()
    res = support_refund(user, event["request_id"])
    assert res.status == 201, res.body


def test_a_failed_request_returns_its_draw_though_an_operator_change_landed(
        env: Any, emulator: EmulatorProcess, patch: pytest.MonkeyPatch) -> None:
    """A request that drew credit and then failed, while an operator change reloaded the
    user's copy, gets its credit back in DynamoDB and in the copy."""
    user = uuid.uuid4().hex
    grant(user, "inv", 100)
    fill_quota(user)
    cache = runtime.get_entitlements()
    assert cache is not None
    real = cache.commit_draw

    async def then_change(budget: Any, *args: Any, **kwargs: Any) -> Any:
        state = await real(budget, *args, **kwargs)
        # an operator change lands while the provider is called: committed, then reloaded
        await asyncio.to_thread(store().set_override, user, "free", actor="op",
                                reason="mid-request")
        await cache.refresh(budget, user)
        return state

    patch.setattr(cache, "commit_draw", then_change)
    fail_once(patch)
    assert embed_one(user).status == 502
    patch.undo()
    assert consumed(user) == {"inv": 0} and remaining(user) == {"inv": 100}
    books_balance(user)


def test_a_draw_applied_whose_answer_was_lost_is_served_once(
        env: Any, emulator: EmulatorProcess, patch: pytest.MonkeyPatch) -> None:
    """The draw's transaction landed but every answer was lost: the record is read before
    the request answers, the request is served, and the draw counts once."""
    user = uuid.uuid4().hex
    grant(user, "inv", 100)
    fill_quota(user)
    cache = runtime.get_entitlements()
    assert cache is not None
    real = cache.store.commit_draw

    def applied_then_lost(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise StoreUnavailable("read timeout")

    patch.setattr(cache.store, "commit_draw", applied_then_lost)
    assert embed_one(user).status == 200
    patch.undo()
    assert consumed(user) == {"inv": 1} and remaining(user) == {"inv": 99}
    books_balance(user)


def test_a_draw_whose_outcome_cannot_be_known_never_says_nothing_was_charged(
        env: Any, emulator: EmulatorProcess, patch: pytest.MonkeyPatch) -> None:
    """DynamoDB applied the draw and then stopped answering: the answer is 503 "may have
    been charged"; once DynamoDB answers again, the kept refund returns the credit."""
    user = uuid.uuid4().hex
    grant(user, "inv", 100)
    fill_quota(user)
    cache = runtime.get_entitlements()
    assert cache is not None
    good = cache.store
    real = good.commit_draw

    cache.store = Down(applied={"commit_draw": real})  # type: ignore[assignment]
    try:
        res = embed_one(user)
    finally:
        cache.store = good
    assert res.status == 503 and "may have been charged" in res.body["error"]["message"]
    assert consumed(user) == {"inv": 1}  # the draw stands until the kept refund lands
    served = serve_until_kept_refunds_land(user)
    assert consumed(user) == {"inv": served} and remaining(user) == {"inv": 100 - served}
    books_balance(user)


def serve_until_kept_refunds_land(user: str, most: int = 20) -> int:
    """Serve ``user`` one request at a time until this environment keeps no refund (each
    request first tries the kept ones, each within its bound, which a busy machine's local
    DynamoDB can outrun): how many requests were served, each drawing 1 credit."""
    from usage_limits.web import refunds

    for served in range(1, most + 1):
        assert embed(user, 1) == [200]
        if not refunds.pending():
            return served
    raise AssertionError(f"the kept refunds did not land within {most} requests")


def test_a_lost_refund_reply_returns_the_credit_in_dynamodb_exactly_once(
        env: Any, emulator: EmulatorProcess, patch: pytest.MonkeyPatch) -> None:
    """A failed request's refund whose Redis reply is lost (and re-sent by the kept refund)
    gives the credit back once in DynamoDB; the copy never holds more than DynamoDB."""
    from usage_limits import budget as budget_module
    from usage_limits.exceptions import LimiterUnavailable

    user = uuid.uuid4().hex
    grant(user, "inv", 16)
    fill_quota(user)
    real = budget_module.TokenBudget.lower
    lost = {"n": 0}

    async def reply_lost(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = await real(self, *args, **kwargs)
        if lost["n"] == 0:
            lost["n"] += 1
            raise LimiterUnavailable("reply lost")
        return result

    patch.setattr(budget_module.TokenBudget, "lower", reply_lost)
    fail_once(patch)
    assert embed_one(user).status == 502
    patch.undo()
    statuses = [embed_one(user) for _ in range(16)]
    assert [r.status for r in statuses] == [200] * 16, statuses[0].body  # 16 of credit
    assert consumed(user) == {"inv": 16}
    assert embed_one(user).status == 429
    books_balance(user)


def test_a_load_spanning_a_cache_loss_never_installs_an_older_copy(
        env: Any, patch: pytest.MonkeyPatch) -> None:
    """A load that read DynamoDB before a suspension, and writes after the suspension's
    invalidation was lost with the cache, is refused: the suspended user is not served."""
    user = uuid.uuid4().hex
    grant(user, "inv", 10)
    cache = runtime.get_entitlements()
    assert cache is not None
    real_load = cache.store.load

    def suspended_meanwhile(user_id: str) -> Any:
        record = real_load(user_id)  # the load's read, before the operator's change
        # the operator's suspension commits and takes its epoch; its invalidation of the
        # copy is then lost with the cache
        store().suspend(user, reason="fraud", until_ms=None, actor="op")
        store().bump_epoch(user)
        env.flushall()
        return record

    patch.setattr(cache.store, "load", suspended_meanwhile)
    first = embed_one(user)
    patch.undo()
    assert first.status in (403, 503)
    assert [r.status for r in [embed_one(user) for _ in range(3)]] == [403] * 3


def test_a_suspended_user_gets_no_replay_while_dynamodb_is_down(env: Any) -> None:
    """A keyed answer stored before the suspension is not replayed when the user's copy is
    gone and DynamoDB cannot be read: 503, never the stored 200."""
    user = uuid.uuid4().hex
    key = {"Idempotency-Key": "replay-" + user}
    first = embed_one(user, headers=key)
    assert first.status == 200
    op("PUT", f"/admin/v1/users/{user}/suspension", {"reason": "fraud"})
    cache = runtime.get_entitlements()
    assert cache is not None
    good = cache.store

    cache.store = Down()  # type: ignore[assignment]
    try:
        res = embed_one(user, headers=key)
    finally:
        cache.store = good
    assert res.status in (403, 503) and "idempotent-replayed" not in {
        k.lower() for k in res.headers}


def test_credit_low_is_reported_once_across_a_reload(env: Any,
                                                    patch: pytest.MonkeyPatch) -> None:
    """The low-credit report of a grant is made once, however often the copy reloads."""
    from usage_limits.web import events

    sent: list[str] = []
    real = events.credit_events

    def record(user_id: str, plan_name: str, crossings: Any, **kwargs: Any) -> Any:
        sent.extend(c.kind for c in crossings)
        return real(user_id, plan_name, crossings, **kwargs)

    patch.setattr(events, "credit_events", record)
    user = uuid.uuid4().hex
    grant(user, "inv", 5)
    fill_quota(user)
    assert embed(user, 4) == [200] * 4  # 1 left of 5: low (20%) crossed
    assert sent == ["low"]
    env.flushall()
    op("PUT", f"/admin/v1/users/{user}/plan", {"plan": "free", "reason": "reload"})
    fill_quota(user)  # the windows were lost with the cache
    assert embed(user, 1) == [200]  # exhausted now: one more report, never a second low
    assert sent == ["low", "exhausted"]
    books_balance(user)


def test_a_draw_crossing_low_and_exhausted_at_once_keeps_both(env: Any) -> None:
    """A draw that takes a grant from full to empty reports low and exhausted, and both are
    kept with the grant in DynamoDB, so a reload reports neither again."""
    user = uuid.uuid4().hex
    grant(user, "one", 1)
    fill_quota(user)
    assert embed(user, 1) == [200]
    [g] = store().load(user).grants
    assert (g.consumed, g.reported) == (1, "lx")
    books_balance(user)


def test_a_lost_refund_of_a_draw_is_returned_in_dynamodb_by_the_users_next_request(
        env: Any, emulator: EmulatorProcess, patch: pytest.MonkeyPatch) -> None:
    """A failed request that drew credit, whose refund never reached Redis and whose
    environment never serves again, gets its credit back through DynamoDB first at the
    user's next request after its hold; the books balance and nothing comes back twice."""
    import time

    from usage_limits import budget as budget_module
    from usage_limits.exceptions import LimiterUnavailable
    from usage_limits.web import holds, refunds

    user = uuid.uuid4().hex
    grant(user, "inv", 16)
    fill_quota(user)
    patch.setattr(holds, "hold_ms", lambda remaining_ms: 300)  # a short hold, for the test

    async def lost(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise LimiterUnavailable("the refund never reached Redis")

    patch.setattr(budget_module.TokenBudget, "lower", lost)
    fail_once(patch)
    assert embed_one(user).status == 502
    refunds.clear()  # that environment never serves again
    patch.undo()
    patch.setattr(holds, "hold_ms", lambda remaining_ms: 300)
    assert consumed(user) == {"inv": 0}  # DynamoDB gave it back first; the ledger did not
    time.sleep(0.4)
    assert embed_one(user).status == 200  # its confirm claims the expired charge
    assert consumed(user) == {"inv": 1}  # the new draw only: nothing returned twice
    assert remaining(user) == {"inv": 15}
    books_balance(user)
    assert embed(user, 15) == [200] * 15 and embed_one(user).status == 429  # 16 in all
    books_balance(user)
