"""Plan overrides, grants and suspensions on the request path, through the real handlers.

Real Redis (standalone, then the 3-node cluster), moto DynamoDB, the emulator as the
providers; operator changes go through the admin function's handler. The plan ``free``
has a small 30-day quota (4 tokens) under a larger hourly window, so what the quota does
not cover is drawn from grants while the hourly window still applies.
"""

from __future__ import annotations

import asyncio
import importlib
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import http_sf
import pytest
import redis
from atto_cloud_client.ratelimit import RateLimitStatus
from moto import mock_aws

from local.emulator import EmulatorProcess
from local.lambda_events import http_event, invoke
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore
from usage_limits.web import runtime

if TYPE_CHECKING:
    from local.lambda_events import Result
    from tests.conftest import StartEnvironment

admin = importlib.import_module("functions.admin.app")
usage_fn = importlib.import_module("functions.usage.app")
embeddings = importlib.import_module("functions.embeddings.app")
research = importlib.import_module("functions.company_research.app")
OPERATOR = "arn:aws:sts::123456789012:assumed-role/atto-operators/jane"
PLANS = "free=40/1h,4/30d;pro=60/1h,2000/30d;team=100/1h,20/30d;mini=5/1h,100/30d"
TABLE = "entitlements-hotpath"


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def env(request: pytest.FixtureRequest, lambda_env: StartEnvironment,
        emulator: EmulatorProcess) -> Iterator[Any]:
    """A Lambda environment over real Redis (standalone, then cluster), a moto table and
    the emulator; yields a plain Redis client of the same server (for FLUSHALL)."""
    cluster = request.param == "cluster"
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    emulator.reset()
    with mock_aws():
        lambda_env({"REDIS_URL": server.url, "LLM_BASE_URL": emulator.openai_base_url,
                    "LLM_API_KEY": "test-key", "LLM_RATE": "1000/s",
                    "SEARCH_BASE_URL": emulator.tavily_base_url, "SEARCH_API_KEY": "k",
                    "SEARCH_RATE": "1000/s",
                    "REDIS_CLUSTER": "true" if cluster else "false",
                    "ATTO_PLANS": PLANS, "ATTO_DEFAULT_PLAN": "free",
                    "ATTO_PLAN_CLAIM": "cognito:groups", "ATTO_ENTITLEMENTS_TABLE": TABLE,
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing"},
                   unset=("ATTO_ENV", "ATTO_DYNAMODB_ENDPOINT", "ATTO_BUDGET", "AWS_PROFILE",
                          "LLM_SECRET_ARN", "SEARCH_SECRET_ARN", "LLM_BURST",
                          "LLM_CONCURRENCY", "SEARCH_BURST", "SEARCH_CONCURRENCY"))
        EntitlementStore(StoreSettings(table=TABLE, region="us-east-1")).create_table()
        plain: Any = (redis.RedisCluster(host="127.0.0.1", port=server.startup_nodes[0][1])
                      if cluster else redis.Redis(host="127.0.0.1", port=server.port))
        try:
            yield plain
        finally:
            plain.close()


def store() -> EntitlementStore:
    return EntitlementStore(StoreSettings(table=TABLE, region="us-east-1"))


def op(method: str, path: str, body: Any = None) -> Result:
    """An operator call through the admin function, signed as an IAM principal."""
    event = http_event(method, path, body=body, user=None)
    event["requestContext"]["authorizer"] = {"iam": {"userArn": OPERATOR}}
    result = invoke(admin.handler, event)
    assert result.status < 300, result.body
    return result


def grant(user: str, reference: str, tokens: int, kind: str = "paid",
          expires_at: datetime | None = None) -> Result:
    body: dict[str, Any] = {"tokens": tokens, "kind": kind, "reference": reference,
                            "reason": "test"}
    if expires_at is not None:
        body["expires_at"] = expires_at.isoformat()
    return op("POST", f"/admin/v1/users/{user}/grants", body)


def _claims(event: dict[str, Any], groups: str | None) -> dict[str, Any]:
    if groups is not None:
        event["requestContext"]["authorizer"]["jwt"]["claims"]["cognito:groups"] = groups
    return event


def embed(user: str, n: int = 1, groups: str | None = None) -> list[int]:
    """``n`` embeddings requests of 1 token each; their statuses."""
    return [invoke(embeddings.handler, _claims(http_event(
        "POST", "/v1/embeddings", body={"input": ["x"]}, user=user), groups)).status
        for _ in range(n)]


def embed_one(user: str, **kwargs: Any) -> Result:
    return invoke(embeddings.handler, http_event("POST", "/v1/embeddings",
                                                 body={"input": ["x"]}, user=user, **kwargs))


def usage(user: str, groups: str | None = None) -> Result:
    return invoke(usage_fn.handler, _claims(http_event("GET", "/v1/usage", user=user), groups))


def remaining(user: str) -> dict[str, int]:
    """Each live grant's remaining credit, as GET /v1/usage shows it."""
    return {g["reference"]: g["remaining"] for g in usage(user).body["grants"]}


def consumed(user: str) -> dict[str, int]:
    """Each grant's consumed credit, as DynamoDB records it."""
    return {g.reference: g.consumed for g in store().load(user).grants}


def llm_calls(emulator: EmulatorProcess) -> int:
    return int(emulator.family_stats("llm")["arrivals"])


def test_plan_resolution_override_claim_default_and_unknown_claim(env: Any) -> None:
    """An operator's override beats the claim (RateLimit-Policy and /v1/usage show it by
    name); cleared, the claim applies; an unknown claim falls back to the default."""
    user = uuid.uuid4().hex
    assert usage(user, "[pro]").body["plan"] == "pro"
    op("PUT", f"/admin/v1/users/{user}/plan", {"plan": "pro", "reason": "contract"})
    for groups in ("[free]", "[platinum]", None):
        body = usage(user, groups).body
        assert body["plan"] == "pro" and [w["limit"] for w in body["windows"]] == [60, 2000]
    res = invoke(embeddings.handler, _claims(http_event(
        "POST", "/v1/embeddings", body={"input": ["x"]}, user=user), "[free]"))
    assert res.status == 200
    assert res.headers["ratelimit-policy"] == ('"1h";q=60;w=3600;atto-qu="tokens", '
                                                 '"30d";q=2000;w=2592000;atto-qu="tokens"')
    op("DELETE", f"/admin/v1/users/{user}/plan", {"reason": "ended"})
    assert usage(user, "[free]").body["plan"] == "free"
    assert usage(user, "[platinum]").body["plan"] == "free"
    assert usage(user, "[pro]").body["plan"] == "pro"


def test_override_change_mid_window_keeps_totals_exact(env: Any) -> None:
    """Spending under free, then under an override to pro, then free again counts every
    charge once in every window."""
    user = uuid.uuid4().hex
    assert embed(user, 5) == [200] * 4 + [429]  # free: 4 in 30 days, no credit
    op("PUT", f"/admin/v1/users/{user}/plan", {"plan": "pro", "reason": "upgrade"})
    assert embed(user, 3) == [200] * 3
    op("DELETE", f"/admin/v1/users/{user}/plan", {"reason": "downgrade"})
    assert embed(user, 1) == [429]
    body = usage(user, "[pro]").body
    assert [(w["limit"], w["used"]) for w in body["windows"]] == [(60, 7), (2000, 7)]


def test_grants_are_drawn_in_order_and_the_rejection_carries_the_credit(env: Any) -> None:
    """Past the quota, credit comes from the earliest expiry first, promo before paid at
    equal expiry, never-expiring grants last; each spend event says which grant paid, and
    DynamoDB records the same consumption; with no credit left the 429 says credit 0."""
    user = uuid.uuid4().hex
    soon = datetime.now(UTC) + timedelta(days=1)
    later = soon + timedelta(days=1)
    grant(user, "paid-later", 2, "paid", later)
    grant(user, "forever", 3, "paid")
    grant(user, "promo-later", 2, "promo", later)
    grant(user, "paid-soon", 1, "paid", soon)
    assert [g["reference"] for g in usage(user).body["grants"]] == \
        ["paid-soon", "promo-later", "paid-later", "forever"]
    assert embed(user, 4) == [200] * 4  # the quota
    assert usage(user).body["credit"] == 8
    assert embed(user, 8) == [200] * 8
    events = usage(user).body["events"]
    assert [e["draws"] for e in reversed(events)][4:] == [
        [{"reference": r, "tokens": 1}] for r in
        ["paid-soon", "promo-later", "promo-later", "paid-later", "paid-later",
         "forever", "forever", "forever"]]
    assert all(e["draws"] == [] for e in events[8:])
    assert consumed(user) == {"paid-later": 2, "forever": 3, "promo-later": 2, "paid-soon": 1}
    rejected = embed_one(user)
    assert rejected.status == 429 and rejected.body["error"]["credit"] == 0
    picture = op("GET", f"/admin/v1/users/{user}").body
    assert picture["credit"] == 0 and all(not g["live"] for g in picture["grants"])


def test_a_grant_that_expires_mid_window_stops_covering(env: Any) -> None:
    """A grant covers requests until its expiry and nothing after it."""
    user = uuid.uuid4().hex
    grant(user, "short", 100, "promo", datetime.now(UTC) + timedelta(seconds=3))
    assert embed(user, 5) == [200] * 5
    assert remaining(user) == {"short": 99}
    time.sleep(3.2)
    res = embed_one(user)
    assert res.status == 429 and res.body["error"]["credit"] == 0
    assert remaining(user) == {}


def test_a_failed_request_gives_its_credit_back_in_redis_and_dynamodb(
        env: Any, emulator: EmulatorProcess) -> None:
    """A request that drew credit and then failed upstream (502) gives the credit back to
    its grant, in the cache and in the durable record."""
    user = uuid.uuid4().hex
    grant(user, "inv", 10)
    assert embed(user, 5) == [200] * 5
    assert remaining(user) == {"inv": 9} and consumed(user) == {"inv": 1}
    emulator.fail_next(5, 500, family="llm")
    assert embed_one(user).status == 502
    assert remaining(user) == {"inv": 9} and consumed(user) == {"inv": 1}
    assert [w["used"] for w in usage(user).body["windows"]] == [5, 4]


def test_settle_gives_the_unused_credit_back(env: Any, monkeypatch: pytest.MonkeyPatch,
                                             emulator: EmulatorProcess) -> None:
    """A charge of 20 that drew 4 from credit, settled to 5, gives the 4 back to the grant
    first, in the cache and in DynamoDB (the lowering takes the drawn part first)."""
    from atto_providers import search

    async def nothing(self: Any, query: str, **kwargs: Any) -> list[Any]:
        return []

    monkeypatch.setattr(search.SearchClient, "search", nothing)
    user = uuid.uuid4().hex
    op("PUT", f"/admin/v1/users/{user}/plan", {"plan": "team", "reason": "test"})  # quota 20
    grant(user, "inv", 30)
    assert embed(user, 4) == [200] * 4
    res = invoke(research.handler, http_event("POST", "/v1/company-research",
                                              body={"company": "Nobody Inc"}, user=user))
    assert res.status == 200, res.body  # 20 tokens: 16 from the quota, 4 from "inv"
    assert remaining(user) == {"inv": 30} and consumed(user) == {"inv": 0}
    [event] = [e for e in usage(user).body["events"] if e["route"] == "/v1/company-research"]
    assert event["cost"] == 5 and event["draws"] == []
    assert [w["used"] for w in usage(user).body["windows"]] == [9, 9]
    [record] = store().charge_records(user)
    assert (record.cost, record.kept, record.draws, record.returned, record.state) == (
        20, 5, (("inv", 4),), (("inv", 4),), "lowered")


def test_grant_creation_is_idempotent_and_voiding_stops_draws(env: Any) -> None:
    """The same reference twice adds credit once (other terms: 409 showing both); a voided
    grant covers nothing more."""
    user = uuid.uuid4().hex
    assert grant(user, "inv", 3).status == 201
    assert grant(user, "inv", 3).status == 200
    event = http_event("POST", f"/admin/v1/users/{user}/grants", user=None, body={
        "tokens": 300, "kind": "paid", "reference": "inv", "reason": "test"})
    event["requestContext"]["authorizer"] = {"iam": {"userArn": OPERATOR}}
    conflict = invoke(admin.handler, event)
    assert conflict.status == 409 and conflict.body["error"]["code"] == "grant_conflict"
    assert (conflict.body["error"]["existing"]["tokens"],
            conflict.body["error"]["asked"]["tokens"]) == (3, 300)
    assert embed(user, 6) == [200] * 6
    assert remaining(user) == {"inv": 1}
    op("DELETE", f"/admin/v1/users/{user}/grants/inv", {"reason": "charge-back"})
    res = embed_one(user)
    assert res.status == 429 and res.body["error"]["credit"] == 0
    assert consumed(user) == {"inv": 2}


def test_suspension_refuses_every_route_and_lifting_restores_service(
        env: Any, emulator: EmulatorProcess) -> None:
    """Suspended, metered and free routes answer 403 account_suspended (with its end),
    nothing is charged and no provider is called; lifted, the next request is served."""
    user = uuid.uuid4().hex
    assert embed(user, 1) == [200]
    until = "2099-01-01T00:00:00Z"
    op("PUT", f"/admin/v1/users/{user}/suspension", {"reason": "card testing",
                                                     "until": until})
    calls = llm_calls(emulator)
    metered = embed_one(user)
    assert metered.status == 403
    assert metered.body["error"]["code"] == "account_suspended"
    assert metered.body["error"]["until"] == "2099-01-01T00:00:00.000Z"
    assert "card testing" not in str(metered.body)
    free = usage(user)
    assert free.status == 403 and free.body["error"]["code"] == "account_suspended"
    assert llm_calls(emulator) == calls
    op("DELETE", f"/admin/v1/users/{user}/suspension", {"reason": "appeal"})
    body = usage(user).body
    assert [w["used"] for w in body["windows"]] == [1, 1]
    assert embed(user, 1) == [200]
    op("PUT", f"/admin/v1/users/{user}/suspension", {"reason": "again"})
    refused = embed_one(user)
    assert refused.status == 403 and refused.body["error"]["until"] is None


def test_flushall_mid_run_reloads_balances_from_dynamodb(env: Any) -> None:
    """After FLUSHALL the next request reloads the grants from DynamoDB: spent credit does
    not come back, and nothing drawn is lost; the window totals start again empty."""
    user = uuid.uuid4().hex
    grant(user, "inv", 10)
    assert embed(user, 7) == [200] * 7  # 4 from the quota, 3 from the grant
    assert remaining(user) == {"inv": 7}
    env.flushall()
    assert remaining(user) == {"inv": 7}
    assert [w["used"] for w in usage(user).body["windows"]] == [0, 0]
    assert embed(user, 4 + 7) == [200] * 11
    assert remaining(user) == {"inv": 0} and consumed(user) == {"inv": 10}
    assert embed_one(user).status == 429


def test_a_draw_under_a_stale_epoch_moves_onto_a_fresh_copy(env: Any,
                                                             emulator: EmulatorProcess) -> None:
    """A draw made under an epoch that DynamoDB has moved past (a load elsewhere) is taken
    from a freshly loaded copy and recorded under its epoch: served, and counted once."""
    user = uuid.uuid4().hex
    grant(user, "inv", 10)
    assert embed(user, 5) == [200] * 5
    epoch = store().bump_epoch(user)  # a load elsewhere: the cache's epoch is stale
    calls = llm_calls(emulator)
    assert embed(user, 1) == [200]
    assert llm_calls(emulator) == calls + 1
    assert consumed(user) == {"inv": 2} and remaining(user) == {"inv": 8}
    assert sorted(r.epoch > epoch for r in store().charge_records(user)) == [False, True]
    assert embed(user, 1) == [200]
    assert consumed(user) == {"inv": 3} and remaining(user) == {"inv": 7}


def test_dynamodb_down_on_a_drawing_request_is_503_with_nothing_charged(
        env: Any, emulator: EmulatorProcess) -> None:
    """When the draw cannot be recorded (DynamoDB refuses), the answer is 503, the charge
    is refunded and no provider is called; a request within the quota never needs
    DynamoDB once loaded."""
    user = uuid.uuid4().hex
    grant(user, "inv", 10)
    assert embed(user, 3) == [200] * 3
    cache = runtime.get_entitlements()
    assert cache is not None
    good = cache.store
    cache.store = EntitlementStore(StoreSettings(table="no-such-table", region="us-east-1"))
    try:
        assert embed(user, 1) == [200]  # the quota's last token: no draw
        calls = llm_calls(emulator)
        res = embed_one(user)
        assert res.status == 503 and res.body["error"]["code"] == "limiter_unavailable"
        assert llm_calls(emulator) == calls
    finally:
        cache.store = good
    assert consumed(user) == {"inv": 0}
    assert [w["used"] for w in usage(user).body["windows"]] == [4, 4]
    assert remaining(user) == {"inv": 10}


def test_admin_changes_reach_the_next_request(env: Any) -> None:
    """A grant made through the admin handler covers the user's very next request, and a
    void stops the one after: each change invalidates the cached copy."""
    user = uuid.uuid4().hex
    assert embed(user, 5) == [200] * 4 + [429]
    grant(user, "inv_123", 500)
    assert embed(user, 2) == [200, 200]
    assert remaining(user) == {"inv_123": 498}
    op("DELETE", f"/admin/v1/users/{user}/grants/inv_123", {"reason": "mistake"})
    assert embed(user, 1) == [429]
    picture = op("GET", f"/admin/v1/users/{user}").body
    assert picture["grants"][0]["consumed"] == 2 and picture["credit"] == 0
    assert [e["draws"] for e in picture["events"][:2]] == \
        [[{"reference": "inv_123", "tokens": 1}]] * 2


def test_support_refund_gives_drawn_credit_back_durably(env: Any) -> None:
    """An operator's refund of a charge paid from a grant returns the credit to the grant
    in the cache and in DynamoDB."""
    user = uuid.uuid4().hex
    grant(user, "inv", 10)
    assert embed(user, 4) == [200] * 4
    assert embed_one(user, request_id="gw-drawn").status == 200
    assert consumed(user) == {"inv": 1}
    res = op("POST", f"/admin/v1/users/{user}/refunds",
             {"request_id": "gw-drawn", "reason": "bad answer"})
    assert res.body["refund"]["tokens"] == 1
    assert consumed(user) == {"inv": 0} and remaining(user) == {"inv": 10}


def test_replays_of_a_suspended_user_are_refused(env: Any) -> None:
    """A repeat of a completed keyed request gets 403 once the account is suspended."""
    user = uuid.uuid4().hex
    headers = {"Idempotency-Key": "once"}
    assert embed_one(user, headers=headers).status == 200
    op("PUT", f"/admin/v1/users/{user}/suspension", {"reason": "abuse"})
    assert embed_one(user, headers=headers).status == 403


def test_loads_overtaken_by_invalidations_give_up_after_a_bound(env: Any,
                                                                emulator: EmulatorProcess) -> None:
    """When every load is refused (an invalidation always wants a newer epoch), a request
    makes at most MAX_LOADS loads, then answers 503 with nothing charged and no provider
    called."""
    from usage_limits.entitlements.cache import MAX_LOADS

    user = uuid.uuid4().hex
    assert embed(user, 1) == [200]
    before = store().epoch(user)

    async def invalidate() -> None:
        budget = runtime.get_budget(((40, 3600), (4, 2592000)))
        await budget.invalidate_entitlements(user, epoch=before + 1000)

    asyncio.get_event_loop().run_until_complete(invalidate())  # the Lambda loop
    calls = llm_calls(emulator)
    res = embed_one(user)
    assert res.status == 503 and res.body["error"]["code"] == "limiter_unavailable"
    assert store().epoch(user) == before + MAX_LOADS
    assert llm_calls(emulator) == calls
    assert usage(user).status == 503


def test_a_change_whose_refresh_failed_says_so_and_a_repeat_applies_it(env: Any) -> None:
    """With Redis unreachable right after the change commits, the admin route answers 503
    not_refreshed (the change is recorded); repeating it once Redis is back refreshes the
    copy, and the user's next request is refused as suspended."""
    import redis.asyncio as aioredis

    from local.redis_servers import free_port

    user = uuid.uuid4().hex
    assert embed(user, 1) == [200]
    runtime.set_redis(aioredis.Redis(host="127.0.0.1", port=free_port(),
                                     socket_connect_timeout=0.2, socket_timeout=0.2))
    try:
        event = http_event("PUT", f"/admin/v1/users/{user}/suspension",
                           body={"reason": "abuse"}, user=None)
        event["requestContext"]["authorizer"] = {"iam": {"userArn": OPERATOR}}
        res = invoke(admin.handler, event)
    finally:
        runtime.set_redis(None)
    assert res.status == 503 and res.body["error"]["code"] == "not_refreshed"
    assert store().load(user).suspension is not None  # recorded
    assert embed(user, 1) == [200]  # the cached copy still says not suspended
    op("PUT", f"/admin/v1/users/{user}/suspension", {"reason": "abuse"})
    assert embed(user, 1) == [403]


def test_a_cost_the_override_can_never_fit_names_the_overrides_window(env: Any) -> None:
    """A claim for pro overridden to mini (5 an hour): a structured request (8 tokens) gets
    422 cost_exceeds_plan naming mini's hourly window, and nothing is charged."""
    user = uuid.uuid4().hex
    op("PUT", f"/admin/v1/users/{user}/plan", {"plan": "mini", "reason": "downgrade"})
    event = _claims(http_event("POST", "/v1/structured", user=user, body={
        "prompt": "x", "schema": {"type": "string"}}), "[pro]")
    res = invoke(importlib.import_module("functions.structured.app").handler, event)
    assert res.status == 422 and res.body["error"]["code"] == "cost_exceeds_plan"
    assert (res.body["error"]["limit"], res.body["error"]["window_s"]) == (5, 3600)
    assert [w["used"] for w in usage(user, "[pro]").body["windows"]] == [0, 0]


def structured(user: str, groups: str | None = None) -> Result:
    """One structured request (8 tokens)."""
    event = _claims(http_event("POST", "/v1/structured", user=user, body={
        "prompt": "x", "schema": {"type": "string"}}), groups)
    return invoke(importlib.import_module("functions.structured.app").handler, event)


def test_credit_pays_the_part_of_a_request_beyond_the_quota(env: Any) -> None:
    """On free (a quota of 4 a month) a structured request of 8 tokens is served with 484
    of credit: the quota pays 4, the grant the other 4, in Redis and DynamoDB alike."""
    user = uuid.uuid4().hex
    grant(user, "inv_big", 484)
    res = structured(user)
    assert res.status == 200, res.body
    assert remaining(user) == {"inv_big": 480} and consumed(user) == {"inv_big": 4}
    assert [w["used"] for w in usage(user).body["windows"]] == [8, 4]
    again = structured(user)  # the quota is full now: credit pays all 8
    assert again.status == 200 and remaining(user) == {"inv_big": 472}


def test_a_cost_above_the_quota_without_enough_credit_says_what_credit_would_do(
        env: Any) -> None:
    """With 3 tokens of credit an 8-token request on free (quota 4) is 422 naming the credit
    it needs (4) and has (3), and nothing is charged or drawn."""
    user = uuid.uuid4().hex
    grant(user, "inv_small", 3)
    res = structured(user)
    assert res.status == 422 and res.body["error"]["code"] == "cost_exceeds_plan"
    err = res.body["error"]
    assert (err["limit"], err["window_s"], err["credit"], err["credit_needed"]) == (
        4, 2592000, 3, 4)
    assert "more credit would let it be served" in err["message"]
    assert remaining(user) == {"inv_small": 3}
    assert [w["used"] for w in usage(user).body["windows"]] == [0, 0]


def test_a_cost_above_a_shorter_window_says_credit_cannot_pay(env: Any) -> None:
    """On mini (5 an hour) an 8-token request is 422 whatever the credit: the message says
    credit pays only beyond the quota, and the body names no credit needed."""
    user = uuid.uuid4().hex
    grant(user, "inv_mini", 500)
    res = structured(user, "[mini]")
    err = res.body["error"]
    assert res.status == 422 and (err["limit"], err["window_s"]) == (5, 3600)
    assert "credit cannot pay for it" in err["message"] and "credit_needed" not in err
    assert remaining(user) == {"inv_mini": 500}


def test_a_full_quota_with_short_credit_is_429_saying_so(env: Any) -> None:
    """With the quota spent and 5 tokens of credit, an 8-token request is 429 whose message
    says the credit does not cover it, and whose wait frees the 3 quota tokens it lacks."""
    user = uuid.uuid4().hex
    assert embed(user, 4) == [200] * 4  # the quota of 4, spent
    grant(user, "inv_five", 5)
    res = structured(user)
    assert res.status == 429 and res.body["error"]["credit"] == 5
    assert "your credit (5 tokens) does not cover" in res.body["error"]["message"]
    assert 29 * 86400 < res.body["error"]["retry_after_s"] <= 30 * 86400


def ratelimit_fields(res: Result) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The answer's RateLimit-Policy and RateLimit fields, parsed by an RFC 9651 parser
    (which raises on a malformed field): {item: parameters} of each."""
    policy = http_sf.parse(res.headers["ratelimit-policy"].encode(), tltype="list")
    status = http_sf.parse(res.headers["ratelimit"].encode(), tltype="list")
    return ({name: params for name, params in policy},  # type: ignore[misc]
            {name: params for name, params in status})  # type: ignore[misc]


def test_every_answer_says_what_the_next_call_may_spend_credit_included(env: Any) -> None:
    """On free (4 a month) with 484 of credit and the quota spent, a 200 tells what the next
    call may spend: the quota's r counts the credit, atto-credit gives it alone, every item
    is well-formed Structured Fields in token units, and the client reads the same."""
    user = uuid.uuid4().hex
    grant(user, "inv_484", 484)
    assert embed(user, 4) == [200] * 4  # the quota, spent
    res = embed_one(user)  # drawn from credit
    assert res.status == 200
    policy, status = ratelimit_fields(res)
    assert policy == {"1h": {"q": 40, "w": 3600, "atto-qu": "tokens"},
                      "30d": {"q": 4, "w": 2592000, "atto-qu": "tokens"}}
    assert status["1h"]["r"] == 35
    assert (status["30d"]["r"], status["30d"]["atto-credit"]) == (483, 483)
    assert "qu" not in policy["30d"]  # a unit the registry lacks is not put in qu
    seen = RateLimitStatus.from_headers(res.headers)
    assert seen is not None and (seen.remaining, seen.credit) == (35, 483)
    assert seen.window("30d") is not None and seen.window("30d").used == 4  # type: ignore[union-attr]


def test_headers_of_a_user_without_grants_say_credit_0(env: Any) -> None:
    """A user with no grant gets atto-credit=0 on the quota's item; its r is the quota's."""
    user = uuid.uuid4().hex
    res = embed_one(user)
    assert res.status == 200
    _, status = ratelimit_fields(res)
    assert (status["30d"]["r"], status["30d"]["atto-credit"]) == (3, 0)
    assert "atto-credit" not in status["1h"]


def test_a_failed_drawing_request_shows_the_credit_given_back(
        env: Any, emulator: EmulatorProcess) -> None:
    """A request that drew 1 and failed (502) answers headers that count the refund: the
    credit back to 10 and the quota's room unchanged."""
    user = uuid.uuid4().hex
    grant(user, "inv", 10)
    assert embed(user, 4) == [200] * 4
    emulator.fail_next(5, 500, family="llm")
    res = embed_one(user)
    assert res.status == 502
    _, status = ratelimit_fields(res)
    assert (status["30d"]["r"], status["30d"]["atto-credit"]) == (10, 10)
    assert status["1h"]["r"] == 36


def test_the_operator_view_shows_the_plan_last_charged_and_unknown_after_a_flush(
        env: Any) -> None:
    """A user on the claim's plan (pro) without an override: the admin picture shows pro
    (source claim), last charged under pro at an RFC 3339 time; after FLUSHALL the last
    charge is null (unknown) and the default is shown, until the next charge."""
    user = uuid.uuid4().hex
    assert embed(user, 1, groups="[pro]") == [200]
    picture = op("GET", f"/admin/v1/users/{user}").body
    assert (picture["plan"]["name"], picture["plan"]["source"]) == ("pro", "claim")
    assert picture["override"] is None and picture["last_charged"]["plan"] == "pro"
    assert picture["last_charged"]["at"].endswith("Z")
    env.flushall()
    flushed = op("GET", f"/admin/v1/users/{user}").body
    assert flushed["last_charged"] is None and flushed["plan"]["name"] == "free"
    assert embed(user, 1, groups="[team]") == [200]
    assert op("GET", f"/admin/v1/users/{user}").body["last_charged"]["plan"] == "team"


def test_expired_and_voided_grants_and_refunds_leave_a_trace(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grant that expires unused (its one drawn token refunded by support) shows in GET
    /v1/usage as expired with 10 forfeited, its grant item gets expired_at and forfeited,
    and exactly one Atto Credit Expired event is published however often it is read; a
    voided grant shows as voided with what was left; the refund shows as refunded."""
    from usage_limits.web import events

    published: list[Any] = []
    monkeypatch.setattr(events, "publish_soon", published.extend)
    user = uuid.uuid4().hex
    # time enough for the five requests and two operator calls below on a busy machine
    soon = datetime.now(UTC) + timedelta(seconds=4)
    grant(user, "promo_soon", 10, kind="promo", expires_at=soon)
    grant(user, "inv_void", 6)
    assert embed(user, 4) == [200] * 4
    assert embed_one(user, request_id="gw-paid").status == 200  # drawn from promo_soon
    op("DELETE", f"/admin/v1/users/{user}/grants/inv_void", {"reason": "chargeback"})
    op("POST", f"/admin/v1/users/{user}/refunds", {"request_id": "gw-paid", "reason": "x"})
    time.sleep(max(0.0, (soon - datetime.now(UTC)).total_seconds()) + 0.2)
    first = usage(user).body
    again = usage(user).body
    assert first["ended_grants"] == again["ended_grants"]
    ended = {g["reference"]: g for g in first["ended_grants"]}
    assert (ended["promo_soon"]["ended"], ended["promo_soon"]["forfeited"]) == ("expired", 10)
    assert (ended["inv_void"]["ended"], ended["inv_void"]["forfeited"]) == ("voided", 6)
    assert [r["tokens"] for r in first["refunded"]] == [1]
    kept = store().grant(user, "promo_soon")
    assert kept is not None and kept.forfeited == 10 and kept.expired_at_ms is not None
    expired = [e for e in published if e.detail_type == "Atto Credit Expired"]
    assert [(e.reference, e.forfeited, e.grant_kind) for e in expired] == [
        ("promo_soon", 10, "promo")]
