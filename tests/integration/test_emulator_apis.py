"""Each emulated upstream API over HTTP against a real emulator process."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from local.emulator import EmulatorProcess
from local.emulator.schema_instances import is_valid

AUTH = {"Authorization": "Bearer test-key"}
ADZUNA = {"app_id": "id", "app_key": "key"}


@pytest.fixture(scope="module")
def emu() -> Iterator[EmulatorProcess]:
    """One emulator process for this module."""
    with EmulatorProcess() as server:
        yield server


@pytest.fixture
def http(emu: EmulatorProcess) -> Iterator[httpx.Client]:
    """A client for the emulator, which starts every test from a reset state."""
    emu.reset()
    with httpx.Client(base_url=emu.url, timeout=10.0, trust_env=False) as client:
        yield client


def chat(http: httpx.Client, schema: object | None = None, **extra: object) -> httpx.Response:
    body: dict[str, object] = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "system", "content": "Answer with JSON."},
                     {"role": "user", "content": "Senior Data Engineer at Acme in Leeds"}],
        **extra}
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": schema}}
    return http.post("/v1/chat/completions", json=body, headers=AUTH)


JOB_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["title", "company", "city", "salary", "skills", "posted"],
    "properties": {
        "title": {"type": "string"}, "company": {"type": "string"},
        "city": {"type": "string"},
        "salary": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
        "skills": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "posted": {"type": "string", "format": "date"}},
}


def test_chat_completion_shape(http: httpx.Client) -> None:
    """A chat completion has OpenAI's fields, the alias's dated snapshot, usage and JSON."""
    response = chat(http, JOB_SCHEMA)
    assert response.status_code == 200
    data = response.json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    assert isinstance(data["created"], int) and data["model"] == "gpt-4o-mini-2024-07-18"
    choice = data["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    usage = data["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    content = json.loads(choice["message"]["content"])
    assert is_valid(content, JOB_SCHEMA)
    assert content["title"] == "Senior Data Engineer"


def test_chat_content_is_deterministic(http: httpx.Client) -> None:
    """The same request gets the same content, with a fresh completion id."""
    first, second = chat(http, JOB_SCHEMA).json(), chat(http, JOB_SCHEMA).json()
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    assert first["id"] != second["id"]


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "enum": ["a", "b", "c"]}, "uniqueItems": True, "minItems": 2}}, "required": ["tags"]},
    {"$defs": {"p": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}},
                     "required": ["n"]}}, "type": "array", "items": {"$ref": "#/$defs/p"},
     "minItems": 2},
    {"type": "string", "pattern": "^[A-Z]{2}\\d{3}$"},
    {"oneOf": [{"type": "number", "multipleOf": 0.25, "minimum": 1, "maximum": 2},
               {"type": "boolean"}]},
])
def test_chat_content_valid_for_schema(http: httpx.Client, schema: object) -> None:
    """Content answers any JSON Schema with a valid instance (non-strict)."""
    content = chat(http, schema).json()["choices"][0]["message"]["content"]
    assert is_valid(json.loads(content), schema)


def test_chat_strict_schema_rejected_like_openai(http: httpx.Client) -> None:
    """A strict schema breaking OpenAI's rules gets its 400 invalid_json_schema error."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "strict": True,
                "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}}
    response = http.post("/v1/chat/completions", json=body, headers=AUTH)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_json_schema" and error["param"] == "response_format"
    assert "'additionalProperties' is required to be supplied and to be false" in error["message"]


def test_chat_json_object_mode(http: httpx.Client) -> None:
    """json_object mode needs the word JSON in the messages and answers a JSON object."""
    fmt = {"type": "json_object"}
    ok = chat(http, response_format=fmt)
    assert isinstance(json.loads(ok.json()["choices"][0]["message"]["content"]), dict)
    bad = http.post("/v1/chat/completions", headers=AUTH, json={
        "model": "m", "messages": [{"role": "user", "content": "hello"}], "response_format": fmt})
    assert bad.status_code == 400 and "must contain the word 'json'" in bad.text


def test_chat_max_tokens_truncates(http: httpx.Client) -> None:
    """A completion longer than max_tokens is cut with finish_reason 'length'."""
    data = chat(http, JOB_SCHEMA, max_tokens=5).json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 5


def test_chat_forced_tool_call(http: httpx.Client) -> None:
    """A forced function call carries arguments valid for the function's parameters."""
    params = {"type": "object", "properties": {"query": {"type": "string"},
                                               "limit": {"type": "integer", "maximum": 5}},
              "required": ["query", "limit"]}
    data = chat(http, tools=[{"type": "function", "function": {"name": "search",
                                                               "parameters": params}}],
                tool_choice="required").json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "search"
    assert is_valid(json.loads(call["function"]["arguments"]), params)


def test_chat_stream(http: httpx.Client) -> None:
    """stream=true sends chat.completion.chunk events whose deltas add up to the content."""
    full = chat(http, JOB_SCHEMA).json()["choices"][0]["message"]["content"]
    response = chat(http, JOB_SCHEMA, stream=True, stream_options={"include_usage": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == full
    assert chunks[-1]["usage"]["total_tokens"] > 0


def test_chat_invalid_request(http: httpx.Client) -> None:
    """Missing messages get OpenAI's 400 with the offending parameter."""
    response = http.post("/v1/chat/completions", json={"model": "m", "messages": []},
                         headers=AUTH)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Basic abc"},
                                     {"Authorization": "Bearer"}])
def test_openai_auth_required(http: httpx.Client, headers: dict[str, str]) -> None:
    """Chat and embeddings answer 401 in OpenAI's shape without a bearer key."""
    for path, body in (("/v1/chat/completions", {"model": "m", "messages": []}),
                       ("/v1/embeddings", {"model": "m", "input": "x"})):
        response = http.post(path, json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_embeddings(http: httpx.Client) -> None:
    """Embeddings: one unit vector per input, in order, deterministic, the model's length
    (1536; 3072 for text-embedding-3-large) unless dimensions says otherwise."""
    body = {"model": "text-embedding-3-small", "input": ["alpha beta", "gamma"]}
    first = http.post("/v1/embeddings", json=body, headers=AUTH).json()
    second = http.post("/v1/embeddings", json=body, headers=AUTH).json()
    assert first["object"] == "list" and first["model"] == "text-embedding-3-small"
    assert [row["index"] for row in first["data"]] == [0, 1]
    assert all(row["object"] == "embedding" for row in first["data"])
    assert first["data"] == second["data"]
    for row in first["data"]:
        assert len(row["embedding"]) == 1536
        assert sum(x * x for x in row["embedding"]) == pytest.approx(1.0, abs=1e-6)
    assert first["usage"]["prompt_tokens"] == first["usage"]["total_tokens"] > 0
    small = http.post("/v1/embeddings", headers=AUTH,
                      json={"model": "m", "input": "alpha beta", "dimensions": 64}).json()
    assert len(small["data"][0]["embedding"]) == 64
    large = http.post("/v1/embeddings", headers=AUTH,
                      json={"model": "text-embedding-3-large", "input": "alpha"}).json()
    assert len(large["data"][0]["embedding"]) == 3072


def test_embeddings_base64_and_errors(http: httpx.Client) -> None:
    """base64 encoding packs float32s; an empty input and bad dimensions get 400."""
    import base64
    import struct

    data = http.post("/v1/embeddings", headers=AUTH, json={
        "model": "m", "input": "x", "dimensions": 8, "encoding_format": "base64"}).json()
    floats = struct.unpack("<8f", base64.b64decode(data["data"][0]["embedding"]))
    assert sum(x * x for x in floats) == pytest.approx(1.0, abs=1e-5)
    for body in ({"model": "m", "input": ""}, {"model": "m", "input": [], },
                 {"model": "m", "input": "x", "dimensions": 0}):
        assert http.post("/v1/embeddings", json=body, headers=AUTH).status_code == 400


def test_adzuna_histogram(http: httpx.Client) -> None:
    """The histogram maps 10k salary buckets to counts written as strings (as Adzuna's
    documented example does), the same for the same query."""
    params = {**ADZUNA, "what": "python developer", "where": "London"}
    first = http.get("/adzuna/v1/api/jobs/gb/histogram", params=params)
    assert first.status_code == 200
    hist = first.json()["histogram"]
    assert hist and all(re.fullmatch(r"\d+", k) and int(k) % 10000 == 0 for k in hist)
    assert all(isinstance(v, str) and v.isdigit() and int(v) > 0 for v in hist.values())
    assert http.get("/adzuna/v1/api/jobs/gb/histogram", params=params).json()["histogram"] == hist


def test_adzuna_search(http: httpx.Client) -> None:
    """Search pages hold count, mean and adverts with Adzuna's fields, paginated."""
    params = {**ADZUNA, "what": "data engineer", "where": "Leeds", "results_per_page": 5}
    page1 = http.get("/adzuna/v1/api/jobs/gb/search/1", params=params).json()
    page2 = http.get("/adzuna/v1/api/jobs/gb/search/2", params=params).json()
    assert page1["count"] == page2["count"] > 10 and page1["mean"] > 0
    assert len(page1["results"]) == 5
    job = page1["results"][0]
    for key in ("title", "created", "redirect_url", "description", "contract_time", "id"):
        assert key in job
    assert job["company"]["display_name"] and job["location"]["display_name"].startswith("Leeds")
    assert isinstance(job["location"]["area"], list)
    assert job["salary_min"] <= job["salary_max"]
    assert {j["id"] for j in page1["results"]}.isdisjoint({j["id"] for j in page2["results"]})
    page = http.get(job["redirect_url"])
    assert page.status_code == 200 and "JobPosting" in page.text


def test_adzuna_history_and_empty_query(http: httpx.Client) -> None:
    """History has `months` YYYY-MM keys; a 'nojobs' query has no adverts at all."""
    months = http.get("/adzuna/v1/api/jobs/gb/history",
                      params={**ADZUNA, "what": "nurse", "months": 6}).json()["month"]
    assert len(months) == 6 and all(re.fullmatch(r"\d{4}-\d{2}", k) for k in months)
    empty = http.get("/adzuna/v1/api/jobs/gb/search/1", params={**ADZUNA, "what": "nojobs"})
    assert empty.json()["count"] == 0 and empty.json()["results"] == []


def test_adzuna_auth_required(http: httpx.Client) -> None:
    """Without app_id and app_key Adzuna answers 401 AUTH_FAIL."""
    response = http.get("/adzuna/v1/api/jobs/gb/histogram", params={"what": "x"})
    assert response.status_code == 401
    assert response.json()["exception"] == "AUTH_FAIL"


def test_tavily_search(http: httpx.Client) -> None:
    """Tavily search answers query, answer and scored results, deterministically."""
    body = {"query": "Acme Robotics engineering culture", "max_results": 3,
            "search_depth": "basic", "include_answer": True}
    first = http.post("/tavily/search", json=body, headers=AUTH).json()
    assert first["query"] == body["query"] and first["answer"]
    assert len(first["results"]) == 3
    for r in first["results"]:
        assert {"title", "url", "content", "score"} <= set(r)
    scores = [r["score"] for r in first["results"]]
    assert scores == sorted(scores, reverse=True)
    assert isinstance(first["response_time"], float)
    again = http.post("/tavily/search", json={**body, "api_key": "k"}).json()
    assert again["results"] == first["results"]
    assert http.get(first["results"][0]["url"]).status_code == 200


def test_tavily_auth_and_validation(http: httpx.Client) -> None:
    """Tavily needs a key (401) and a query (400), with its error shape."""
    missing_key = http.post("/tavily/search", json={"query": "x"})
    assert missing_key.status_code == 401 and "error" in missing_key.json()["detail"]
    missing_query = http.post("/tavily/search", json={"api_key": "k"})
    assert missing_query.status_code == 400


def test_brave_search(http: httpx.Client) -> None:
    """Brave web search needs X-Subscription-Token and answers web.results."""
    ok = http.get("/brave/res/v1/web/search", params={"q": "python jobs leeds", "count": 4},
                  headers={"X-Subscription-Token": "t"})
    results = ok.json()["web"]["results"]
    assert len(results) == 4 and {"title", "url", "description"} <= set(results[0])
    denied = http.get("/brave/res/v1/web/search", params={"q": "x"})
    assert denied.status_code == 422
    assert denied.json()["error"]["code"] == "SUBSCRIPTION_TOKEN_INVALID"


def test_job_page_has_jsonld(http: httpx.Client) -> None:
    """A job page shows title, company, salary and skills, with a JobPosting JSON-LD."""
    page = http.get("/pages/job/senior-python-developer-leeds-123")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    found = re.search(r'<script type="application/ld\+json">(.*?)</script>', page.text, re.S)
    assert found
    posting = json.loads(found.group(1))
    assert posting["@type"] == "JobPosting"
    assert posting["title"] == "Senior Python Developer"
    assert posting["jobLocation"]["address"]["addressLocality"] == "Leeds"
    salary = posting["baseSalary"]["value"]
    assert salary["minValue"] < salary["maxValue"]
    assert posting["hiringOrganization"]["name"] in page.text
    assert "Python" in posting["skills"] and "<li>Python</li>" in page.text
    bare = http.get("/pages/job/senior-python-developer-leeds-123", params={"jsonld": "0"})
    assert "application/ld+json" not in bare.text and "Senior Python Developer" in bare.text


def test_redirects(http: httpx.Client) -> None:
    """/pages/redirect answers 302 to `to`; /pages/redirect/{n} is a chain of n hops."""
    hop = http.get("/pages/redirect", params={"to": "/pages/job/x-engineer"})
    assert hop.status_code == 302 and hop.headers["location"] == "/pages/job/x-engineer"
    moved = http.get("/pages/redirect", params={"to": "/pages/job/y", "status": 301})
    assert moved.status_code == 301
    chain = http.get("/pages/redirect/3", follow_redirects=True)
    assert chain.status_code == 200 and len(chain.history) == 4
    assert http.get("/_emulator/stats").json()["families"]["pages"]["redirects"] == 6


def test_big_page(http: httpx.Client) -> None:
    """/pages/big sends `mb` MiB, with Content-Length or chunked."""
    sized = http.get("/pages/big", params={"mb": 3})
    assert int(sized.headers["content-length"]) == len(sized.content) == 3 * 1024 * 1024
    with http.stream("GET", "/pages/big", params={"mb": 2, "chunked": 1}) as streamed:
        assert "content-length" not in streamed.headers
        assert sum(len(chunk) for chunk in streamed.iter_bytes()) == 2 * 1024 * 1024


def test_slow_page_times_out_client(http: httpx.Client) -> None:
    """/pages/slow holds the answer long enough for a short client timeout to fire."""
    with pytest.raises(httpx.ReadTimeout):
        http.get("/pages/slow", params={"ms": 3000}, timeout=0.2)
    assert http.get("/pages/slow", params={"ms": 0}).status_code == 200


def test_status_page(http: httpx.Client) -> None:
    """/pages/status/{code} answers that status."""
    assert http.get("/pages/status/404").status_code == 404
    assert http.get("/pages/status/503").status_code == 503
    assert http.get("/pages/status/204").status_code == 204
