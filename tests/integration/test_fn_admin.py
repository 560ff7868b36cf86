"""The operator API through its Mangum handler: real Redis (both topologies), moto DynamoDB.

Plan resolution through the public handlers is checked here too: the claim, the local
header, an unknown claim, and a change of plan in the middle of a window.
"""

from __future__ import annotations

import importlib
import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from moto import mock_aws

from local.emulator import EmulatorProcess
from local.lambda_events import http_event, invoke
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

ROOT = Path(__file__).resolve().parents[2]
admin = importlib.import_module("functions.admin.app")
usage_fn = importlib.import_module("functions.usage.app")
embeddings = importlib.import_module("functions.embeddings.app")
OPERATOR = "arn:aws:sts::123456789012:assumed-role/atto-operators/jane"
PLANS = "free=10/1h,100/30d;pro=40/1h,2000/30d"
TABLE = "entitlements-test"


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def env(request: pytest.FixtureRequest, lambda_env: StartEnvironment,
        emulator: EmulatorProcess) -> Iterator[str]:
    """A Lambda environment over real Redis (standalone, then cluster), a moto table and
    the emulator as the LLM."""
    server = request.getfixturevalue("redis_server" if request.param == "standalone"
                                     else "redis_cluster")
    emulator.reset()
    with mock_aws():
        lambda_env({"REDIS_URL": server.url, "LLM_BASE_URL": emulator.openai_base_url,
                    "LLM_API_KEY": "test-key", "LLM_RATE": "1000/s",
                    "REDIS_CLUSTER": "true" if request.param == "cluster" else "false",
                    "ATTO_PLANS": PLANS, "ATTO_DEFAULT_PLAN": "free",
                    "ATTO_PLAN_CLAIM": "cognito:groups", "ATTO_ENTITLEMENTS_TABLE": TABLE,
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing"},
                   unset=("ATTO_ENV", "ATTO_DYNAMODB_ENDPOINT", "ATTO_BUDGET", "AWS_PROFILE",
                          "LLM_SECRET_ARN", "LLM_BURST", "LLM_CONCURRENCY"))
        EntitlementStore(StoreSettings(table=TABLE, region="us-east-1")).create_table()
        yield request.param


def admin_event(method: str, path: str, body: Any = None, *, principal: str | None = OPERATOR,
                query: dict[str, str] | None = None) -> dict[str, Any]:
    """A payload-v2 event as API Gateway sends it after AWS_IAM authorization."""
    event = http_event(method, path, body=body, user=None, query=query)
    if principal is not None:
        event["requestContext"]["authorizer"] = {"iam": {
            "accessKey": "ASIAEXAMPLE", "accountId": "123456789012", "callerId": "AROA:jane",
            "cognitoIdentity": None, "principalOrgId": None, "userArn": principal,
            "userId": "AROA:jane"}}
    return event


def call(method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
    return invoke(admin.handler, admin_event(method, path, body, **kwargs))


def usage(user: str, groups: str | None = None) -> Any:
    event = http_event("GET", "/v1/usage", user=user)
    if groups is not None:
        event["requestContext"]["authorizer"]["jwt"]["claims"]["cognito:groups"] = groups
    return invoke(usage_fn.handler, event)


def test_a_user_never_seen_gets_an_empty_picture(env: str) -> None:
    """GET on an unknown user answers 200 with the default plan, empty windows and nothing
    else, not 404."""
    user = uuid.uuid4().hex
    res = call("GET", f"/admin/v1/users/{user}")
    assert res.status == 200
    body = res.body
    assert body["user_id"] == user
    assert body["plan"] == {"name": "free", "source": "default",
                            "windows": [{"limit": 10, "window_s": 3600},
                                        {"limit": 100, "window_s": 2592000}]}
    assert [w["used"] for w in body["windows"]] == [0, 0]
    assert (body["override"], body["grants"], body["credit"], body["suspension"],
            body["events"]) == (None, [], 0, None, [])


def test_override_shows_in_the_picture_and_is_audited_with_the_principal(env: str) -> None:
    """PUT plan sets the override (source override), DELETE clears it, and the audit log
    lists both, newest first, with the IAM principal and the reason."""
    user = uuid.uuid4().hex
    res = call("PUT", f"/admin/v1/users/{user}/plan", {"plan": "pro", "reason": "upgrade"})
    assert res.status == 200 and res.body["override"]["plan"] == "pro"
    assert res.body["override"]["by"] == OPERATOR
    picture = call("GET", f"/admin/v1/users/{user}").body
    assert picture["plan"]["name"] == "pro" and picture["plan"]["source"] == "override"
    assert [w["limit"] for w in picture["windows"]] == [40, 2000]
    cleared = call("DELETE", f"/admin/v1/users/{user}/plan", {"reason": "trial over"})
    assert cleared.status == 200 and cleared.body["cleared"] is True
    again = call("DELETE", f"/admin/v1/users/{user}/plan", query={"reason": "again"})
    assert again.status == 200 and again.body["cleared"] is False
    log = call("GET", "/admin/v1/audit", query={"user_id": user}).body["entries"]
    assert [(e["action"], e["reason"], e["by"]) for e in log] == [
        ("plan.clear", "trial over", OPERATOR), ("plan.set", "upgrade", OPERATOR)]
    everyone = call("GET", "/admin/v1/audit", query={"limit": "500"}).body["entries"]
    assert {e["user_id"] for e in everyone} >= {user}


def test_grant_is_created_once_per_reference_and_voided(env: str) -> None:
    """POST grants answers 201 then 200 with the same grant for the same reference and terms
    (409 with other terms, nothing added); DELETE voids it; the picture shows the grant and
    the live credit."""
    user = uuid.uuid4().hex
    body = {"tokens": 500, "kind": "paid", "reference": "inv_123",
            "expires_at": "2099-01-31T00:00:00Z", "reason": "bought 500 tokens"}
    first = call("POST", f"/admin/v1/users/{user}/grants", body)
    assert first.status == 201 and first.body["created"] is True
    grant = first.body["grant"]
    assert (grant["tokens"], grant["remaining"], grant["kind"], grant["expires_at"]) == \
        (500, 500, "paid", "2099-01-31T00:00:00.000Z")
    second = call("POST", f"/admin/v1/users/{user}/grants", {**body, "reason": "retry"})
    assert second.status == 200 and second.body["created"] is False
    assert second.body["grant"]["tokens"] == 500
    other = call("POST", f"/admin/v1/users/{user}/grants", {**body, "tokens": 900})
    assert other.status == 409 and other.body["error"]["code"] == "grant_conflict"
    picture = call("GET", f"/admin/v1/users/{user}").body
    assert len(picture["grants"]) == 1 and picture["credit"] == 500
    voided = call("DELETE", f"/admin/v1/users/{user}/grants/inv_123", {"reason": "chargeback"})
    assert voided.status == 200 and voided.body["voided"] is True
    assert voided.body["grant"]["remaining"] == 0 and not voided.body["grant"]["live"]
    assert call("GET", f"/admin/v1/users/{user}").body["credit"] == 0
    missing = call("DELETE", f"/admin/v1/users/{user}/grants/nope", {"reason": "x"})
    assert missing.status == 404 and missing.body["error"]["code"] == "not_found"


def test_suspension_is_set_and_lifted(env: str) -> None:
    """PUT suspension records the reason and end; DELETE lifts it; both are audited."""
    user = uuid.uuid4().hex
    res = call("PUT", f"/admin/v1/users/{user}/suspension",
               {"reason": "card testing", "until": "2099-01-01T00:00:00+00:00"})
    assert res.status == 200
    assert res.body["suspension"]["active"] is True
    assert res.body["suspension"]["until"] == "2099-01-01T00:00:00.000Z"
    assert call("GET", f"/admin/v1/users/{user}").body["suspension"]["reason"] == "card testing"
    lifted = call("DELETE", f"/admin/v1/users/{user}/suspension", {"reason": "appeal"})
    assert lifted.status == 200 and lifted.body["lifted"] is True
    assert call("GET", f"/admin/v1/users/{user}").body["suspension"] is None
    actions = [e["action"] for e in
               call("GET", "/admin/v1/audit", query={"user_id": user}).body["entries"]]
    assert actions == ["suspension.lift", "suspension.set"]


def test_support_refund_gives_the_charge_back_at_most_once(env: str) -> None:
    """A refund of one charge returns its tokens once; asking again returns the first
    refund and gives nothing more; an unknown charge is 404."""
    user = uuid.uuid4().hex
    event = http_event("POST", "/v1/embeddings", body={"input": ["hello"]}, user=user,
                       request_id="gw-req-1")
    assert invoke(embeddings.handler, event).status == 200
    assert usage(user).body["windows"][0]["used"] == 1
    first = call("POST", f"/admin/v1/users/{user}/refunds",
                 {"request_id": "gw-req-1", "reason": "wrong answer"})
    assert first.status == 201 and first.body["refund"]["tokens"] == 1
    assert first.body["refund"]["request_id"] == "gw-req-1"
    assert usage(user).body["windows"][0]["used"] == 0
    second = call("POST", f"/admin/v1/users/{user}/refunds",
                  {"request_id": "gw-req-1", "reason": "again"})
    assert second.status == 200 and second.body["created"] is False
    assert usage(user).body["windows"][0]["used"] == 0
    unknown = call("POST", f"/admin/v1/users/{user}/refunds",
                   {"request_id": "never", "reason": "x"})
    assert unknown.status == 404


def test_audit_details_write_instants_as_rfc3339(env: str) -> None:
    """The audit's details show a grant's expiry and a suspension's end as RFC 3339 UTC
    strings (no epoch milliseconds) and a refunded request's id as the user saw it."""
    user = uuid.uuid4().hex
    assert call("POST", f"/admin/v1/users/{user}/grants",
                {"tokens": 5, "kind": "promo", "reference": "camp-t", "reason": "r",
                 "expires_at": "2099-01-31T00:00:00Z"}).status == 201
    assert call("PUT", f"/admin/v1/users/{user}/suspension",
                {"reason": "r", "until": "2099-02-01T12:00:00+02:00"}).status == 200
    assert call("DELETE", f"/admin/v1/users/{user}/suspension", {"reason": "r"}).status == 200
    event = http_event("POST", "/v1/embeddings", body={"input": ["x"]}, user=user,
                       request_id="gw-audit-1")
    assert invoke(embeddings.handler, event).status == 200
    assert call("POST", f"/admin/v1/users/{user}/refunds",
                {"request_id": "gw-audit-1", "reason": "r"}).status == 201
    entries = call("GET", "/admin/v1/audit", query={"user_id": user}).body["entries"]
    details = {e["action"]: e["details"] for e in entries}
    assert details["grant.create"] == {"reference": "camp-t", "tokens": 5, "kind": "promo",
                                       "expires_at": "2099-01-31T00:00:00.000Z"}
    assert details["suspension.set"] == {"until": "2099-02-01T10:00:00.000Z"}
    assert details["refund"] == {"request_id": "gw-audit-1", "tokens": 1, "credit": [],
                                 "forfeited": []}
    assert "_ms" not in json.dumps(entries)


@pytest.mark.parametrize("key", [None, "retry-7f3a"])
def test_the_id_a_response_shows_is_the_one_usage_and_support_use(env: str,
                                                                   key: str | None) -> None:
    """X-Request-Id (API Gateway's id, or the Idempotency-Key) is the id GET /v1/usage and
    the operator picture list, and a support refund by it gives the charge back."""
    user = uuid.uuid4().hex
    event = http_event("POST", "/v1/embeddings", body={"input": ["hello"]}, user=user,
                       request_id="gw-req-9",
                       headers={"Idempotency-Key": key} if key else None)
    res = invoke(embeddings.handler, event)
    assert res.status == 200
    shown = res.headers["x-request-id"]
    assert shown == (key or "gw-req-9")
    assert [e["request_id"] for e in usage(user).body["events"]] == [shown]
    assert [e["request_id"] for e in call("GET", f"/admin/v1/users/{user}").body["events"]] \
        == [shown]
    refund = call("POST", f"/admin/v1/users/{user}/refunds",
                  {"request_id": shown, "reason": "quoted by the user"})
    assert refund.status == 201 and refund.body["refund"]["request_id"] == shown
    assert usage(user).body["windows"][0]["used"] == 0


def test_every_error_carries_its_request_id_in_the_header_and_the_body(env: str) -> None:
    """A 422, a 400 for a malformed Idempotency-Key and an operator 404 each carry an
    X-Request-Id equal to the error body's request_id."""
    user = uuid.uuid4().hex
    answers = [
        invoke(embeddings.handler, http_event("POST", "/v1/embeddings", body={"input": 5},
                                              user=user, request_id="gw-bad-1")),
        invoke(embeddings.handler, http_event("POST", "/v1/embeddings", user=user,
                                              body={"input": ["x"]},
                                              headers={"Idempotency-Key": "\u00e9"})),
        call("POST", f"/admin/v1/users/{user}/refunds", {"request_id": "never", "reason": "x"}),
    ]
    assert [a.status for a in answers] == [422, 400, 404]
    assert answers[0].headers["x-request-id"] == "gw-bad-1"
    for answer in answers:
        assert answer.headers["x-request-id"]
        assert answer.body["error"]["request_id"] == answer.headers["x-request-id"]


@pytest.mark.parametrize("method, path, body, field", [
    ("PUT", "/plan", {"plan": "pro"}, "reason"),
    ("PUT", "/plan", {"plan": "pro", "reason": ""}, "reason"),
    ("PUT", "/plan", {"plan": "gold", "reason": "r"}, None),
    ("POST", "/grants", {"tokens": 0, "kind": "paid", "reference": "a", "reason": "r"}, "tokens"),
    ("POST", "/grants", {"tokens": 5, "kind": "gift", "reference": "a", "reason": "r"}, "kind"),
    ("POST", "/grants", {"tokens": 5, "kind": "paid", "reference": "a b", "reason": "r"},
     "reference"),
    ("POST", "/grants", {"tokens": 5, "kind": "paid", "reference": "a", "reason": "r",
                         "expires_at": "2099-01-01T00:00:00"}, "expires_at"),
    ("POST", "/grants", {"tokens": 5, "kind": "paid", "reference": "a", "reason": "r",
                         "expires_at": "2001-01-01T00:00:00Z"}, None),
    ("POST", "/grants", {"tokens": "5", "kind": "paid", "reference": "a", "reason": "r"},
     "tokens"),
    ("PUT", "/suspension", {"until": "2099-01-01T00:00:00Z"}, "reason"),
    ("DELETE", "/suspension", None, None),
    ("POST", "/refunds", {"reason": "r"}, "request_id"),
])
def test_bad_input_gets_the_public_error_shape_and_changes_nothing(
        env: str, method: str, path: str, body: Any, field: str | None) -> None:
    """Malformed or reasonless changes get 400/422 invalid_request and write nothing."""
    user = uuid.uuid4().hex
    res = call(method, f"/admin/v1/users/{user}{path}", body)
    assert res.status in (400, 422), res.body
    assert res.body["error"]["code"] == "invalid_request"
    if field is not None:
        assert field in json.dumps(res.body["error"])
    assert call("GET", "/admin/v1/audit", query={"user_id": user}).body["entries"] == []
    picture = call("GET", f"/admin/v1/users/{user}").body
    assert (picture["override"], picture["grants"], picture["suspension"]) == (None, [], None)


def test_without_an_iam_principal_outside_local_mode_every_route_is_403(env: str) -> None:
    """An event without requestContext.authorizer.iam (a JWT, or nothing) is refused 403,
    and a user's JWT claims never stand in for an operator."""
    user = uuid.uuid4().hex
    event = http_event("PUT", f"/admin/v1/users/{user}/plan",
                       body={"plan": "pro", "reason": "r"}, user="attacker")
    res = invoke(admin.handler, event)
    assert res.status == 403 and res.body["error"]["code"] == "forbidden"
    res = call("GET", f"/admin/v1/users/{user}", principal=None)
    assert res.status == 403
    assert call("GET", f"/admin/v1/users/{user}").body["override"] is None


def test_authorization_comes_before_the_store_on_every_route(
        env: str, lambda_env: StartEnvironment) -> None:
    """With the entitlements store missing, an unsigned request to any operator route is 403
    (authorization first), and a signed one is 503 store_unavailable."""
    lambda_env({}, unset=("ATTO_ENTITLEMENTS_TABLE",))
    routes = [(method, route.path) for route in admin.app.routes
              if route.path.startswith("/admin/") for method in route.methods]
    assert len(routes) >= 9
    for method, template in routes:
        path = template.replace("{user_id}", uuid.uuid4().hex).replace("{reference}", "ref")
        body = {"plan": "pro", "reason": "r"} if method in ("PUT", "POST") else None
        unsigned = call(method, path, body, principal=None)
        assert unsigned.status == 403, (method, path, unsigned.body)
        assert unsigned.body["error"]["code"] == "forbidden"
        signed = call(method, path, body, query={"user_id": "u", "reason": "r"})
        assert signed.status in (422, 503), (method, path, signed.body)


def test_local_mode_serves_operators_as_local(env: str, lambda_env: StartEnvironment) -> None:
    """In local mode an unsigned request is served, and audited as the operator `local`."""
    lambda_env({"ATTO_ENV": "local"})
    user = uuid.uuid4().hex
    res = call("PUT", f"/admin/v1/users/{user}/plan", {"plan": "pro", "reason": "dev"},
               principal=None)
    assert res.status == 200 and res.body["override"]["by"] == "local"


def test_plan_comes_from_the_claim_and_an_unknown_claim_gets_the_default(
        env: str, caplog: pytest.LogCaptureFixture) -> None:
    """The first cognito:groups entry naming a plan chooses it; a claim naming no plan gets
    the default plan (200, never 500) and a warning in the log."""
    user = uuid.uuid4().hex
    pro = usage(user, "[admins pro]")
    assert pro.status == 200 and pro.body["plan"] == "pro"
    assert [w["limit"] for w in pro.body["windows"]] == [40, 2000]
    with caplog.at_level(logging.WARNING, logger="usage_limits.web"):
        unknown = usage(user, "[platinum]")
    assert unknown.status == 200 and unknown.body["plan"] == "free"
    assert any(r.message == "plan claim names no plan; using the default plan"
               and getattr(r, "claim", None) == "platinum" for r in caplog.records)
    assert usage(user).body["plan"] == "free"


def test_local_plan_header_only_in_local_mode(env: str, lambda_env: StartEnvironment) -> None:
    """X-Atto-Plan chooses the plan in local mode and is ignored everywhere else."""
    user = uuid.uuid4().hex
    event = http_event("GET", "/v1/usage", user=user, headers={"X-Atto-Plan": "pro"})
    assert invoke(usage_fn.handler, event).body["plan"] == "free"
    lambda_env({"ATTO_ENV": "local"})
    assert invoke(usage_fn.handler, event).body["plan"] == "pro"


def test_plan_change_mid_window_keeps_totals_exact(env: str) -> None:
    """Spending under free, then pro, then free again counts every charge in every window:
    the pro plan admits up to its own limits with the free-plan spend included."""
    user = uuid.uuid4().hex

    def embed(groups: str, n: int) -> list[int]:
        out = []
        for _ in range(n):
            event = http_event("POST", "/v1/embeddings", body={"input": ["x"]}, user=user)
            event["requestContext"]["authorizer"]["jwt"]["claims"]["cognito:groups"] = groups
            out.append(invoke(embeddings.handler, event).status)
        return out

    assert embed("[free]", 12) == [200] * 10 + [429, 429]  # free: 10/1h
    assert embed("[pro]", 31) == [200] * 30 + [429]  # pro: 40/1h, 10 already spent
    assert embed("[free]", 1) == [429]
    windows = usage(user, "[pro]").body["windows"]
    assert [(w["limit"], w["used"]) for w in windows] == [(40, 40), (2000, 40)]
