"""The emulator's named failures (``fail_next`` ``kind``) answer as the real APIs do, and the
functions turn each into its own error, through the Mangum handlers and a real redis-server."""

from __future__ import annotations

import importlib
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from local.emulator import EmulatorProcess
from local.lambda_events import FakeContext, http_event, invoke
from local.redis_servers import RedisServer
from tests.ledger import used

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

structured = importlib.import_module("functions.structured.app")
research = importlib.import_module("functions.company_research.app")
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}},
          "required": ["title"], "additionalProperties": False}


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer,
        emulator: EmulatorProcess) -> EmulatorProcess:
    """Both providers at the emulator, real Redis, fast throttles."""
    emulator.reset()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "1000/1h",
        "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "test-key",
        "SEARCH_BASE_URL": emulator.tavily_base_url, "SEARCH_API_KEY": "test-search-key",
        "LLM_RATE": "1000/s", "SEARCH_RATE": "1000/s",
    }, unset=("ATTO_ENV", "LLM_SECRET_ARN", "SEARCH_SECRET_ARN"))
    return emulator


def ask(user: str) -> Any:
    return invoke(structured.handler, http_event(
        "POST", "/v1/structured", user=user,
        body={"prompt": "Data engineer at Cobalt", "schema": SCHEMA}), FakeContext(timeout_s=5))


@pytest.mark.parametrize(("kind", "status", "code"), [
    ("quota", 503, "provider_quota_exceeded"),
    ("invalid_key", 502, "provider_error"),
    ("model_not_found", 502, "provider_error"),
    ("schema_rejected", 422, "schema_rejected"),
    ("refusal", 422, "model_refused"),
    ("length", 502, "output_truncated"),
    ("content_filter", 422, "content_filtered"),
    ("nonconforming", 502, "provider_error")])
def test_each_llm_failure_has_its_answer(env: EmulatorProcess, kind: str, status: int,
                                         code: str) -> None:
    """Each named LLM failure reaches the caller as its own code, and the tokens come back."""
    env.fail_next(2 if kind == "schema_rejected" else 1, family="llm", kind=kind)
    user = uuid.uuid4().hex
    res = ask(user)
    assert (res.status, res.body["error"]["code"]) == (status, code), res.body
    assert used(user) == 0
    # A quota refusal is called once; a rejected strict schema is asked once more, plain.
    expected = 2 if kind == "schema_rejected" else 1
    assert env.family_stats("llm")["arrivals"] == expected


def test_retry_after_ms_is_waited_and_retried(env: EmulatorProcess) -> None:
    """A 429 that says 50 ms in retry-after-ms only is waited out and retried: a 200."""
    env.fail_next(1, family="llm", kind="retry_after_ms", retry_after_s=0.05)
    user = uuid.uuid4().hex
    res = ask(user)
    assert res.status == 200, res.body
    assert env.family_stats("llm")["status_counts"] == {"200": 1, "429": 1}


@pytest.mark.parametrize("kind", ["plan_limit", "paygo_limit"])
def test_tavily_limits_are_quota(env: EmulatorProcess, kind: str) -> None:
    """Tavily's 432/433 are 503 provider_quota_exceeded after one call, and refunded."""
    env.fail_next(1, family="search", kind=kind)
    user = uuid.uuid4().hex
    res = invoke(research.handler, http_event("POST", "/v1/company-research", user=user,
                                              body={"company": "Acme Logistics"}))
    assert res.status == 503 and res.body["error"]["code"] == "provider_quota_exceeded"
    assert res.body["error"]["provider"] == "search"
    assert env.family_stats("search")["arrivals"] == 1 and used(user) == 0


def test_quota_answer_is_shaped_as_openais(env: EmulatorProcess) -> None:
    """The emulator's quota 429 has OpenAI's code and type, x-should-retry: false, no wait."""
    env.fail_next(1, family="llm", kind="quota")
    answer = httpx.post(f"{env.openai_base_url}/chat/completions",
                        headers={"Authorization": "Bearer k"},
                        json={"model": "gpt-4o-mini", "messages": [{"role": "user",
                                                                    "content": "hi"}]})
    assert answer.status_code == 429
    assert answer.json()["error"]["code"] == answer.json()["error"]["type"] == \
        "insufficient_quota"
    assert answer.headers["x-should-retry"] == "false"
    assert "retry-after" not in answer.headers and "retry-after-ms" not in answer.headers


def test_unknown_kind_is_refused(env: EmulatorProcess) -> None:
    """A kind the emulator does not know, or a status that contradicts it, is a 400."""
    with pytest.raises(ValueError, match="kind"):
        env.fail_next(1, family="llm", kind="no-such-failure")
    with pytest.raises(ValueError, match="answers 429"):
        env.configure("llm", fail_next={"kind": "quota", "status": 500})
