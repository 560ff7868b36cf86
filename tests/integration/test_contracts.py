"""The provider clients and the emulator against what the providers publish, not what this
project wrote: every request each function sends validates against the provider's OpenAPI
document, and every answer the emulator gives validates as that document's response and
parses with the official SDK's types. Adzuna has no spec: its documented examples are
quoted with their pages.

The specs are vendored under ``tests/contracts/`` (their README names the repository and
commit of each, and the spec bugs worked around here).
"""

from __future__ import annotations

import copy
import importlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from openapi_schema_validator import OAS30Validator, OAS31Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from atto_providers.salary import parse_histogram, parse_search
from local.emulator import EmulatorProcess
from local.lambda_events import http_event, invoke
from local.redis_servers import RedisServer

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

CONTRACTS = Path(__file__).resolve().parents[1] / "contracts"
OPENAI = json.loads((CONTRACTS / "openai-openapi.components.json").read_text())
TAVILY = json.loads((CONTRACTS / "tavily-openapi.json").read_text())
_REGISTRY = Registry().with_resource(
    "urn:openai", Resource.from_contents(OPENAI, default_specification=DRAFT202012))

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                           "skills": {"type": "array",
                                                      "items": {"type": "string"}}},
          "required": ["title", "skills"]}
LOOSE = {"type": "object", "properties": {"title": {"type": "string", "minLength": 1},
                                          "note": {"type": "string"}}, "required": ["title"]}
JOB_TEXT = "Data Engineer at Cobalt Fintech in London, Python and SQL, 60,000 GBP a year."


def openai_errors(component: str, value: Any) -> list[str]:
    """What is wrong with ``value`` as OpenAI's ``component`` (empty: valid)."""
    validator = OAS31Validator({"$ref": f"urn:openai#/components/schemas/{component}"},
                               registry=_REGISTRY)
    return [f"{list(e.absolute_path)}: {e.message[:300]}" for e in validator.iter_errors(value)]


def tavily_search_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """Tavily's /search request schema and 200 schema, with its spec bugs worked around.

    The spec types ``answer`` (required) and ``results[].raw_content`` as strings, yet the
    API sends null when they were not asked for, and the spec's own example of
    ``raw_content`` is null; ``images`` items are objects only with
    ``include_image_descriptions``, else URL strings.
    """
    post = TAVILY["paths"]["/search"]["post"]
    request = post["requestBody"]["content"]["application/json"]["schema"]
    answer = copy.deepcopy(post["responses"]["200"]["content"]["application/json"]["schema"])
    properties = answer["properties"]
    assert properties["answer"]["type"] == "string"  # the bug, as published
    properties["answer"]["nullable"] = True
    result = properties["results"]["items"]["properties"]
    assert result["raw_content"]["type"] == "string" and result["raw_content"]["example"] is None
    result["raw_content"]["nullable"] = True
    properties["images"]["items"] = {"oneOf": [{"type": "string"},
                                               properties["images"]["items"]]}
    return request, answer


def tavily_errors(schema: dict[str, Any], value: Any) -> list[str]:
    """What is wrong with ``value`` for one of Tavily's (OpenAPI 3.0) schemas."""
    return [f"{list(e.absolute_path)}: {e.message[:300]}"
            for e in OAS30Validator(schema).iter_errors(value)]


# -- recording what the functions send ---------------------------------------------------------

class Exchange:
    """One upstream request a function sent and the emulator's answer."""

    def __init__(self, request: httpx.Request, response: httpx.Response) -> None:
        self.path = request.url.path
        self.method = request.method
        self.params = dict(request.url.params)
        self.body = json.loads(request.content) if request.content else None
        self.status = response.status_code
        self.answer = json.loads(response.content) if response.content else None


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[Exchange]:
    """Every exchange of the provider clients with the emulator during the test."""
    exchanges: list[Exchange] = []
    original = httpx.AsyncClient.send

    async def send(self: httpx.AsyncClient, request: httpx.Request, **kwargs: Any
                   ) -> httpx.Response:
        response = await original(self, request, **kwargs)
        if not kwargs.get("stream"):
            exchanges.append(Exchange(request, response))
        return response

    monkeypatch.setattr(httpx.AsyncClient, "send", send)
    return exchanges


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer,
        emulator: EmulatorProcess) -> Iterator[EmulatorProcess]:
    """Every provider at the emulator, real Redis, fast throttles."""
    emulator.reset()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "1000/1h",
        "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "test-key",
        "SEARCH_BASE_URL": emulator.tavily_base_url, "SEARCH_API_KEY": "test-search-key",
        "SALARY_BASE_URL": emulator.adzuna_base_url, "SALARY_APP_ID": "test-app",
        "SALARY_APP_KEY": "test-adzuna-key", "LLM_RATE": "1000/s", "SEARCH_RATE": "1000/s",
        "SALARY_RATE": "1000/s",
    }, unset=("ATTO_ENV", "LLM_SECRET_ARN", "SEARCH_SECRET_ARN", "SALARY_SECRET_ARN"))
    yield emulator


#: (function, method, route, body or query) of a call that reaches each provider it uses.
CALLS = [
    ("structured", "POST", "/v1/structured", {"prompt": "A data engineer", "schema": SCHEMA}),
    ("structured", "POST", "/v1/structured", {"prompt": "A data engineer", "schema": LOOSE}),
    ("embeddings", "POST", "/v1/embeddings", {"input": ["alpha beta", "gamma"]}),
    ("embeddings", "POST", "/v1/embeddings", {"input": ["alpha"], "dimensions": 64}),
    ("company_research", "POST", "/v1/company-research", {"company": "Acme Logistics"}),
    ("market_context", "POST", "/v1/market-context", {"role": "data engineer",
                                                      "location": "London"}),
    ("job_extraction", "POST", "/v1/job-extraction", {"text": JOB_TEXT}),
    ("salary", "GET", "/v1/salary", {"title": "python developer", "location": "London"}),
]


def run(function: str, method: str, route: str, payload: dict[str, Any]) -> Any:
    handler = importlib.import_module(f"functions.{function}.app").handler
    user = uuid.uuid4().hex
    if method == "GET":
        return invoke(handler, http_event(method, route, query=payload, user=user))
    return invoke(handler, http_event(method, route, body=payload, user=user))


@pytest.mark.parametrize(("function", "method", "route", "payload"), CALLS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CALLS)])
def test_requests_and_answers_fit_the_published_specs(
        env: EmulatorProcess, sent: list[Exchange], function: str, method: str, route: str,
        payload: dict[str, Any]) -> None:
    """Each request a function sends is valid for the spec; each emulator answer too, and
    the official SDK's types parse it."""
    from openai.types import CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion

    res = run(function, method, route, payload)
    assert res.status == 200, res.body
    assert sent, "no provider was called"
    search_request, search_answer = tavily_search_schemas()
    for exchange in sent:
        assert exchange.status == 200, (exchange.path, exchange.answer)
        if exchange.path.endswith("/chat/completions"):
            assert not openai_errors("CreateChatCompletionRequest", exchange.body)
            assert not openai_errors("CreateChatCompletionResponse", exchange.answer)
            parsed = ChatCompletion.model_validate(exchange.answer)
            assert parsed.usage is not None and parsed.model != exchange.body["model"]
        elif exchange.path.endswith("/embeddings"):
            assert not openai_errors("CreateEmbeddingRequest", exchange.body)
            assert not openai_errors("CreateEmbeddingResponse", exchange.answer)
            vectors = CreateEmbeddingResponse.model_validate(exchange.answer)
            assert {len(row.embedding) for row in vectors.data} == {
                exchange.body.get("dimensions", 1536)}
        elif exchange.path.endswith("/search") and "tavily" in exchange.path:
            assert not tavily_errors(search_request, exchange.body)
            assert not tavily_errors(search_answer, exchange.answer)
        else:
            assert "/adzuna/v1/api/jobs/" in exchange.path, exchange.path
            assert {"app_id", "app_key"} <= set(exchange.params)
            assert exchange.answer["__CLASS__"].startswith("Adzuna::API::Response::")


def test_request_bodies_fit_the_sdk_request_types(env: EmulatorProcess,
                                                  sent: list[Exchange]) -> None:
    """The chat and embeddings bodies the client sends fit the SDK's request parameters."""
    from openai.types import embedding_create_params
    from openai.types.chat import completion_create_params
    from pydantic import TypeAdapter

    chat = TypeAdapter(completion_create_params.CompletionCreateParamsNonStreaming)
    embed = TypeAdapter(embedding_create_params.EmbeddingCreateParams)
    for call in CALLS[:4]:
        assert run(*call).status == 200
    kinds = set()
    for exchange in sent:
        adapter = chat if exchange.path.endswith("/chat/completions") else embed
        adapter.validate_python(exchange.body)
        kinds.add(adapter)
    assert kinds == {chat, embed}
    strict = [e.body["response_format"]["json_schema"]["strict"] for e in sent
              if e.path.endswith("/chat/completions")]
    assert strict == [True, False]  # SCHEMA fits strict mode, LOOSE does not


# -- error answers ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["quota", "retry_after_ms", "invalid_key", "model_not_found",
                                  "schema_rejected"])
def test_emulator_error_bodies_are_openais(env: EmulatorProcess, kind: str) -> None:
    """Each named OpenAI failure the emulator sends is a valid ErrorResponse."""
    env.fail_next(1, family="llm", kind=kind)
    answer = httpx.post(f"{env.openai_base_url}/embeddings", headers={"Authorization": "Bearer k"},
                        json={"model": "text-embedding-3-small", "input": "x"})
    assert answer.status_code >= 400
    assert not openai_errors("ErrorResponse", answer.json())


@pytest.mark.parametrize(("kind", "status"), [("plan_limit", "432"), ("paygo_limit", "433")])
def test_emulator_tavily_limits_match_the_spec(env: EmulatorProcess, kind: str,
                                               status: str) -> None:
    """The emulator's 432/433 bodies fit Tavily's documented responses for them."""
    env.fail_next(1, family="search", kind=kind)
    answer = httpx.post(f"{env.tavily_base_url}/search",
                        headers={"Authorization": "Bearer tvly-k"}, json={"query": "x"})
    assert str(answer.status_code) == status
    documented = TAVILY["paths"]["/search"]["post"]["responses"][status]
    assert not tavily_errors(documented["content"]["application/json"]["schema"],
                             answer.json())


def test_tavily_spec_examples_fit_the_spec_once_worked_around() -> None:
    """The spec's own error examples parse as documented; the null example of raw_content
    fails the spec as published and passes the worked-around schema."""
    post = TAVILY["paths"]["/search"]["post"]
    for code in ("400", "401", "429", "432", "433", "500"):
        content = post["responses"][code]["content"]["application/json"]
        assert not tavily_errors(content["schema"], content["example"]), code
    published = post["responses"]["200"]["content"]["application/json"]["schema"]
    answer = {"query": "q", "answer": None, "images": [], "response_time": 0.5,
              "results": [{"title": "t", "url": "https://a.example", "content": "c",
                           "score": 0.5, "raw_content": None}]}
    assert tavily_errors(published, answer)  # the spec bug: null is not a string
    _, worked_around = tavily_search_schemas()
    assert not tavily_errors(worked_around, answer)


# -- Adzuna: the documented examples -------------------------------------------------------------

#: https://developer.adzuna.com/docs/histogram ("Salary distribution for "Finance Officer"
#: jobs in London"), quoted as the page shows it: counts are strings.
ADZUNA_HISTOGRAM_EXAMPLE = {
    "__CLASS__": "Adzuna::API::Response::SalaryHistogram",
    "histogram": {"10000": "31", "20000": "154", "30000": "69", "40000": "51",
                  "50000": "42", "60000": "55", "70000": "69"},
}


def test_adzuna_documented_histogram_parses() -> None:
    """The histogram example of Adzuna's docs (string counts) gives its seven bands."""
    buckets = parse_histogram(ADZUNA_HISTOGRAM_EXAMPLE)
    assert [(b.min, b.count) for b in buckets] == [
        (10000, 31), (20000, 154), (30000, 69), (40000, 51), (50000, 42), (60000, 55),
        (70000, 69)]
    assert buckets[-1].max is None and buckets[0].max == 20000


def test_emulator_histogram_has_the_documented_shape(env: EmulatorProcess) -> None:
    """The emulator's histogram is shaped as the documented example: digit strings both sides."""
    answer = httpx.get(f"{env.adzuna_base_url}/v1/api/jobs/gb/histogram",
                       params={"app_id": "a", "app_key": "k", "what": "finance officer",
                               "where": "London"}).json()
    assert answer["__CLASS__"] == ADZUNA_HISTOGRAM_EXAMPLE["__CLASS__"]
    assert answer["histogram"] and all(k.isdigit() and isinstance(v, str) and v.isdigit()
                                       for k, v in answer["histogram"].items())
    assert parse_histogram(answer)


def test_adzuna_search_count_as_number_or_string() -> None:
    """A search's count is read whether it comes as a number or a digit string."""
    assert parse_search({"count": 13, "mean": 42000.5}).open_positions == 13
    assert parse_search({"count": "13", "mean": "42000.5"}).open_positions == 13


def test_the_checks_reject_what_the_specs_forbid() -> None:
    """The validators are not vacuous: broken requests and answers fail them."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "r"}}}
    assert not openai_errors("CreateChatCompletionRequest", body)
    assert openai_errors("CreateChatCompletionRequest", {**body, "response_format": {
        "type": "json_schema"}})                                   # json_schema is required
    assert openai_errors("CreateChatCompletionRequest", {"model": "m"})
    assert openai_errors("CreateEmbeddingRequest", {"model": "m", "input": 7})
    assert openai_errors("CreateChatCompletionResponse", {"id": "x", "object": "chat.completion",
                                                          "created": 1, "model": "m"})
    assert openai_errors("CreateEmbeddingResponse", {"object": "list", "model": "m",
                                                     "data": [{"index": 0}]})
    request, answer = tavily_search_schemas()
    assert tavily_errors(request, {"max_results": 5})              # no query
    assert tavily_errors(request, {"query": "q", "search_depth": "deep"})
    assert tavily_errors(answer, {"query": "q", "answer": None, "images": [],
                                  "response_time": 0.1, "results": "none"})
