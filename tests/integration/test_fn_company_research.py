"""POST /v1/company-research through its Mangum handler, a real redis-server and the emulator."""

from __future__ import annotations

import importlib
import logging
import uuid
from typing import TYPE_CHECKING, Any

import pytest

import atto_providers.search as search
from local.emulator import EmulatorProcess
from local.lambda_events import Result, fresh_environment, http_event, invoke
from local.redis_servers import RedisServer
from tests.ledger import used

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

ROUTE = "/v1/company-research"
COST = 20


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer,
        emulator: EmulatorProcess) -> EmulatorProcess:
    """Provider URLs and keys pointing at the emulator, fast throttles, fresh clients."""
    emulator.reset()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "1000/1h",
        "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "test-llm-key",
        "SEARCH_BASE_URL": emulator.tavily_base_url, "SEARCH_API_KEY": "test-search-key",
        "LLM_RATE": "1000/s", "SEARCH_RATE": "1000/s",
    }, unset=(
        "ATTO_ENV", "LLM_SECRET_ARN", "SEARCH_SECRET_ARN", "SEARCH_BURST",
        "SEARCH_CONCURRENCY",
    ))
    return emulator


@pytest.fixture
def handler(env: EmulatorProcess) -> Any:
    """The function's Mangum handler."""
    return importlib.import_module("functions.company_research.app").handler


def post(handler: Any, body: Any, *, user: str,
         headers: dict[str, str] | None = None) -> Result:
    return invoke(handler, http_event("POST", ROUTE, body=body, user=user, headers=headers))


def arrivals(emu: EmulatorProcess, family: str) -> int:
    return int(emu.family_stats(family)["arrivals"])


def user_id() -> str:
    return uuid.uuid4().hex


def test_brief_cites_its_sources_and_costs_20(handler: Any, env: EmulatorProcess) -> None:
    """A brief has a summary, facts that each cite one of its sources, and costs 20 tokens."""
    user = user_id()
    res = post(handler, {"company": "Northwind Analytics"}, user=user)
    assert res.status == 200, res.body
    brief = res.body
    assert brief["company"] == "Northwind Analytics"
    assert brief["summary"] and brief["model"]
    assert 1 <= len(brief["sources"]) <= 6
    urls = [s["url"] for s in brief["sources"]]
    assert len(set(urls)) == len(urls)
    assert all(u.startswith(env.url + "/pages/") and s["title"]
               for u, s in zip(urls, brief["sources"], strict=True))
    assert all(f["fact"] and f["source_url"] in urls for f in brief["key_facts"])
    facts = [f["fact"].casefold() for f in brief["key_facts"]]
    assert len(set(facts)) == len(facts)
    assert used(user) == COST
    assert arrivals(env, "search") == 1 and arrivals(env, "llm") == 1


def test_website_narrows_the_search(handler: Any, env: EmulatorProcess) -> None:
    """An optional website is accepted and the brief still cites search results."""
    user = user_id()
    body = {"company": "Bluefin Robotics", "website": "https://www.bluefin.example/about"}
    res = post(handler, body, user=user)
    assert res.status == 200, res.body
    assert res.body["sources"] and used(user) == COST


@pytest.mark.parametrize("body", [
    {}, {"company": ""}, {"company": "   "}, {"company": "x" * 201}, {"company": 7},
    {"company": "Acme", "website": "ftp://acme.example"},
    {"company": "Acme", "website": "not a url"}, {"company": "Acme", "website": "http://10/"},
    {"company": "Acme", "extra": True}, ["Acme"],
])
def test_bad_bodies_are_422_and_charge_nothing(handler: Any, env: EmulatorProcess,
                                               body: Any) -> None:
    """Missing, blank, over-long or unknown fields and non-http websites are 422, free."""
    user = user_id()
    res = post(handler, body, user=user)
    assert res.status == 422 and res.body["error"]["code"] == "invalid_request"
    assert used(user) == 0 and arrivals(env, "search") == 0


def test_search_failure_is_502_and_refunded(handler: Any, env: EmulatorProcess) -> None:
    """The search provider's 500 is a provider_error; the model is not called; tokens return."""
    env.fail_next(1, 500, family="search")
    user = user_id()
    res = post(handler, {"company": "Acme Logistics"}, user=user)
    assert res.status == 502
    assert res.body["error"]["code"] == "provider_error"
    assert res.body["error"]["provider"] == "search"
    assert res.headers["ratelimit"].startswith('"1h";r=1000;')
    assert arrivals(env, "llm") == 0 and used(user) == 0


def test_llm_failure_is_502_and_refunded(handler: Any, env: EmulatorProcess) -> None:
    """The model's 500 after a good search is a provider_error and the tokens come back."""
    env.fail_next(1, 500, family="llm")
    user = user_id()
    res = post(handler, {"company": "Acme Logistics"}, user=user)
    assert res.status == 502 and res.body["error"]["provider"] == "llm"
    assert used(user) == 0


def test_search_429_is_paused_and_retried(handler: Any, env: EmulatorProcess) -> None:
    """A search 429 pauses the provider for every instance; the retry then succeeds."""
    env.fail_next(1, 429, family="search", retry_after_s=0.2)
    user = user_id()
    res = post(handler, {"company": "Cobalt Fintech"}, user=user)
    assert res.status == 200, res.body
    stats = env.family_stats("search")
    assert stats["arrivals"] == 2 and stats["status_counts"] == {"200": 1, "429": 1}
    assert used(user) == COST


def test_missing_search_key_is_502_without_a_call(handler: Any, env: EmulatorProcess,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Without search credentials the request fails as provider_error before any call."""
    monkeypatch.delenv("SEARCH_API_KEY")
    fresh_environment()
    user = user_id()
    res = post(handler, {"company": "Acme Logistics"}, user=user)
    assert res.status == 502 and res.body["error"]["provider"] == "search"
    assert arrivals(env, "search") == 0 and used(user) == 0


def test_keys_are_never_logged(handler: Any, env: EmulatorProcess,
                               caplog: pytest.LogCaptureFixture) -> None:
    """Nothing logged during a request, at any level, contains a provider key."""
    caplog.set_level(logging.DEBUG)
    env.fail_next(1, 429, family="search", retry_after_s=0.1)
    assert post(handler, {"company": "Quillon Media"}, user=user_id()).status == 200
    assert caplog.records
    assert "test-search-key" not in caplog.text and "test-llm-key" not in caplog.text


def test_no_results_settles_to_the_search_cost(handler: Any, env: EmulatorProcess,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """When the search finds nothing, the model is not called and only the search is charged."""
    async def nothing(self: Any, query: str, **kwargs: Any) -> list[Any]:
        return []

    monkeypatch.setattr(search.SearchClient, "search", nothing)
    app = importlib.import_module("functions.company_research.app")
    user = user_id()
    res = post(handler, {"company": "Nonexistent Widgets"}, user=user)
    assert res.status == 200, res.body
    assert res.body["sources"] == [] and res.body["key_facts"] == []
    assert res.body["model"] is None and "Nonexistent Widgets" in res.body["summary"]
    assert used(user) == app.SEARCH_ONLY_COST
    assert arrivals(env, "llm") == 0


def test_repeat_with_the_same_key_is_charged_once(handler: Any, env: EmulatorProcess) -> None:
    """The same Idempotency-Key replays the stored brief: one charge, one search, one call."""
    user, key = user_id(), str(uuid.uuid4())
    body = {"company": "Meridian Software"}
    first = post(handler, body, user=user, headers={"Idempotency-Key": key})
    second = post(handler, body, user=user, headers={"Idempotency-Key": key})
    assert first.status == 200 and second.status == 200
    assert second.headers.get("idempotent-replayed") == "true"
    assert second.body == first.body
    assert arrivals(env, "search") == 1 and arrivals(env, "llm") == 1
    assert used(user) == COST


def test_same_key_for_another_company_is_422(handler: Any, env: EmulatorProcess) -> None:
    """Reusing a key for a different company is 422 idempotency_key_reused, charged nothing
    more."""
    user, key = user_id(), str(uuid.uuid4())
    assert post(handler, {"company": "Oakridge Retail"}, user=user,
                headers={"Idempotency-Key": key}).status == 200
    res = post(handler, {"company": "Pinecrest Labs"}, user=user,
               headers={"Idempotency-Key": key})
    assert res.status == 422 and res.body["error"]["code"] == "idempotency_key_reused"
    assert arrivals(env, "search") == 1 and used(user) == COST
