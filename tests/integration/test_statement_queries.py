"""Statement queries on both statement routes: ``GET /v1/usage/history`` (the user's own)
and the operator's ``GET /admin/v1/users/{user_id}/statement``. Malformed queries are the
caller's 400, never a 500; a cursor carries its statement's span, so every page of one
statement covers the span its first page fixed (another span is 400); ``days`` lists every
UTC day of the span and ``summary`` separates what was charged, given back and kept.

Through the real handlers, over real Redis and moto DynamoDB. Hypothesis generates cursors
(random text, random base64, JSON nested past the parser's stack, well-formed JSON with
keys out of range) and instants (any text, and RFC 3339 times near the ends of what
Python and RFC 3339 can write, with zone offsets that carry them past 9999-12-31 or
before 1970 in UTC).
"""

from __future__ import annotations

import base64
import importlib
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moto import mock_aws

from local.lambda_events import http_event, invoke
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore
from usage_limits.entitlements.usage import UsageRecord
from usage_limits.entitlements.usage_store import UsageSettings, UsageStore, set_usage_store

if TYPE_CHECKING:
    from local.lambda_events import Result
    from tests.conftest import RedisServer, StartEnvironment

admin = importlib.import_module("functions.admin.app")
usage_fn = importlib.import_module("functions.usage.app")
OPERATOR = "arn:aws:sts::123456789012:assumed-role/atto-operators/jane"
TABLE, USAGE = "entitlements-queries", "usage-queries"
USER = "statement-queries-user"


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer) -> Iterator[None]:
    """A Lambda environment over real Redis and moto tables."""
    with mock_aws():
        lambda_env({
            "REDIS_URL": redis_server.url, "REDIS_CLUSTER": "false",
            "ATTO_PLANS": "free=40/1h,4/30d", "ATTO_DEFAULT_PLAN": "free",
            "ATTO_ENTITLEMENTS_TABLE": TABLE, "ATTO_USAGE_TABLE": USAGE,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing"},
            unset=("ATTO_ENV", "ATTO_DYNAMODB_ENDPOINT", "ATTO_BUDGET", "AWS_PROFILE",
                   "ATTO_USAGE_RECORDS_DAYS"))
        EntitlementStore(StoreSettings(table=TABLE, region="us-east-1")).create_table()
        UsageStore(UsageSettings(table=USAGE, region="us-east-1")).create_table()
        try:
            yield
        finally:
            set_usage_store(None)


def history(query: dict[str, str], user: str = USER) -> Result:
    """The user's own statement."""
    return invoke(usage_fn.handler, http_event("GET", "/v1/usage/history", user=user,
                                               query=query))


def statement(query: dict[str, str], user: str = USER) -> Result:
    """The operator's statement of the same user, signed as an IAM principal."""
    event = http_event("GET", f"/admin/v1/users/{user}/statement", body=None, user=None,
                       query=query)
    event["requestContext"]["authorizer"] = {"iam": {"userArn": OPERATOR}}
    return invoke(admin.handler, event)


ROUTES = [pytest.param(history, id="history"), pytest.param(statement, id="statement")]


def b64(raw: bytes) -> str:
    """``raw`` as a cursor is written: URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def nested(depth: int) -> str:
    """A cursor whose JSON nests ``depth`` arrays inside its ``s``."""
    return b64(('{"s":' + "[" * depth + "]" * depth + ',"a":1}').encode())


#: Cursors no answer of the API ever held.
CURSORS = st.one_of(
    st.text(max_size=60),
    st.binary(max_size=60).map(b64),
    st.integers(min_value=1, max_value=200_000).map(nested),
    st.builds(lambda s, a: b64(json.dumps({"s": s, "a": a}).encode()),
              st.one_of(st.text(max_size=5), st.integers(), st.none(),
                        st.text(min_size=1025, max_size=1100)),
              st.one_of(st.integers(max_value=-1), st.integers(min_value=2 ** 53),
                        st.floats(), st.text(max_size=5), st.booleans())),
)

#: Zone offsets RFC 3339 can write (under a day).
OFFSETS = st.integers(min_value=-(24 * 60 - 1), max_value=24 * 60 - 1).map(
    lambda minutes: timezone(timedelta(minutes=minutes)))
#: Instants near the ends of Python's calendar, where an offset moves them out of range.
EDGES = st.one_of(
    st.datetimes(min_value=datetime(9999, 12, 30), timezones=OFFSETS),
    st.datetimes(max_value=datetime(1, 1, 2), timezones=OFFSETS),
    st.datetimes(min_value=datetime(1969, 12, 31), max_value=datetime(1970, 1, 2),
                 timezones=OFFSETS),
).map(lambda moment: moment.isoformat())
INSTANTS = st.one_of(EDGES, st.text(max_size=40))


def refused(res: Result) -> None:
    """The answer is the caller's 400 with a message saying what is wrong."""
    assert res.status == 400, (res.status, res.body)
    assert res.body["error"]["code"] == "invalid_request"
    assert res.body["error"]["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_a_cursor_nested_past_the_parsers_stack_is_400(env: None, route: Any) -> None:
    """A cursor of JSON nested 100,000 deep is 400 naming the cursor, not a 500."""
    res = route({"cursor": nested(100_000)})
    refused(res)
    assert "cursor" in res.body["error"]["message"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", ["to", "from"])
def test_an_instant_past_the_year_9999_in_utc_is_400(env: None, route: Any,
                                                     name: str) -> None:
    """``to`` or ``from`` of 9999-12-31T23:59:59-01:00 (the year 10000 in UTC) is 400
    naming the parameter, not a 500."""
    query = {name: "9999-12-31T23:59:59-01:00"}
    if name == "from":
        query["to"] = "9999-12-31T23:59:59.999Z"
    res = route(query)
    refused(res)
    assert res.body["error"]["message"].startswith(name)


@pytest.mark.parametrize("route", ROUTES)
def test_the_last_instant_rfc_3339_can_write_is_served(env: None, route: Any) -> None:
    """``to`` = 9999-12-31T23:59:59.999Z is a valid end: the statement echoes it."""
    res = route({"to": "9999-12-31T23:59:59.999Z"})
    assert res.status == 200, res.body
    assert res.body["to"] == "9999-12-31T23:59:59.999Z"


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cursor=st.none() | CURSORS, from_=st.none() | INSTANTS, to=st.none() | INSTANTS)
def test_malformed_cursors_and_instants_are_400_never_500(env: None, route: Any,
                                                          cursor: str | None,
                                                          from_: str | None,
                                                          to: str | None) -> None:
    """Any cursor, ``from`` and ``to``: a statement (200) or the caller's 400; a cursor the
    API never returned is always refused."""
    query = {k: v for k, v in (("cursor", cursor), ("from", from_), ("to", to))
             if v is not None}
    res = route(query)
    if cursor is not None or res.status != 200:
        refused(res)
    else:
        assert res.body["from"].endswith("Z") and res.body["to"].endswith("Z")


@pytest.mark.parametrize("route", ROUTES)
def test_the_cursor_an_answer_returned_is_accepted(env: None, route: Any) -> None:
    """The cursor a first page returns gives the next page (the refusals above are of
    cursors the API never wrote)."""
    store = UsageStore(UsageSettings(table=USAGE, region="us-east-1"))
    user = uuid.uuid4().hex
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    for i in range(3):
        store.put(UsageRecord(user_id=user, request_id=f"r:q{i}", nonce=f"n{i}",
                              route="/ok", plan="free", cost=1, kept=1, at_ms=now_ms - i))
    first = route({"limit": "2"}, user)
    assert first.status == 200 and first.body["cursor"], first.body
    second = route({"limit": "2", "cursor": first.body["cursor"]}, user)
    assert second.status == 200 and [r["request_id"] for r in second.body["records"]] == ["q2"]


# --- the span a cursor carries, every day of it, and the summary ------------------------------

def put(store: UsageStore, user: str, rid: str, at_ms: int, cost: int, kept: int | None = None,
        state: str = "charged", credit: int = 0) -> None:
    """A usage record of ``user`` (as the request path writes it)."""
    kept = cost if kept is None else kept
    store.put(UsageRecord(user_id=user, request_id=f"r:{rid}", nonce="n1", route="/ok",
                          plan="free", cost=cost, kept=kept,
                          draws=(("g1", credit),) if credit else (),
                          state=state, at_ms=at_ms,  # type: ignore[arg-type]
                          changed_ms=None if state == "charged" else at_ms + 1))


def usage_store() -> UsageStore:
    return UsageStore(UsageSettings(table=USAGE, region="us-east-1"))


def ms(text: str) -> int:
    """An RFC 3339 instant of an answer, ms since the epoch."""
    return int(datetime.fromisoformat(text).timestamp() * 1000)


def pages(route: Any, user: str, first: dict[str, Any],
          query: dict[str, str]) -> list[dict[str, Any]]:
    """Every page after ``first``, following cursors with ``query`` (and the cursor)."""
    out, cursor = [], first["cursor"]
    while cursor:
        res = route({**query, "cursor": cursor}, user)
        assert res.status == 200, res.body
        out.append(res.body)
        cursor = res.body["cursor"]
    return out


@pytest.mark.parametrize("route", ROUTES)
def test_a_cursor_keeps_the_span_of_its_first_page(env: None, route: Any) -> None:
    """Without from/to, the first page fixes the span (to = now) and its cursor carries it:
    every later page answers the same from and to, and a record made at the span's very
    start after the first page was served is on the last page (a span recomputed from a
    later now would have moved past it)."""
    store, user = usage_store(), uuid.uuid4().hex
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    for i in range(3):
        put(store, user, f"p{i}", now_ms - 10 - i, cost=1)
    first = route({"limit": "1"}, user)
    assert first.status == 200 and first.body["cursor"], first.body
    put(store, user, "edge", ms(first.body["from"]), cost=1)  # at from: inclusive
    rest = pages(route, user, first.body, {"limit": "1"})
    assert {(p["from"], p["to"]) for p in rest} == {(first.body["from"], first.body["to"])}
    assert [r["request_id"] for p in [first.body, *rest] for r in p["records"]] == [
        "p0", "p1", "p2", "edge"]
    assert all(p["days"] is None and p["summary"] is None for p in rest)


@pytest.mark.parametrize("route", ROUTES)
def test_a_cursor_used_with_another_span_is_400(env: None, route: Any) -> None:
    """A cursor asked with another from or to is 400 naming the span it belongs to; with its
    own from/to, or only one of them, or neither, it gives the next page."""
    store, user = usage_store(), uuid.uuid4().hex
    for i in range(2):
        put(store, user, f"s{i}", T_NOV + DAY_MS + i, cost=1)
    span = {"from": "2026-11-01T00:00:00Z", "to": "2026-11-04T00:00:00Z"}
    first = route({**span, "limit": "1"}, user).body
    cursor = first["cursor"]
    for other in ({"to": "2026-11-05T00:00:00Z"}, {"from": "2026-10-31T00:00:00Z"},
                  {**span, "to": "2026-11-03T23:59:59.999Z"}):
        res = route({"cursor": cursor, **other}, user)
        refused(res)
        assert res.body["error"]["message"] == (
            "cursor belongs to the statement from 2026-11-01T00:00:00.000Z to "
            "2026-11-04T00:00:00.000Z: ask with that from/to, or with none")
    for same in (span, {"from": span["from"]}, {"to": "2026-11-04T01:00:00+01:00"}, {}):
        res = route({"cursor": cursor, **same}, user)
        assert res.status == 200, (same, res.body)
        assert [r["request_id"] for r in res.body["records"]] == ["s0"]
        assert (res.body["from"], res.body["to"]) == (first["from"], first["to"])


T_NOV = 1_793_491_200_000  # 2026-11-01T00:00:00Z
DAY_MS = 86_400_000
ZERO = {"charges": 0, "reserved": 0, "refunds": 0, "refunded": 0, "kept": 0, "credit": 0}


@pytest.mark.parametrize("route", ROUTES)
def test_days_are_every_day_of_the_span_and_the_summary_separates_refunds(
        env: None, route: Any) -> None:
    """A span of 1 November to 4 November 12:00 lists four days, the three without records
    with zeros. The summary (and the day) counts a charge kept whole, one settled, one
    refunded automatically (its request failed) and one support refunded as four charges,
    two of them refunds, and separates the tokens reserved, given back and kept."""
    store, user = usage_store(), uuid.uuid4().hex
    day = T_NOV + DAY_MS
    put(store, user, "whole", day + 1, cost=8, credit=8)
    put(store, user, "settled", day + 2, cost=8, kept=5, state="settled")
    put(store, user, "failed", day + 3, cost=8, kept=0, state="refunded")
    put(store, user, "support", day + 4, cost=4, kept=0, state="support-refunded")
    put(store, user, "after", T_NOV + 4 * DAY_MS + 12 * 3_600_000, cost=1)  # at to: outside
    res = route({"from": "2026-11-01T00:00:00Z", "to": "2026-11-04T12:00:00Z"}, user)
    assert res.status == 200, res.body
    body = res.body
    summary = {"charges": 4, "reserved": 28, "refunds": 2, "refunded": 15, "kept": 13,
               "credit": 8}
    assert body["days"] == [{"day": "2026-11-04", **ZERO}, {"day": "2026-11-03", **ZERO},
                            {"day": "2026-11-02", **summary}, {"day": "2026-11-01", **ZERO}]
    assert body["summary"] == summary
    assert [r["state"] for r in body["records"]] == [
        "support-refunded", "refunded", "settled", "charged"]


RECORDS = st.lists(st.tuples(st.integers(min_value=-2 * DAY_MS, max_value=5 * DAY_MS),
                             st.integers(min_value=1, max_value=9),
                             st.sampled_from(["charged", "settled", "refunded",
                                              "support-refunded"])),
                   max_size=8)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=RECORDS, limit=st.integers(min_value=1, max_value=4),
       span_days=st.integers(min_value=1, max_value=3), route=st.sampled_from([history,
                                                                               statement]))
def test_the_pages_of_a_statement_are_its_span_once_and_sum_to_its_summary(
        env: None, records: list[tuple[int, int, str]], limit: int, span_days: int,
        route: Any) -> None:
    """Any records around a span, any page size: following the cursors (without from/to)
    gives every record of the span once, newest first, and none outside it; the days are
    the span's days and sum to the summary, which counts what the records hold."""
    store, user = usage_store(), uuid.uuid4().hex
    to_ms = T_NOV + span_days * DAY_MS
    made = []
    for i, (offset, cost, state) in enumerate(records):
        kept = {"charged": cost, "settled": cost - 1, "refunded": 0,
                "support-refunded": 0}[state]
        if state == "settled" and kept == 0:
            state, kept = "refunded", 0
        at = T_NOV + offset
        put(store, user, f"h{i}", at, cost=cost, kept=kept, state=state)
        made.append((at, f"h{i}", cost, kept, state))
    query = {"from": "2026-11-01T00:00:00Z", "to": datetime.fromtimestamp(
        to_ms / 1000, UTC).isoformat(), "limit": str(limit)}
    first = route(query, user).body
    rest = pages(route, user, first, {"limit": str(limit)})
    seen = [r["request_id"] for p in [first, *rest] for r in p["records"]]
    inside = sorted((m for m in made if T_NOV <= m[0] < to_ms), reverse=True)
    assert sorted(seen) == sorted(m[1] for m in inside) and len(seen) == len(set(seen))
    assert [ms(r["at"]) for p in [first, *rest] for r in p["records"]] == [m[0] for m in inside]
    assert [d["day"] for d in first["days"]] == [
        datetime.fromtimestamp((T_NOV + i * DAY_MS) / 1000, UTC).strftime("%Y-%m-%d")
        for i in reversed(range(span_days))]
    summary = first["summary"]
    assert {k: sum(d[k] for d in first["days"]) for k in ZERO} == summary
    assert summary == {"charges": len(inside), "reserved": sum(m[2] for m in inside),
                       "refunds": sum(m[4] != "charged" and m[3] == 0 for m in inside),
                       "refunded": sum(m[2] - m[3] for m in inside),
                       "kept": sum(m[3] for m in inside), "credit": 0}
