"""POST /v1/embeddings through its Mangum handler, a real redis-server and the emulator."""

from __future__ import annotations

import importlib
import json
import math
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import atto_providers.llm as llm
from local.emulator import EmulatorProcess
from local.lambda_events import Result, http_event, invoke
from local.redis_servers import RedisServer
from tests.ledger import used
from usage_limits.web import settings

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

ROOT = Path(__file__).resolve().parents[2]
ROUTE = "/v1/embeddings"
COST = 1
embeddings_fn = importlib.import_module("functions.embeddings.app")
usage_fn = importlib.import_module("functions.usage.app")


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer,
        emulator: EmulatorProcess) -> EmulatorProcess:
    """Real Redis, the emulator as the LLM, a 100/1h plan, fresh clients."""
    emulator.reset()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h",
        "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "test-key",
        "LLM_RATE": "1000/s",
    }, unset=(
        "ATTO_ENV", "LLM_SECRET_ARN", "LLM_BURST", "LLM_CONCURRENCY",
        "ATTO_MAX_BODY_BYTES",
    ))
    return emulator


def embed(user: str, body: Any, headers: dict[str, str] | None = None) -> Result:
    return invoke(embeddings_fn.handler,
                  http_event("POST", ROUTE, body=body, user=user, headers=headers))


def arrivals(emu: EmulatorProcess) -> int:
    return int(emu.family_stats("llm")["arrivals"])


def test_vectors_come_back_in_order_and_cost_1(env: EmulatorProcess) -> None:
    """Each text gets a unit vector of the asked length, in input order, for 1 token."""
    user = uuid.uuid4().hex
    texts = ["senior python engineer", "python backend developer", "pastry chef"]
    res = embed(user, {"input": texts, "dimensions": 64})
    assert res.status == 200, res.body
    data = res.body["data"]
    assert [row["index"] for row in data] == [0, 1, 2]
    assert all(len(row["embedding"]) == 64 for row in data)
    assert all(math.isclose(math.hypot(*row["embedding"]), 1.0, rel_tol=1e-3) for row in data)
    dot = [sum(a * b for a, b in zip(data[0]["embedding"], row["embedding"], strict=True))
           for row in data[1:]]
    assert dot[0] > dot[1]  # the two python roles are closer than the chef
    assert res.body["model"] and res.body["usage"]["prompt_tokens"] > 0
    assert res.headers["ratelimit-policy"] == '"1h";q=100;w=3600;atto-qu="tokens"'
    assert res.headers["ratelimit"].startswith('"1h";r=99;')
    assert used(user) == COST
    assert arrivals(env) == 1


@pytest.mark.parametrize(("texts", "cost"), [
    (["x"], 1),
    (["short text"] * 64, 1),                 # 640 characters: one step
    (["a" * 8_000], 1),
    (["a" * 4_000, "b" * 4_001], 2),          # 8,001 characters start a second step
    (["a" * 8_000] * 3, 3),
])
def test_cost_is_one_token_per_started_8000_characters(
        env: EmulatorProcess, texts: list[str], cost: int) -> None:
    """The charge follows the input's size, all texts together, not the number of texts."""
    user = uuid.uuid4().hex
    res = embed(user, {"input": texts, "dimensions": 8})
    assert res.status == 200, res.body
    assert res.headers["ratelimit"].startswith(f'"1h";r={100 - cost};')
    assert used(user) == cost


def test_model_is_passed_through(env: EmulatorProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit model that the deployment offers is sent upstream and reported back."""
    monkeypatch.setenv("LLM_EMBEDDING_MODELS", "text-embedding-3-large")
    llm._client = None
    res = embed(uuid.uuid4().hex, {"input": ["x"], "model": "text-embedding-3-large"})
    assert res.status == 200 and res.body["model"] == "text-embedding-3-large"


def test_model_not_offered_is_400_and_free(env: EmulatorProcess) -> None:
    """A model the deployment does not offer is refused before any upstream call, refunded."""
    user = uuid.uuid4().hex
    res = embed(user, {"input": ["x"], "model": "text-embedding-3-large"})
    assert res.status == 400 and res.body["error"]["code"] == "invalid_request"
    assert res.body["error"]["models"] == ["text-embedding-3-small"]
    assert used(user) == 0 and arrivals(env) == 0


@pytest.mark.parametrize("body", [
    {},                                                  # no input
    {"input": []},                                       # no texts
    {"input": [""]},                                     # an empty text
    {"input": ["x"] * 65},                               # too many texts
    {"input": ["x" * 8001]},                             # a text too long
    {"input": "one string"},                             # not a list
    {"input": [7]},                                      # not a string
    {"input": ["x"], "dimensions": 0},                   # dimensions below 1
    {"input": ["x"], "dimensions": 3073},                # dimensions above 3072
    {"input": ["x"], "dimensions": "64"},                # dimensions as a string
    {"input": ["x"], "model": ""},                       # empty model
    {"input": ["x"], "model": "bad model?"},             # model with odd characters
    {"input": ["x"], "extra": True},                     # unknown field
])
def test_bad_input_is_422_and_free(env: EmulatorProcess, body: Any) -> None:
    """Invalid bodies get 422 invalid_request, reach no provider and cost nothing."""
    user = uuid.uuid4().hex
    res = embed(user, body)
    assert res.status == 422 and res.body["error"]["code"] == "invalid_request"
    assert used(user) == 0
    assert arrivals(env) == 0


def test_largest_batch_fits_when_the_body_cap_allows(env: EmulatorProcess,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """64 texts of 8,000 characters go through once ATTO_MAX_BODY_BYTES admits ~513 kB, for
    64 tokens (one per started 8,000 characters)."""
    monkeypatch.setenv("ATTO_MAX_BODY_BYTES", str(1024 * 1024))
    settings.cache_clear()
    user = uuid.uuid4().hex
    res = embed(user, {"input": ["word " * 1600] * 64, "dimensions": 8})
    assert res.status == 200, res.body
    assert len(res.body["data"]) == 64 and used(user) == 64


def test_largest_batch_is_413_under_the_default_body_cap(env: EmulatorProcess) -> None:
    """Under the default 256 KiB cap the largest batch is refused before any charge."""
    user = uuid.uuid4().hex
    res = embed(user, {"input": ["word " * 1600] * 64})
    assert res.status == 413 and res.body["error"]["code"] == "payload_too_large"
    assert used(user) == 0 and arrivals(env) == 0


def test_upstream_failure_is_502_and_refunded(env: EmulatorProcess) -> None:
    """An upstream 500 becomes 502 provider_error and the token comes back."""
    user = uuid.uuid4().hex
    env.fail_next(1, 500, family="llm")
    res = embed(user, {"input": ["x"]})
    assert res.status == 502 and res.body["error"]["code"] == "provider_error"
    assert res.headers["ratelimit"].startswith('"1h";r=100;')
    assert used(user) == 0


def test_upstream_429_pauses_and_retries(env: EmulatorProcess) -> None:
    """An upstream 429 with Retry-After pauses the provider; the retry succeeds, charged once."""
    user = uuid.uuid4().hex
    env.fail_next(1, 429, family="llm", retry_after_s=1)
    res = embed(user, {"input": ["x", "y"]})
    assert res.status == 200, res.body
    stats = env.family_stats("llm")
    assert stats["arrivals"] == 2 and stats["rate_limited"] == 1
    assert used(user) == COST


def test_idempotent_repeat_replays_and_is_charged_once(env: EmulatorProcess) -> None:
    """The same Idempotency-Key replays the stored vectors: one charge, one upstream call."""
    user, key = uuid.uuid4().hex, str(uuid.uuid4())
    body = {"input": ["replay me"], "dimensions": 16}
    first = embed(user, body, {"Idempotency-Key": key})
    second = embed(user, body, {"Idempotency-Key": key})
    assert first.status == second.status == 200
    assert second.body == first.body and second.headers["idempotent-replayed"] == "true"
    assert arrivals(env) == 1
    assert used(user) == COST
    other = embed(user, {"input": ["something else"]}, {"Idempotency-Key": key})
    assert other.status == 422 and other.body["error"]["code"] == "idempotency_key_reused"
    assert used(user) == COST


def test_event_file_invokes_the_function(env: EmulatorProcess) -> None:
    """events/embeddings.json runs through the handler as `sam local invoke` would."""
    event = json.loads((ROOT / "events" / "embeddings.json").read_text())
    res = invoke(embeddings_fn.handler, event)
    assert res.status == 200, res.body
    assert len(res.body["data"]) == len(json.loads(event["body"])["input"])
