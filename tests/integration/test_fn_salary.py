"""GET /v1/salary through its Mangum handler, a real redis-server and the emulator."""

from __future__ import annotations

import importlib
import json
import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from local.emulator import EmulatorProcess
from local.lambda_events import Result, http_event, invoke
from local.redis_servers import RedisServer
from tests.ledger import used

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

ROOT = Path(__file__).resolve().parents[2]
ROUTE = "/v1/salary"
COST = 2
APP_KEY = "test-adzuna-key-5f2c"
salary_fn = importlib.import_module("functions.salary.app")
usage_fn = importlib.import_module("functions.usage.app")


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer,
        emulator: EmulatorProcess) -> EmulatorProcess:
    """Real Redis, the emulator as Adzuna, a 100/1h plan, a fast throttle, fresh clients."""
    emulator.reset()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h",
        "SALARY_BASE_URL": emulator.adzuna_base_url,
        "SALARY_APP_ID": "test-app", "SALARY_APP_KEY": APP_KEY,
        "SALARY_RATE": "1000/s",
    }, unset=(
        "ATTO_ENV", "SALARY_SECRET_ARN", "SALARY_BURST", "SALARY_CONCURRENCY",
    ))
    return emulator


def get(user: str, query: dict[str, str], headers: dict[str, str] | None = None) -> Result:
    return invoke(salary_fn.handler,
                  http_event("GET", ROUTE, query=query, user=user, headers=headers))


def arrivals(emu: EmulatorProcess) -> int:
    return int(emu.family_stats("salary")["arrivals"])


def test_distribution_is_plausible_and_costs_2(env: EmulatorProcess,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Bands are contiguous, percentiles ordered inside them, totals agree, for 2 tokens."""
    user = uuid.uuid4().hex
    with caplog.at_level(logging.DEBUG):
        res = get(user, {"title": "python developer", "location": "London"})
    assert res.status == 200, res.body
    out = res.body
    assert (out["title"], out["location"], out["country"]) == ("python developer", "London", "gb")
    assert out["currency"] == "GBP" and out["source"]["name"] == "Adzuna"
    bands = out["histogram"]
    assert len(bands) >= 3
    assert all(a["max"] == b["min"] for a, b in zip(bands, bands[1:], strict=False))
    assert bands[-1]["max"] is None
    assert out["sample_count"] == sum(b["count"] for b in bands) > 0
    p = out["percentiles"]
    assert bands[0]["min"] <= p["p25"] <= p["median"] <= p["p75"] < bands[-1]["min"] * 2
    assert bands[0]["min"] < out["mean"] < bands[-1]["min"] * 2
    assert out["open_positions"] > 0
    assert res.headers["ratelimit"].startswith('"1h";r=98;')
    assert used(user) == COST
    stats = env.family_stats("salary")
    assert stats["arrivals"] == 2 and len(stats["routes"]) == 2
    assert "app_key=***" in caplog.text  # httpx logged the request URL, masked
    assert APP_KEY not in caplog.text


def test_country_sets_currency_and_location_is_optional(env: EmulatorProcess) -> None:
    """Another country answers in its currency; without a location the country is searched."""
    res = get(uuid.uuid4().hex, {"title": "nurse", "country": "de"})
    assert res.status == 200, res.body
    assert res.body["currency"] == "EUR" and res.body["location"] is None
    assert res.body["source"]["url"] == "https://www.adzuna.de"


def test_no_matching_ads_is_an_empty_distribution(env: EmulatorProcess) -> None:
    """A title nothing matches gives an empty histogram and null figures, still charged."""
    user = uuid.uuid4().hex
    res = get(user, {"title": "nojobs whatsoever"})
    assert res.status == 200, res.body
    assert res.body["histogram"] == [] and res.body["sample_count"] == 0
    assert res.body["percentiles"] == {"p25": None, "median": None, "p75": None}
    assert res.body["mean"] is None and res.body["open_positions"] == 0
    assert used(user) == COST


@pytest.mark.parametrize("query", [
    {},                                                   # no title
    {"title": ""},                                        # empty title
    {"title": "   "},                                     # blank title
    {"title": "x" * 101},                                 # title too long
    {"title": "nurse\x00"},                               # control character
    {"title": "nurse", "location": ""},                   # empty location
    {"title": "nurse", "country": "xx"},                  # unsupported country
    {"title": "nurse", "country": "GB"},                  # codes are lower case
    {"title": "nurse", "page": "2"},                      # unknown parameter
])
def test_bad_query_is_422_and_free(env: EmulatorProcess, query: dict[str, str]) -> None:
    """Invalid queries get 422 invalid_request, reach no provider and cost nothing."""
    user = uuid.uuid4().hex
    res = get(user, query)
    assert res.status == 422 and res.body["error"]["code"] == "invalid_request"
    assert used(user) == 0
    assert arrivals(env) == 0


def test_upstream_failure_is_502_and_refunded(env: EmulatorProcess) -> None:
    """An upstream 500 becomes 502 provider_error and the tokens come back."""
    user = uuid.uuid4().hex
    env.fail_next(1, 500, family="salary")
    res = get(user, {"title": "accountant"})
    assert res.status == 502 and res.body["error"]["code"] == "provider_error"
    assert res.headers["ratelimit"].startswith('"1h";r=100;')
    assert used(user) == 0


def test_missing_credentials_are_502_refunded_and_call_nothing(
        env: EmulatorProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without app_id/app_key the request is 502 provider_error before any upstream call."""
    monkeypatch.delenv("SALARY_APP_KEY")
    user = uuid.uuid4().hex
    res = get(user, {"title": "accountant"})
    assert res.status == 502 and res.body["error"]["code"] == "provider_error"
    assert used(user) == 0 and arrivals(env) == 0


def test_upstream_429_pauses_and_retries(env: EmulatorProcess) -> None:
    """An upstream 429 with Retry-After pauses the provider; the retry succeeds, charged once."""
    user = uuid.uuid4().hex
    env.fail_next(1, 429, family="salary", retry_after_s=1)
    res = get(user, {"title": "teacher", "location": "Leeds"})
    assert res.status == 200, res.body
    stats = env.family_stats("salary")
    assert stats["rate_limited"] == 1
    assert stats["arrivals"] == 3  # histogram and search, one of them twice
    assert sorted(stats["routes"].values()) == [1, 2]
    assert used(user) == COST


def test_idempotent_repeat_replays_and_is_charged_once(env: EmulatorProcess) -> None:
    """The same Idempotency-Key replays the stored answer: one charge, no second call."""
    user, key = uuid.uuid4().hex, str(uuid.uuid4())
    query = {"title": "data engineer", "location": "Bristol"}
    first = get(user, query, {"Idempotency-Key": key})
    second = get(user, query, {"Idempotency-Key": key})
    assert first.status == second.status == 200
    assert second.body == first.body and second.headers["idempotent-replayed"] == "true"
    assert arrivals(env) == 2
    assert used(user) == COST
    other = get(user, {"title": "chef"}, {"Idempotency-Key": key})
    assert other.status == 422 and other.body["error"]["code"] == "idempotency_key_reused"
    assert used(user) == COST


def test_event_file_invokes_the_function(env: EmulatorProcess) -> None:
    """events/salary.json runs through the handler as `sam local invoke` would."""
    event = json.loads((ROOT / "events" / "salary.json").read_text())
    res = invoke(salary_fn.handler, event)
    assert res.status == 200, res.body
    assert res.body["title"] == event["queryStringParameters"]["title"]
    assert res.body["histogram"]
