"""What users and operators are told about the plan a user is measured against, through
the real handlers (API Gateway events) over real Redis and moto DynamoDB.

The plans are the local ones: ``default`` (100/1h, 1000/30d), ``free`` (100/1h, 24/30d)
and ``pro``; a user's JWT claim (``cognito:groups``) chooses ``free`` or ``pro``. The test
app charges 8 tokens on ``/ok`` and ``/fails`` (a 502, refunded) and 32 on ``/big``.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import http_sf
import pytest
from fastapi import Depends
from moto import mock_aws

from local.lambda_events import http_event, invoke
from tests.metered import handler, metered_app
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore
from usage_limits.entitlements.usage_store import UsageSettings, UsageStore, set_usage_store
from usage_limits.web import events, require_tokens

if TYPE_CHECKING:
    from local.lambda_events import Result
    from tests.conftest import RedisServer, StartEnvironment

admin = importlib.import_module("functions.admin.app")
OPERATOR = "arn:aws:sts::123456789012:assumed-role/atto-operators/jane"
PLANS = "default=100/1h,1000/30d;free=100/1h,24/30d;pro=400/1h,20000/30d"
TABLE, USAGE = "entitlements-plan-answers", "usage-plan-answers"


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer) -> Iterator[None]:
    """A Lambda environment over real Redis and moto tables, with the local plans."""
    with mock_aws():
        lambda_env({"REDIS_URL": redis_server.url, "REDIS_CLUSTER": "false",
                    "ATTO_PLANS": PLANS, "ATTO_DEFAULT_PLAN": "default",
                    "ATTO_PLAN_CLAIM": "cognito:groups", "ATTO_ENTITLEMENTS_TABLE": TABLE,
                    "ATTO_USAGE_TABLE": USAGE, "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
                   unset=("ATTO_ENV", "ATTO_DYNAMODB_ENDPOINT", "ATTO_BUDGET", "AWS_PROFILE",
                          "ATTO_USAGE_RECORDS_DAYS", "ATTO_EVENT_BUS"))
        EntitlementStore(StoreSettings(table=TABLE, region="us-east-1")).create_table()
        UsageStore(UsageSettings(table=USAGE, region="us-east-1")).create_table()
        try:
            yield
        finally:
            set_usage_store(None)


_APP: list[Any] = []


def app() -> Any:
    """The test app (made once): /ok and /fails charge 8 tokens, /big 32."""
    if not _APP:
        made = metered_app("plan answers", cost=8)

        @made.post("/big", dependencies=[Depends(require_tokens(cost=32))])
        async def big() -> dict[str, bool]:
            return {"ok": True}

        _APP.append(handler(made))
    return _APP[0]


def call(path: str, user: str, plan: str) -> Result:
    """A POST of ``user`` whose JWT claims the plan ``plan``."""
    event = http_event("POST", path, body={}, user=user)
    event["requestContext"]["authorizer"]["jwt"]["claims"]["cognito:groups"] = f"[{plan}]"
    return invoke(app(), event)


def op(method: str, path: str, body: Any = None) -> Result:
    """An operator call through the admin function, signed as an IAM principal."""
    event = http_event(method, path, body=body, user=None)
    event["requestContext"]["authorizer"] = {"iam": {"userArn": OPERATOR}}
    result = invoke(admin.handler, event)
    assert result.status < 300, result.body
    return result


def grant(user: str, tokens: int) -> None:
    op("POST", f"/admin/v1/users/{user}/grants", {"tokens": tokens, "kind": "paid",
                                                   "reference": f"inv_{tokens}",
                                                   "reason": "top-up"})


def ratelimit(res: Result) -> dict[str, dict[str, Any]]:
    """The answer's RateLimit field, parsed by an RFC 9651 parser: {item: parameters}."""
    return {name: params for name, params in  # type: ignore[misc]
            http_sf.parse(res.headers["ratelimit"].encode(), tltype="list")}


def test_credit_needed_is_what_lets_the_request_through(env: None) -> None:
    """A free user (a 24-token quota) who spent 16 sends a 32-token request with no credit:
    422 names credit_needed 24 (the quota's room covers 8); granted exactly 24, the same
    request is served, drawing all 24."""
    user = uuid.uuid4().hex
    assert [call("/ok", user, "free").status for _ in range(2)] == [200, 200]
    refused = call("/big", user, "free")
    assert refused.status == 422, refused.body
    err = refused.body["error"]
    assert (err["code"], err["cost"], err["limit"], err["credit"], err["credit_needed"]) == (
        "cost_exceeds_plan", 32, 24, 0, 24)
    assert "needs 24 tokens of credit where you have 0" in err["message"]
    grant(user, err["credit_needed"])
    served = call("/big", user, "free")
    assert served.status == 200, served.body
    picture = op("GET", f"/admin/v1/users/{user}").body
    assert [(g["consumed"], g["remaining"]) for g in picture["grants"]] == [(24, 0)]


def test_a_cost_exceeds_plan_answer_carries_the_ratelimit_fields(env: None) -> None:
    """The 422 cost_exceeds_plan carries RateLimit-Policy and RateLimit as every metered
    answer does: the free user's hour has 84 left, the quota 8 and no credit."""
    user = uuid.uuid4().hex
    assert [call("/ok", user, "free").status for _ in range(2)] == [200, 200]
    refused = call("/big", user, "free")
    assert refused.status == 422
    assert "ratelimit-policy" in refused.headers and "retry-after" not in refused.headers
    fields = ratelimit(refused)
    assert fields["1h"]["r"] == 84
    assert (fields["30d"]["r"], fields["30d"]["atto-credit"]) == (8, 0)


def test_show_draws_the_windows_of_the_plan_the_user_is_charged_under(env: None) -> None:
    """A user charged under free by their claim: the operator's picture shows free's
    windows (24 a month, 8 left), not the default's; a later request under pro that fails
    and is refunded changes neither the plan shown nor the last charge."""
    user = uuid.uuid4().hex
    assert [call("/ok", user, "free").status for _ in range(2)] == [200, 200]
    picture = op("GET", f"/admin/v1/users/{user}").body
    assert (picture["plan"]["name"], picture["plan"]["source"]) == ("free", "claim")
    assert [(w["limit"], w["used"], w["remaining"]) for w in picture["windows"]] == [
        (100, 16, 84), (24, 16, 8)]
    charged_at = picture["last_charged"]["at"]
    assert picture["last_charged"]["plan"] == "free"
    assert call("/fails", user, "pro").status == 502
    after = op("GET", f"/admin/v1/users/{user}").body
    assert (after["plan"]["name"], after["plan"]["source"]) == ("free", "claim")
    assert after["last_charged"] == {"plan": "free", "at": charged_at}
    assert [(w["limit"], w["used"]) for w in after["windows"]] == [(100, 16), (24, 16)]


def test_show_without_a_claim_or_an_override_is_the_default(env: None) -> None:
    """A user charged under the default, and one never seen, are shown the default's
    windows; an override beats the plan of the last charge."""
    user = uuid.uuid4().hex
    assert call("/ok", user, "default").status == 200
    picture = op("GET", f"/admin/v1/users/{user}").body
    assert (picture["plan"]["name"], picture["plan"]["source"]) == ("default", "default")
    assert [w["limit"] for w in picture["windows"]] == [100, 1000]
    never = op("GET", f"/admin/v1/users/{uuid.uuid4().hex}").body
    assert (never["plan"]["name"], never["last_charged"]) == ("default", None)
    other = uuid.uuid4().hex
    assert call("/ok", other, "free").status == 200
    op("PUT", f"/admin/v1/users/{other}/plan", {"plan": "pro", "reason": "upgrade"})
    overridden = op("GET", f"/admin/v1/users/{other}").body
    assert (overridden["plan"]["name"], overridden["plan"]["source"]) == ("pro", "override")
    assert [w["limit"] for w in overridden["windows"]] == [400, 20000]


def test_a_threshold_is_reported_once_across_plan_changes(
        env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user on free crosses 80% and 100% of the 24-token quota once; moved to default
    and back to free, still past free's quota, no threshold is reported again; a user
    moved from default to free with 16 spent gets 80% and 100% from the charge that takes
    them to 24, once."""
    published: list[Any] = []
    monkeypatch.setattr(events, "publish_soon", published.extend)

    def crossed(user: str, plans: list[str]) -> list[tuple[int, str, int]]:
        published.clear()
        assert [call("/ok", user, plan).status for plan in plans] == [200] * len(plans)
        return [(e.threshold, e.plan, e.window_s) for e in published
                if isinstance(e, events.UsageThreshold)]

    month = 30 * 86400
    back_and_forth = uuid.uuid4().hex
    grant(back_and_forth, 500)  # credit pays what free's quota cannot
    assert crossed(back_and_forth, ["free"] * 3) == [(80, "free", month), (100, "free", month)]
    assert crossed(back_and_forth, ["default", "default", "free", "free"]) == []
    moved = uuid.uuid4().hex
    grant(moved, 500)
    assert crossed(moved, ["default", "default"]) == []
    assert crossed(moved, ["free"]) == [(80, "free", month), (100, "free", month)]
    assert crossed(moved, ["default", "free"]) == []
