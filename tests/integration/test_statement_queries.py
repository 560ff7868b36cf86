"""Malformed statement queries are the caller's 400, never a 500, on both statement routes:
``GET /v1/usage/history`` (the user's own) and the operator's
``GET /admin/v1/users/{user_id}/statement``.

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
