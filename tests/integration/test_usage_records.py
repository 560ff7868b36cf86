"""Usage records on the request path, through real handlers: one per charge, lowered once by
a settle, a refund and a support refund (through lost replies and re-sends), kept and
written later when DynamoDB fails, surviving FLUSHALL, and read back by the statement.

Real Redis (standalone, then the 3-node cluster), moto DynamoDB. The plan ``free`` has a
30-day quota of 4 tokens, so a user's fifth token is drawn from a grant.
"""

from __future__ import annotations

import importlib
import json
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import pytest
import redis
from fastapi import Depends
from moto import mock_aws

from local.lambda_events import http_event, invoke
from tests.metered import handler, metered_app
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.exceptions import StoreUnavailable
from usage_limits.entitlements.store import EntitlementStore
from usage_limits.entitlements.usage import UsageRecord
from usage_limits.entitlements.usage_store import UsageSettings, UsageStore, set_usage_store
from usage_limits.web import records, require_tokens
from usage_limits.web.charge import Charge

if TYPE_CHECKING:
    from local.lambda_events import Result
    from tests.conftest import StartEnvironment

admin = importlib.import_module("functions.admin.app")
usage_fn = importlib.import_module("functions.usage.app")
OPERATOR = "arn:aws:sts::123456789012:assumed-role/atto-operators/jane"
TABLE, USAGE = "entitlements-records", "usage-records"
COST = 1


#: A charge of 3 tokens that the route settles to 1.
THREE = Depends(require_tokens(cost=3))


def _app() -> Any:
    app = metered_app("records", cost=COST)

    @app.post("/settles")
    async def settles(charge: Annotated[Charge, THREE]) -> dict[str, bool]:
        await charge.settle(1)
        return {"ok": True}

    return handler(app)


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.cluster)])
def env(request: pytest.FixtureRequest, lambda_env: StartEnvironment) -> Iterator[Any]:
    """A Lambda environment over real Redis (standalone, then cluster) and moto tables;
    yields a plain Redis client of the same server (for FLUSHALL)."""
    cluster = request.param == "cluster"
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    with mock_aws():
        lambda_env({"REDIS_URL": server.url, "REDIS_CLUSTER": "true" if cluster else "false",
                    "ATTO_PLANS": "free=40/1h,4/30d", "ATTO_DEFAULT_PLAN": "free",
                    "ATTO_ENTITLEMENTS_TABLE": TABLE, "ATTO_USAGE_TABLE": USAGE,
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing"},
                   unset=("ATTO_ENV", "ATTO_DYNAMODB_ENDPOINT", "ATTO_BUDGET", "AWS_PROFILE",
                          "ATTO_USAGE_RECORDS_DAYS"))
        EntitlementStore(StoreSettings(table=TABLE, region="us-east-1")).create_table()
        usage_store().create_table()
        plain: Any = (redis.RedisCluster(host="127.0.0.1", port=server.startup_nodes[0][1])
                      if cluster else redis.Redis(host="127.0.0.1", port=server.port))
        try:
            yield plain
        finally:
            plain.close()
            set_usage_store(None)


def usage_store() -> UsageStore:
    return UsageStore(UsageSettings(table=USAGE, region="us-east-1"))


APP: Any = None


def call(path: str, user: str, **kwargs: Any) -> Result:
    global APP
    if APP is None:
        APP = _app()
    return invoke(APP, http_event("POST", path, body={}, user=user, **kwargs))


def op(method: str, path: str, body: Any = None, query: dict[str, str] | None = None) -> Result:
    """An operator call through the admin function, signed as an IAM principal."""
    event = http_event(method, path, body=body, user=None, query=query)
    event["requestContext"]["authorizer"] = {"iam": {"userArn": OPERATOR}}
    return invoke(admin.handler, event)


def history(user: str, **query: str) -> Result:
    return invoke(usage_fn.handler, http_event("GET", "/v1/usage/history", user=user,
                                               query=query))


def all_records(user: str) -> list[UsageRecord]:
    return usage_store().records(user, 0, 2 ** 42)


def test_every_charge_has_one_record_with_its_credit(env: Any) -> None:
    """Five charges make five records (the fifth drew its token from the grant), and the
    statement lists them newest first with the day's totals."""
    user = uuid.uuid4().hex
    EntitlementStore(StoreSettings(table=TABLE, region="us-east-1")).create_grant(
        user, tokens=10, kind="paid", reference="inv_1", expires_at_ms=None,
        actor="arn:op", reason="test")
    ids = [f"gw-{i}" for i in range(5)]
    assert [call("/ok", user, request_id=rid).status for rid in ids] == [200] * 5
    found = all_records(user)
    assert sorted(r.request_id for r in found) == sorted("r:" + rid for rid in ids)
    assert all((r.state, r.cost, r.kept, r.route, r.plan) == ("charged", 1, 1, "/ok", "free")
               for r in found)
    assert [r.draws for r in found if r.draws] == [(("inv_1", 1),)]
    body = history(user).body
    assert [r["request_id"] for r in body["records"]] == list(reversed(ids))
    assert body["days"][0]["charges"] == 5 and body["days"][0]["credit"] == 1
    assert body["records"][0]["at"].endswith("Z") and body["cursor"] is None


def test_settle_and_refund_lower_the_record_once(env: Any) -> None:
    """A settled charge's record keeps 1 of 3; a failed request's record is refunded."""
    user = uuid.uuid4().hex
    assert call("/settles", user, request_id="s1").status == 200
    assert call("/fails", user, request_id="f1").status == 502
    got = {r.request_id: r for r in all_records(user)}
    assert (got["r:s1"].state, got["r:s1"].cost, got["r:s1"].kept) == ("settled", 3, 1)
    assert (got["r:f1"].state, got["r:f1"].kept, got["r:f1"].refunded) == ("refunded", 0, 1)
    assert got["r:f1"].changed_ms is not None


def test_support_refund_marks_the_record_once_through_repeats(env: Any) -> None:
    """A support refund marks the record support-refunded; repeating the call changes
    nothing (the same changed instant)."""
    user = uuid.uuid4().hex
    assert call("/ok", user, request_id="sr").status == 200
    body = {"request_id": "sr", "reason": "bad answer"}
    assert op("POST", f"/admin/v1/users/{user}/refunds", body).status == 201
    (first,) = all_records(user)
    assert (first.state, first.kept) == ("support-refunded", 0)
    assert op("POST", f"/admin/v1/users/{user}/refunds", body).status == 200
    assert all_records(user) == [first]


class _LosesReplies(UsageStore):
    """Every write of request ``r:l1`` lands, then its reply is lost once (as after a
    timeout); other requests' writes answer as usual."""

    def __init__(self) -> None:
        super().__init__(UsageSettings(table=USAGE, region="us-east-1"))
        self.lost = 0

    def put(self, record: UsageRecord) -> bool:
        created = super().put(record)
        return self._lose(record.request_id, created)

    def lower(self, user_id: str, request_id: str, *args: Any) -> bool:
        lowered = super().lower(user_id, request_id, *args)
        return self._lose(request_id, lowered)

    def _lose(self, request_id: str, answer: bool) -> bool:
        if request_id == "r:l1":
            self.lost += 1
            if self.lost % 2:
                raise StoreUnavailable("reply lost")
        return answer


def test_lost_replies_and_re_sends_land_each_write_once(env: Any) -> None:
    """With every first reply lost, the record is kept, re-sent before later requests,
    and ends as one settled record whose lowering happened once."""
    user = uuid.uuid4().hex
    lossy = _LosesReplies()
    set_usage_store(lossy)
    assert call("/settles", user, request_id="l1").status == 200
    assert records.pending() == 1
    for _ in range(6):  # two re-sends at least; a loaded machine may need more turns
        call("/ok", user)
        if records.pending() == 0 and lossy.lost >= 4:
            break
    mine = [r for r in all_records(user) if r.request_id == "r:l1"]
    assert len(mine) == 1 and (mine[0].state, mine[0].kept, mine[0].cost) == ("settled", 1, 3)
    assert records.pending() == 0 and lossy.lost == 4  # put, lowering: each sent twice
    first_lowering = mine[0].changed_ms
    call("/ok", user)
    assert [r.changed_ms for r in all_records(user) if r.request_id == "r:l1"] == [
        first_lowering]


def counted(out: str, metric: str) -> float:
    """The sum of ``metric`` over the EMF lines in ``out``."""
    lines = [json.loads(ln) for ln in out.splitlines() if '"_aws"' in ln]
    return sum(sum(line.get(metric, [])) for line in lines)


def test_a_failed_write_is_kept_and_lands_later(env: Any,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """With the usage table unreachable the request still succeeds; its record is kept
    (counted RecordsKept) and written before a later request once DynamoDB answers again."""
    user = uuid.uuid4().hex
    set_usage_store(UsageStore(UsageSettings(table="no-such-table", region="us-east-1")))
    capsys.readouterr()
    assert call("/ok", user, request_id="k1").status == 200
    assert call("/fails", user, request_id="k2").status == 502
    assert records.pending() == 2 and all_records(user) == []
    assert counted(capsys.readouterr().out, "RecordsKept") == 2
    set_usage_store(usage_store())
    assert call("/ok", user, request_id="k3").status == 200
    for _ in range(5):  # each retry has its bound: a loaded machine may need another turn
        if records.pending() == 0:
            break
        call("/ok", user, request_id=f"k4-{uuid.uuid4().hex}")
    got = {r.request_id: (r.state, r.kept) for r in all_records(user)
           if not r.request_id.startswith("r:k4-")}
    assert got == {"r:k1": ("charged", 1), "r:k2": ("refunded", 0), "r:k3": ("charged", 1)}


def test_a_record_kept_past_its_bound_is_lost_and_counted(
        env: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A kept record older than KEEP_S is dropped before the next request: RecordsLost,
    and an error log line naming its request id; the request itself succeeds."""
    user = uuid.uuid4().hex
    set_usage_store(UsageStore(UsageSettings(table="no-such-table", region="us-east-1")))
    assert call("/ok", user, request_id="gone").status == 200
    monkeypatch.setattr(records, "KEEP_S", 0.0)
    set_usage_store(usage_store())
    capsys.readouterr()
    assert call("/ok", user, request_id="next").status == 200
    out = capsys.readouterr().out
    assert counted(out, "RecordsLost") == 1 and "kept usage record expired" in out
    assert [r.request_id for r in all_records(user)] == ["r:next"]


def test_the_statement_pages_and_totals_across_a_month_boundary(env: Any) -> None:
    """Records either side of midnight of 31 October / 1 November come back a page at a
    time, newest first, the first page carrying both days' totals, the others none."""
    user = uuid.uuid4().hex
    nov = 1_793_491_200_000  # 2026-11-01T00:00:00Z
    store = usage_store()
    for i, at in enumerate((nov - 2, nov - 1, nov, nov + 1)):
        store.put(UsageRecord(user, f"m{i}", "n1", "/ok", "free", 3, 3, (), "charged", at))
    store.lower(user, "m2", "n1", 1, "settled", nov + 5)
    query = {"from": "2026-10-31T00:00:00Z", "to": "2026-11-02T00:00:00Z", "limit": "3"}
    first = history(user, **query).body
    assert [r["request_id"] for r in first["records"]] == ["m3", "m2", "m1"]
    assert [(d["day"], d["charges"], d["kept"], d["refunded"]) for d in first["days"]] == [
        ("2026-11-01", 2, 4, 2), ("2026-10-31", 2, 6, 0)]
    second = history(user, **query, cursor=first["cursor"]).body
    assert [r["request_id"] for r in second["records"]] == ["m0"]
    assert second["days"] is None and second["cursor"] is None
    november = history(user, **{**query, "from": "2026-11-01T00:00:00Z"}).body
    assert [r["request_id"] for r in november["records"]] == ["m3", "m2"]


def test_records_survive_flushall(env: Any) -> None:
    """Records live in DynamoDB: a cache loss leaves the statement whole."""
    user = uuid.uuid4().hex
    assert call("/ok", user, request_id="a").status == 200
    env.flushall()
    assert call("/ok", user, request_id="b").status == 200
    assert {r["request_id"] for r in history(user).body["records"]} == {"a", "b"}


def test_a_user_sees_only_their_own_and_bad_queries_are_refused(env: Any) -> None:
    """Another user's statement is empty of the first user's records; a bad from, to or
    cursor is 400 with a message, a bad limit 422."""
    alice, mallory = uuid.uuid4().hex, uuid.uuid4().hex
    assert call("/ok", alice, request_id="mine").status == 200
    assert history(mallory).body["records"] == []
    assert op("GET", f"/admin/v1/users/{alice}/statement").body["records"][0][
        "request_id"] == "mine"
    for query in ({"from": "yesterday"}, {"to": "2026-11-01T00:00:00"},
                  {"from": "2026-11-02T00:00:00Z", "to": "2026-11-01T00:00:00Z"},
                  {"cursor": "garbage"}):
        res = history(alice, **query)
        assert res.status == 400 and res.body["error"]["code"] == "invalid_request", query
        assert res.body["error"]["message"]
    assert history(alice, limit="0").status == 422
