"""Abuse of every function's Mangum handler: bad bodies, headers and queries lose nothing.

All seven functions run as Lambda runs them (payload-v2 events, a Lambda context, Mangum)
against the session's real redis-server and the offline emulator as every provider. A
rejected request must answer 4xx, leave the caller's ledger empty (``GET /v1/usage``) and
reach no provider (the emulator's arrival counters). Secrets set in the environment must
never appear in anything written to stdout, stderr or the logging module.

Identity and cross-user isolation are in ``test_isolation.py``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import importlib
import json
import logging
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

from local.emulator import EmulatorProcess
from local.lambda_events import Result, fresh_environment, http_event, invoke
from local.redis_servers import RedisServer, free_port
from usage_limits.web import observability as obs
from usage_limits.web import runtime, settings

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}},
          "required": ["title"], "additionalProperties": False}
JOB_TEXT = ("Senior Python Developer at Acme Ltd, Leeds. Salary GBP 60,000 to 70,000 a year. "
            "Hybrid. Django, PostgreSQL and AWS.")


@dataclass(frozen=True)
class Route:
    """One function: how to call it well, and which emulator families it reaches."""

    name: str
    method: str
    path: str
    ok: dict[str, Any]                 # the body (POST) or the query (GET) of a good request
    families: tuple[str, ...] = ()     # providers a good request reaches, first one first
    too_long: dict[str, Any] | None = None  # a good request with one field over its cap

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"functions.{self.name}.app")

    @property
    def metered(self) -> bool:
        return bool(self.families)

    @property
    def post(self) -> bool:
        return self.method == "POST"


ROUTES = [
    Route("structured", "POST", "/v1/structured", {"prompt": "A Python job", "schema": SCHEMA},
          ("llm",), {"prompt": "x" * 32_001, "schema": SCHEMA}),
    Route("embeddings", "POST", "/v1/embeddings", {"input": ["Senior Python engineer"]},
          ("llm",), {"input": ["x" * 8_001]}),
    Route("company_research", "POST", "/v1/company-research", {"company": "Acme Logistics"},
          ("search", "llm"), {"company": "x" * 201}),
    Route("salary", "GET", "/v1/salary", {"title": "data engineer", "location": "London"},
          ("salary",), {"title": "x" * 101}),
    Route("job_extraction", "POST", "/v1/job-extraction", {"text": JOB_TEXT},
          ("llm",), {"text": "x" * 100_001}),
    Route("market_context", "POST", "/v1/market-context", {"role": "data engineer"},
          ("salary", "llm"), {"role": "x" * 101}),
    Route("usage", "GET", "/v1/usage", {}),
]
METERED = [r for r in ROUTES if r.metered]
POSTS = [r for r in ROUTES if r.post]
USAGE = ROUTES[-1]


def ids(routes: list[Route]) -> list[str]:
    return [r.name for r in routes]


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer,
        emulator: EmulatorProcess) -> EmulatorProcess:
    """Every provider on the emulator, real Redis, a 1000/1h plan, fresh clients, not local."""
    emulator.reset()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "1000/1h",
        "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "test-llm-key",
        "SEARCH_BASE_URL": emulator.tavily_base_url, "SEARCH_API_KEY": "test-search-key",
        "SALARY_BASE_URL": emulator.adzuna_base_url, "SALARY_APP_ID": "test-app",
        "SALARY_APP_KEY": "test-app-key",
        "LLM_RATE": "1000/s", "SEARCH_RATE": "1000/s", "SALARY_RATE": "1000/s",
    }, unset=(
        "ATTO_ENV", "ATTO_MAX_BODY_BYTES", "REDIS_CLUSTER", "LOG_LEVEL",
        "PAGES_ALLOW_PRIVATE_HOSTS", *(f"{p}_{s}" for p in ("LLM", "SEARCH", "SALARY")
        for s in ("SECRET_ARN", "BURST", "CONCURRENCY")),
    ))
    return emulator


@pytest.fixture
def small_cap(env: EmulatorProcess, monkeypatch: pytest.MonkeyPatch) -> EmulatorProcess:
    """The same environment with request bodies capped at 4 KiB."""
    monkeypatch.setenv("ATTO_MAX_BODY_BYTES", "4096")
    settings.cache_clear()
    return env


def event(route: Route, user: str | None, *, body: Any = None, query: dict[str, str] | None = None,
          headers: dict[str, str] | None = None, raw_body: str | None = None,
          base64_body: bool = False, request_id: str | None = None) -> dict[str, Any]:
    """A payload-v2 event for ``route``: its good request unless a part is given."""
    if route.post:
        body = route.ok if body is None and raw_body is None else body
    else:
        query = route.ok if query is None else query
    return http_event(route.method, route.path, body=body, query=query, headers=headers,
                      user=user, raw_body=raw_body, base64_body=base64_body,
                      request_id=request_id)


def call(route: Route, user: str | None, **parts: Any) -> Result:
    return invoke(route.module.handler, event(route, user, **parts))


def ledger(user: str) -> tuple[int, list[tuple[str, int, str]]]:
    """Tokens used in the hour and the charges (request id, cost, route), from GET /v1/usage."""
    res = call(USAGE, user)
    assert res.status == 200, res.body
    return (res.body["windows"][0]["used"],
            [(e["request_id"], e["cost"], e["route"]) for e in res.body["events"]])


def upstream(emu: EmulatorProcess) -> dict[str, int]:
    """Requests each emulated provider has received."""
    return {name: f["arrivals"] for name, f in emu.stats(times=False)["families"].items()}


def spent(user: str) -> int:
    """Tokens ``user`` has used in the hour, read from the ledger directly (any user id)."""
    async def read() -> int:
        report = await runtime.get_budget(settings().plan).usage(user)
        return report.windows[0].used

    return asyncio.get_event_loop().run_until_complete(read())


def new_user() -> str:
    return "u-" + uuid.uuid4().hex


def assert_rejected_free(res: Result, status: int | tuple[int, ...], code: str, user: str,
                         emu: EmulatorProcess, calls_before: dict[str, int]) -> None:
    """The request got ``status``/``code``, the caller owes nothing and no provider was called."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert res.status in statuses, (res.status, res.body)
    assert res.body["error"]["code"] == code, res.body
    assert ledger(user) == (0, [])
    assert upstream(emu) == calls_before


# -- bodies -------------------------------------------------------------------------------


@pytest.mark.parametrize("content_length", ["exact", "absent", "understated"])
@pytest.mark.parametrize("route", ROUTES, ids=ids(ROUTES))
def test_body_over_the_cap_is_413_and_free(small_cap: EmulatorProcess, route: Route,
                                           content_length: str) -> None:
    """A body above ATTO_MAX_BODY_BYTES is 413 whatever its Content-Length says, and free."""
    user, before = new_user(), upstream(small_cap)
    raw = '{"pad": "' + "x" * 5_000 + '"}'
    headers = {"exact": {"content-length": str(len(raw))}, "absent": {},
               "understated": {"content-length": "10"}}[content_length]
    res = call(route, user, raw_body=raw, headers=headers)
    assert_rejected_free(res, 413, "payload_too_large", user, small_cap, before)
    assert res.body["error"]["limit_bytes"] == 4096
    assert "ratelimit" not in res.headers


@pytest.mark.parametrize("route", POSTS, ids=ids(POSTS))
def test_body_at_the_cap_is_served(small_cap: EmulatorProcess, route: Route) -> None:
    """The cap is not off by one: a good body of exactly ATTO_MAX_BODY_BYTES is served."""
    user = new_user()
    raw = json.dumps(route.ok)
    raw += " " * (4096 - len(raw))  # JSON allows trailing whitespace
    assert len(raw.encode()) == 4096
    res = call(route, user, raw_body=raw, headers={"content-length": "4096"})
    assert res.status == 200, res.body
    assert ledger(user)[0] > 0


@pytest.mark.parametrize("raw", [
    '{"prompt": "x",',                         # cut short
    "{'prompt': 'x'}",                         # not JSON quoting
    '{"a": 1} trailing',                       # garbage after the value
    "NaN",                                     # a bare non-JSON number
    "",                                        # nothing at all
], ids=["truncated", "single-quotes", "trailing", "nan", "empty"])
@pytest.mark.parametrize("route", POSTS, ids=ids(POSTS))
def test_invalid_json_is_4xx_and_free(env: EmulatorProcess, route: Route, raw: str) -> None:
    """A body that is not a JSON object is refused, charges nothing and calls no provider."""
    user, before = new_user(), upstream(env)
    res = call(route, user, raw_body=raw)
    assert_rejected_free(res, (400, 422), "invalid_request", user, env, before)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "application/xml", "multipart/form-data; boundary=x"])
@pytest.mark.parametrize("route", POSTS, ids=ids(POSTS))
def test_wrong_content_type_is_4xx_and_free(env: EmulatorProcess, route: Route,
                                            content_type: str) -> None:
    """A good JSON body sent under another content type is not parsed, not served, not charged."""
    user, before = new_user(), upstream(env)
    res = call(route, user, headers={"content-type": content_type})
    assert_rejected_free(res, (400, 415, 422), "invalid_request", user, env, before)


@pytest.mark.parametrize("route", POSTS, ids=ids(POSTS))
def test_base64_body_of_binary_garbage_is_4xx_and_free(env: EmulatorProcess, route: Route) -> None:
    """A well-encoded base64 body (as API Gateway sends binary) that decodes to junk is refused."""
    user, before = new_user(), upstream(env)
    ev = event(route, user)
    ev["body"], ev["isBase64Encoded"] = base64.b64encode(secrets.token_bytes(256)).decode(), True
    res = invoke(route.module.handler, ev)
    assert_rejected_free(res, (400, 422), "invalid_request", user, env, before)


@pytest.mark.parametrize("route", POSTS, ids=ids(POSTS))
def test_base64_body_of_a_good_request_is_served(env: EmulatorProcess, route: Route) -> None:
    """The base64 path is not a way around validation: a good body base64-encoded still works."""
    user = new_user()
    res = call(route, user, body=route.ok, base64_body=True)
    assert res.status == 200, res.body
    assert ledger(user)[0] > 0


@pytest.mark.parametrize("route", POSTS, ids=ids(POSTS))
def test_malformed_base64_body_reaches_nothing(env: EmulatorProcess, route: Route) -> None:
    """Undecodable base64 never reaches the app: no charge, no provider call, never a 2xx.

    Mangum decodes the body before the app runs and raises on bad padding, so the
    invocation fails (API Gateway would answer 500). API Gateway itself always sends valid
    base64, so only a hand-made event gets here.
    """
    user, before = new_user(), upstream(env)
    ev = event(route, user)
    ev["body"], ev["isBase64Encoded"] = "!!not*base64", True
    try:
        status = invoke(route.module.handler, ev).status
    except binascii.Error:
        status = None
    assert status is None or 400 <= status < 500
    assert ledger(user) == (0, [])
    assert upstream(env) == before


@pytest.mark.parametrize("shape", ["arrays", "objects"])
@pytest.mark.parametrize("route", POSTS, ids=ids(POSTS))
def test_deeply_nested_json_is_4xx_and_free(env: EmulatorProcess, route: Route, shape: str) -> None:
    """JSON nested 40,000 levels deep (within the body cap) is refused without a 500."""
    user, before = new_user(), upstream(env)
    depth = 40_000
    raw = "[" * depth + "]" * depth if shape == "arrays" else '{"a":' * depth + "1" + "}" * depth
    res = call(route, user, raw_body=raw)
    assert_rejected_free(res, (400, 422), "invalid_request", user, env, before)


def test_deeply_nested_schema_is_422_and_free(env: EmulatorProcess) -> None:
    """A JSON Schema nested beyond what the validator can walk is a 422, not a 500."""
    route, user, before = ROUTES[0], new_user(), upstream(env)
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    res = call(route, user, body={"prompt": "x", "schema": schema})
    assert_rejected_free(res, 422, "invalid_request", user, env, before)


@pytest.mark.parametrize("ref", ["http://127.0.0.1:{port}/latest/meta-data/", "#",
                                 "#/$defs/nowhere"], ids=["url", "endless", "dangling"])
def test_schema_refs_are_never_fetched_and_charge_nothing(env: EmulatorProcess, ref: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller's $ref to a URL is never downloaded; unusable refs are a free 422 before any
    provider call."""
    import urllib.request

    fetched: list[Any] = []
    real_urlopen = urllib.request.urlopen

    def urlopen(*args: Any, **kwargs: Any) -> Any:
        fetched.append(args)
        return real_urlopen(*args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    route, user, before = ROUTES[0], new_user(), upstream(env)
    schema = {"$ref": ref.format(port=free_port())}
    res = call(route, user, body={"prompt": "x", "schema": schema})
    assert_rejected_free(res, 422, "invalid_request", user, env, before)
    assert fetched == []


def test_deeply_nested_json_ld_in_a_page_is_ignored(env: EmulatorProcess) -> None:
    """Pasted HTML whose JSON-LD is nested too deeply to parse is still extracted from its text."""
    route, user = ROUTES[4], new_user()
    html = ('<html><head><script type="application/ld+json">' + "[" * 5_000 + "]" * 5_000
            + "</script></head><body><h1>Senior Python Developer</h1><p>" + JOB_TEXT
            + "</p></body></html>")
    res = call(route, user, body={"html": html})
    assert res.status == 200, res.body
    assert res.body["structured_data"] is False
    assert ledger(user)[0] == 10


@pytest.mark.parametrize("route", METERED, ids=ids(METERED))
def test_field_over_its_cap_is_422_and_free(env: EmulatorProcess, route: Route) -> None:
    """A string or list one past its documented cap is refused before any provider call."""
    assert route.too_long is not None
    user, before = new_user(), upstream(env)
    res = call(route, user, **({"body": route.too_long} if route.post
                               else {"query": route.too_long}))
    assert_rejected_free(res, 422, "invalid_request", user, env, before)


@pytest.mark.parametrize("route", METERED, ids=ids(METERED))
def test_unknown_field_is_422_and_free(env: EmulatorProcess, route: Route) -> None:
    """A good request with one field the contract does not know is refused, not ignored."""
    user, before = new_user(), upstream(env)
    extra = {**route.ok, "debug": "1"}
    res = call(route, user, **({"body": extra} if route.post else {"query": extra}))
    assert_rejected_free(res, 422, "invalid_request", user, env, before)


@pytest.mark.parametrize("route", POSTS, ids=ids(POSTS))
def test_body_that_is_not_an_object_is_422_and_free(env: EmulatorProcess, route: Route) -> None:
    """An array, string, number or null where an object belongs is refused and free."""
    for body in (["x"], "x", 7, None):
        user, before = new_user(), upstream(env)
        res = call(route, user, raw_body=json.dumps(body))
        assert_rejected_free(res, 422, "invalid_request", user, env, before)


@pytest.mark.parametrize("query", [
    {"title": "nurse", "country": "xx"},       # a country Adzuna does not serve
    {"country": "gb"},                         # no title
    {"title": ""},                             # empty title
    {"title": "nurse\x00"},                    # control character
    {"title": "nurse", "location": "\r\nX"},   # CR/LF smuggled into the location
    {"title": "nurse", "app_key": "stolen"},   # a provider credential as a parameter
], ids=["country", "no-title", "empty", "nul", "crlf", "app-key"])
def test_wrong_salary_query_is_422_and_free(env: EmulatorProcess, query: dict[str, str]) -> None:
    """GET /v1/salary refuses bad or unknown query parameters before any provider call."""
    route, user, before = ROUTES[3], new_user(), upstream(env)
    res = call(route, user, query=query)
    assert_rejected_free(res, 422, "invalid_request", user, env, before)


# -- headers ------------------------------------------------------------------------------

BAD_KEYS = {
    "too-long": "k" * 129,
    "empty": "",
    "tab": "a\tb",
    "crlf-injection": "k1\r\nX-Atto-User: victim",
    "lf": "k1\nSet-Cookie: a=b",
    "nul": "a\x00b",
    "del": "a\x7fb",
    "unicode": "ключ-🔑",
}


@pytest.mark.parametrize("key", BAD_KEYS.values(), ids=BAD_KEYS.keys())
@pytest.mark.parametrize("route", METERED, ids=ids(METERED))
def test_bad_idempotency_key_is_400_and_free(env: EmulatorProcess, route: Route, key: str) -> None:
    """An Idempotency-Key that is too long, empty or not printable ASCII is refused and free."""
    user, before = new_user(), upstream(env)
    res = call(route, user, headers={"Idempotency-Key": key})
    assert_rejected_free(res, 400, "invalid_request", user, env, before)
    assert all("\r" not in v and "\n" not in v for v in res.headers.values())
    assert "set-cookie" not in res.headers and "x-atto-user" not in res.headers


def test_longest_idempotency_key_is_accepted(env: EmulatorProcess) -> None:
    """The 128-character limit is inclusive: such a key is charged once and replayed."""
    route, user, key = ROUTES[1], new_user(), "k" * 128
    first = call(route, user, headers={"Idempotency-Key": key})
    second = call(route, user, headers={"Idempotency-Key": key})
    assert first.status == second.status == 200
    assert second.headers["idempotent-replayed"] == "true"
    assert ledger(user) == (1, [(key, 1, "/v1/embeddings")])


@pytest.mark.parametrize("route", ROUTES, ids=ids(ROUTES))
def test_local_user_header_with_crlf_names_nobody(env: EmulatorProcess, route: Route,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Even in local mode an X-Atto-User with CR/LF or NUL is 401 and charges no one."""
    monkeypatch.setenv("ATTO_ENV", "local")
    settings.cache_clear()
    victim, before = new_user(), upstream(env)
    forgeries = (f"{victim}\r\nX-Atto-User: other", f"{victim}\n", f"{victim}\x00")
    for forged in forgeries:
        res = call(route, None, headers={"X-Atto-User": forged})
        assert res.status == 401 and res.body["error"]["code"] == "unauthorized"
        assert all("\r" not in v and "\n" not in v for v in res.headers.values())
    assert ledger(victim) == (0, []) and ledger("other") == (0, [])
    assert all(spent(forged) == 0 for forged in forgeries)
    assert upstream(env) == before


# -- secrets ------------------------------------------------------------------------------

SecretEnv = tuple[EmulatorProcess, dict[str, str], RedisServer]


@pytest.fixture
def secret_env(env: EmulatorProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[SecretEnv]:
    """Distinctive provider keys, a password-protected redis-server and DEBUG logging."""
    values = {
        "LLM_API_KEY": "sk-llm-" + secrets.token_hex(16),
        "SEARCH_API_KEY": "tvly-" + secrets.token_hex(16),
        "SALARY_APP_ID": "appid" + secrets.token_hex(8),
        "SALARY_APP_KEY": "appkey" + secrets.token_hex(16),
        "REDIS_PASSWORD": "redispw" + secrets.token_hex(16),
    }
    with RedisServer() as server:
        server.cli("CONFIG", "SET", "requirepass", values["REDIS_PASSWORD"])
        for name, value in values.items():
            if name != "REDIS_PASSWORD":
                monkeypatch.setenv(name, value)
        monkeypatch.setenv("REDIS_URL", f"redis://:{values['REDIS_PASSWORD']}@127.0.0.1:"
                                        f"{server.port}/0")
        monkeypatch.setenv("LOG_LEVEL", "DEBUG")
        # A service name of its own: Powertools configures a logger (level, stdout handler)
        # only the first time a name is used in the process.
        monkeypatch.setenv("POWERTOOLS_SERVICE_NAME", "atto-secrets-" + secrets.token_hex(4))
        monkeypatch.setattr(obs, "_logger", None)
        fresh_environment()
        yield env, values, server
        fresh_environment()


def test_secrets_never_reach_the_logs(secret_env: SecretEnv, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture,
                                      capfd: pytest.CaptureFixture[str]) -> None:
    """Provider keys and the Redis password appear nowhere in logs or answers, at DEBUG.

    Every route runs a good request, one whose provider fails (502), one with an
    Idempotency-Key (the idempotency store uses the same password) and one while Redis
    refuses the password (503).
    """
    emu, values, server = secret_env
    caplog.set_level(logging.DEBUG)
    answers: list[Result] = []
    for route in ROUTES:
        user = new_user()
        answers.append(ok := call(route, user))
        assert ok.status == 200, (route.name, ok.body)
        answers.append(keyed := call(route, user, headers={"Idempotency-Key": "k-" + user}))
        assert keyed.status == 200, (route.name, keyed.body)
        if route.metered:
            emu.fail_next(1, 500, family=route.families[0])
            answers.append(failed := call(route, user))
            assert failed.status == 502, (route.name, failed.body)
        else:
            answers.append(failed := call(route, None))
            assert failed.status == 401
    monkeypatch.setenv("REDIS_URL", f"redis://:wrong-{values['REDIS_PASSWORD']}@127.0.0.1:"
                                    f"{server.port}/0")
    fresh_environment()
    for route in ROUTES:
        answers.append(refused := call(route, new_user(), headers={"Idempotency-Key": "k"}))
        assert refused.status == 503, (route.name, refused.body)
        assert refused.body["error"]["code"] == "limiter_unavailable"
    out, err = capfd.readouterr()
    logged = "\n".join([out, err, caplog.text]
                       + [str(r.__dict__) for r in caplog.records])
    assert '"message":"request"' in out          # Powertools' JSON log, at DEBUG
    assert "HTTP Request:" in caplog.text           # so did httpx, with URLs
    assert "app_key=***" in caplog.text             # Adzuna's key travels in the URL: masked
    shown = "\n".join(f"{a.headers}{a.body}" for a in answers)
    for name, value in values.items():
        assert value not in logged, f"{name} was logged"
        assert value not in shown, f"{name} was in an answer"
