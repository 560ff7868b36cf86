"""POST /v1/market-context through its Mangum handler, a real redis-server and the emulator."""

from __future__ import annotations

import importlib
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from local.emulator import EmulatorProcess
from local.lambda_events import Result, http_event, invoke
from local.redis_servers import RedisServer
from tests.ledger import used

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

ROOT = Path(__file__).resolve().parents[2]
ROUTE = "/v1/market-context"
COST = 30
market_fn = importlib.import_module("functions.market_context.app")
usage_fn = importlib.import_module("functions.usage.app")


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer,
        emulator: EmulatorProcess) -> EmulatorProcess:
    """Real Redis, the emulator as Adzuna and the LLM, a 100/1h plan, fresh clients."""
    emulator.reset()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h",
        "SALARY_BASE_URL": emulator.adzuna_base_url,
        "SALARY_APP_ID": "test-app", "SALARY_APP_KEY": "test-key",
        "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "test-key",
        "SALARY_RATE": "1000/s", "LLM_RATE": "1000/s",
    }, unset=(
        "ATTO_ENV", "SALARY_SECRET_ARN", "LLM_SECRET_ARN", "SALARY_BURST",
        "SALARY_CONCURRENCY", "LLM_BURST", "LLM_CONCURRENCY",
    ))
    return emulator


def post(user: str, body: Any, headers: dict[str, str] | None = None) -> Result:
    return invoke(market_fn.handler,
                  http_event("POST", ROUTE, body=body, user=user, headers=headers))


def arrivals(emu: EmulatorProcess, family: str) -> int:
    return int(emu.family_stats(family)["arrivals"])


def test_context_has_demand_trend_and_narrative_for_30(env: EmulatorProcess) -> None:
    """Open positions, 12 ordered months, a 2-4 sentence narrative and sources, for 30 tokens."""
    user = uuid.uuid4().hex
    res = post(user, {"role": "data engineer", "location": "London"})
    assert res.status == 200, res.body
    out = res.body
    assert (out["role"], out["location"], out["country"], out["currency"]) == (
        "data engineer", "London", "gb", "GBP")
    assert out["demand"]["open_positions"] > 0 and out["demand"]["mean_salary"] > 0
    months = [p["month"] for p in out["salary_trend"]]
    assert len(months) == 12 and months == sorted(months) and len(set(months)) == 12
    assert all(p["mean"] > 0 for p in out["salary_trend"])
    first, last = out["salary_trend"][0]["mean"], out["salary_trend"][-1]["mean"]
    assert out["demand"]["salary_change_pct"] == round((last - first) / first * 100, 1)
    assert out["narrative"].strip()
    assert [s["used_for"] for s in out["sources"]][-1] == "narrative"
    assert out["sources"][0]["name"] == "Adzuna"
    assert res.headers["ratelimit"].startswith('"1h";r=70;')
    assert used(user) == COST
    assert arrivals(env, "salary") == 2 and arrivals(env, "llm") == 1


def test_unknown_role_gets_a_fixed_narrative_without_the_model(env: EmulatorProcess) -> None:
    """With no ads and no history the model is not called and the charge settles to 2."""
    user = uuid.uuid4().hex
    res = post(user, {"role": "nojobs at all", "country": "us"})
    assert res.status == 200, res.body
    assert res.body["demand"] == {"open_positions": 0, "mean_salary": None,
                                  "salary_change_pct": None}
    assert res.body["salary_trend"] == [] and "no open positions" in res.body["narrative"]
    assert [s["name"] for s in res.body["sources"]] == ["Adzuna"]
    assert arrivals(env, "llm") == 0
    assert used(user) == market_fn.NO_DATA_COST


@pytest.mark.parametrize("body", [
    {},                                                   # no role
    {"role": ""},                                         # empty role
    {"role": "   "},                                      # blank role
    {"role": "x" * 101},                                  # role too long
    {"role": 7},                                          # not a string
    {"role": "nurse", "location": ""},                    # empty location
    {"role": "nurse", "country": "xx"},                   # unsupported country
    {"role": "nurse", "months": 6},                       # unknown field
    ["nurse"],                                            # not an object
])
def test_bad_input_is_422_and_free(env: EmulatorProcess, body: Any) -> None:
    """Invalid bodies get 422 invalid_request, reach no provider and cost nothing."""
    user = uuid.uuid4().hex
    res = post(user, body)
    assert res.status == 422 and res.body["error"]["code"] == "invalid_request"
    assert used(user) == 0
    assert arrivals(env, "salary") == arrivals(env, "llm") == 0


@pytest.mark.parametrize("family", ["salary", "llm"])
def test_upstream_failure_is_502_and_refunded(env: EmulatorProcess, family: str) -> None:
    """A 500 from the jobs API or the model becomes 502 provider_error, fully refunded."""
    user = uuid.uuid4().hex
    env.fail_next(1, 500, family=family)
    res = post(user, {"role": "accountant", "location": "Leeds"})
    assert res.status == 502 and res.body["error"]["code"] == "provider_error"
    assert res.headers["ratelimit"].startswith('"1h";r=100;')
    assert used(user) == 0
    if family == "salary":
        assert arrivals(env, "llm") == 0  # no narrative without the figures


def test_upstream_429_pauses_and_retries(env: EmulatorProcess) -> None:
    """A model 429 with Retry-After pauses the provider; the retry succeeds, charged once."""
    user = uuid.uuid4().hex
    env.fail_next(1, 429, family="llm", retry_after_s=1)
    res = post(user, {"role": "software engineer", "location": "Manchester"})
    assert res.status == 200, res.body
    stats = env.family_stats("llm")
    assert stats["arrivals"] == 2 and stats["rate_limited"] == 1
    assert arrivals(env, "salary") == 2
    assert used(user) == COST


def test_idempotent_repeat_replays_and_is_charged_once(env: EmulatorProcess) -> None:
    """The same Idempotency-Key replays the stored answer: one charge, no second call."""
    user, key = uuid.uuid4().hex, str(uuid.uuid4())
    body = {"role": "product manager", "location": "Edinburgh"}
    first = post(user, body, {"Idempotency-Key": key})
    second = post(user, body, {"Idempotency-Key": key})
    assert first.status == second.status == 200
    assert second.body == first.body and second.headers["idempotent-replayed"] == "true"
    assert arrivals(env, "salary") == 2 and arrivals(env, "llm") == 1
    assert used(user) == COST
    other = post(user, {"role": "chef"}, {"Idempotency-Key": key})
    assert other.status == 422 and other.body["error"]["code"] == "idempotency_key_reused"
    assert used(user) == COST


def test_event_file_invokes_the_function(env: EmulatorProcess) -> None:
    """events/market_context.json runs through the handler as `sam local invoke` would."""
    event = json.loads((ROOT / "events" / "market_context.json").read_text())
    res = invoke(market_fn.handler, event)
    assert res.status == 200, res.body
    assert res.body["role"] == json.loads(event["body"])["role"] and res.body["narrative"]
