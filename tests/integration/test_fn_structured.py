"""POST /v1/structured and GET /v1/usage through their Mangum handlers, a real redis-server
and the emulator."""

from __future__ import annotations

import importlib
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest

from local.emulator import EmulatorProcess
from local.lambda_events import http_event, invoke
from local.redis_servers import RedisServer
from tests.ledger import used

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

ROOT = Path(__file__).resolve().parents[2]
structured = importlib.import_module("functions.structured.app")
usage_fn = importlib.import_module("functions.usage.app")
SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"},
                         "skills": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                         "seniority": {"enum": ["junior", "mid", "senior"]}},
          "required": ["title", "skills", "seniority"], "additionalProperties": False}


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer,
        emulator: EmulatorProcess) -> EmulatorProcess:
    """The handlers' environment: real Redis, the emulator as the LLM, a 100/1h plan."""
    emulator.reset()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h",
        "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "test-key",
        "LLM_RATE": "1000/s",
    }, unset=(
        "ATTO_ENV", "LLM_SECRET_ARN",
    ))
    return emulator


def ask(user: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    return invoke(structured.handler, http_event("POST", "/v1/structured", body=body, user=user,
                                                 headers=headers))


def test_answer_is_valid_for_the_schema_and_charged_8(env: EmulatorProcess) -> None:
    """A structured request returns data valid for the caller's schema and costs 8 tokens."""
    user = uuid.uuid4().hex
    res = ask(user, {"prompt": "Senior Python engineer in Berlin", "schema": SCHEMA})
    assert res.status == 200
    jsonschema.validate(res.body["data"], SCHEMA)
    assert res.body["usage"]["prompt_tokens"] > 0
    assert res.headers["ratelimit"].startswith('"1h";r=92;')
    assert used(user) == 8
    assert env.family_stats("llm")["arrivals"] == 1


@pytest.mark.parametrize("body", [
    {"prompt": "x"},                                           # no schema
    {"prompt": "", "schema": SCHEMA},                          # empty prompt
    {"prompt": "x", "schema": {"type": "no-such-type"}},       # not a JSON Schema
    {"prompt": "x", "schema": SCHEMA, "extra": 1},             # unknown field
    ["not", "an", "object"],
])
def test_bad_input_is_422_and_free(env: EmulatorProcess, body: Any) -> None:
    """Malformed bodies get 422 invalid_request, reach no provider and cost nothing."""
    user = uuid.uuid4().hex
    res = ask(user, body)
    assert res.status == 422 and res.body["error"]["code"] == "invalid_request"
    assert used(user) == 0
    assert env.family_stats("llm")["arrivals"] == 0


def test_upstream_failure_is_502_and_refunded(env: EmulatorProcess) -> None:
    """An upstream 500 becomes 502 provider_error and the tokens come back, as its message
    says."""
    user = uuid.uuid4().hex
    env.fail_next(1, 500, family="llm")
    res = ask(user, {"prompt": "x", "schema": SCHEMA})
    assert res.status == 502 and res.body["error"]["code"] == "provider_error"
    assert res.body["error"]["message"].endswith(
        "; the tokens charged for this request were refunded")
    assert used(user) == 0


def test_upstream_429_pauses_and_retries(env: EmulatorProcess) -> None:
    """An upstream 429 with Retry-After pauses the provider, then the retry succeeds."""
    user = uuid.uuid4().hex
    env.fail_next(1, 429, family="llm", retry_after_s=1)
    res = ask(user, {"prompt": "x", "schema": SCHEMA})
    assert res.status == 200
    assert env.family_stats("llm")["arrivals"] == 2
    assert used(user) == 8


def test_idempotent_repeat_replays_and_is_charged_once(env: EmulatorProcess) -> None:
    """The same Idempotency-Key returns the stored answer without a second provider call."""
    user, key = uuid.uuid4().hex, str(uuid.uuid4())
    body = {"prompt": "x", "schema": SCHEMA}
    first = ask(user, body, {"Idempotency-Key": key})
    second = ask(user, body, {"Idempotency-Key": key})
    assert first.status == second.status == 200
    assert second.body == first.body and second.headers["idempotent-replayed"] == "true"
    assert env.family_stats("llm")["arrivals"] == 1
    assert used(user) == 8


def test_usage_reports_windows_events_and_prices(env: EmulatorProcess) -> None:
    """GET /v1/usage shows the windows, the recent charges and every route's price, for free."""
    user = uuid.uuid4().hex
    ask(user, {"prompt": "x", "schema": SCHEMA}, {"Idempotency-Key": "abc"})
    res = invoke(usage_fn.handler, http_event("GET", "/v1/usage", user=user))
    assert res.status == 200 and "ratelimit" not in res.headers
    window = res.body["windows"][0]
    assert (window["limit"], window["used"], window["remaining"], window["window_s"]) == (
        100, 8, 92, 3600)
    assert res.body["events"][0]["request_id"] == "abc"
    assert res.body["events"][0]["route"] == "/v1/structured" and res.body["events"][0]["cost"] == 8
    assert res.body["prices"]["POST /v1/structured"] == (
        "8 per started 8,000 characters of prompt and schema")
    assert res.body["prices"]["POST /v1/embeddings"] == "1 per started 8,000 characters of input"


def test_a_long_prompt_costs_8_per_started_8000_characters(env: EmulatorProcess) -> None:
    """Prompt and schema of 8,001 characters cost two steps of 8 tokens, not a flat 8."""
    user = uuid.uuid4().hex
    schema = {"type": "string"}  # {"type":"string"} is 17 characters
    res = ask(user, {"prompt": "p" * (8_001 - 17), "schema": schema})
    assert res.status == 200, res.body
    assert used(user) == 16
    res = ask(user, {"prompt": "p" * (8_000 - 17), "schema": schema})
    assert res.status == 200 and used(user) == 24


def test_usage_needs_identity(env: EmulatorProcess) -> None:
    """GET /v1/usage without a user is 401."""
    res = invoke(usage_fn.handler, http_event("GET", "/v1/usage", user=None))
    assert res.status == 401


def test_every_event_file_invokes_its_function(env: EmulatorProcess,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The structured and usage events in events/ run through their handlers as documented."""
    for name, expected in (("structured", 200), ("usage", 200), ("structured_bad_input", 422),
                           ("structured_no_identity", 401)):
        event = json.loads((ROOT / "events" / f"{name}.json").read_text())
        module = usage_fn if name == "usage" else structured
        assert invoke(module.handler, event).status == expected, name


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},                                    # a loop with no end
    {"anyOf": [{"$ref": "#"}]},
    {"$ref": "http://169.254.169.254/latest/meta-data"},  # remote
    {"$ref": "#/$defs/missing"},                      # dangling
])
def test_unusable_references_are_refused_before_any_charge(
        env: EmulatorProcess, schema: Any) -> None:
    """A schema whose $refs are remote, dangling or endless is a free 422, not a provider call."""
    user = uuid.uuid4().hex
    res = ask(user, {"prompt": "x", "schema": schema})
    assert res.status == 422 and res.body["error"]["code"] == "invalid_request"
    assert used(user) == 0 and env.family_stats("llm")["arrivals"] == 0


def test_recursive_schemas_with_local_references_work(env: EmulatorProcess) -> None:
    """Legitimate local references (definitions, recursion through properties) are served."""
    schema = {"$defs": {"skill": {"type": "string", "minLength": 1}},
              "type": "object", "properties": {"skills": {"type": "array",
                                                          "items": {"$ref": "#/$defs/skill"}}},
              "required": ["skills"]}
    res = ask(uuid.uuid4().hex, {"prompt": "x", "schema": schema})
    assert res.status == 200 and isinstance(res.body["data"]["skills"], list)


def test_model_not_offered_is_refused_and_free(env: EmulatorProcess) -> None:
    """A model the deployment does not offer gets 400 and costs nothing: prices do not depend
    on the model."""
    user = uuid.uuid4().hex
    res = ask(user, {"prompt": "x", "schema": SCHEMA, "model": "gpt-4.1"})
    assert res.status == 400 and res.body["error"]["code"] == "invalid_request"
    assert used(user) == 0 and env.family_stats("llm")["arrivals"] == 0


def test_undecodable_body_is_400(env: EmulatorProcess) -> None:
    """A body marked base64 that is not base64 gets the public 400, not a failed invocation."""
    event = http_event("POST", "/v1/structured", raw_body="notbase64", user=uuid.uuid4().hex)
    event["isBase64Encoded"] = True
    res = invoke(structured.handler, event)
    assert res.status == 400 and res.body["error"]["code"] == "invalid_request"
