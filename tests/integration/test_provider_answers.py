"""Provider answers the specs document and a test server sends on purpose: quota refusals,
refused schemas and keys, finish reasons, refusals, strict mode and per-model pauses, through
the real clients, the real functions and the session's redis-server."""

from __future__ import annotations

import importlib
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import pytest

from atto_providers.llm import LLMClient
from atto_providers.search import SearchClient
from local.lambda_events import FakeContext, http_event, invoke
from local.redis_servers import RedisServer
from tests.httpstub import HttpStub, Reply, chat_reply
from tests.ledger import used
from usage_limits.keys import provider_keys
from usage_limits.web import observability as obs
from usage_limits.web.errors import ProviderQuotaExceeded

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

structured = importlib.import_module("functions.structured.app")
embeddings = importlib.import_module("functions.embeddings.app")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def openai_error(status: int, code: str | None, message: str, *, kind: str,
                 param: str | None = None, headers: dict[str, str] | None = None) -> Reply:
    """An error answer in OpenAI's documented shape."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Reply(status, json.dumps(body).encode(), headers=headers or {})


QUOTA = openai_error(429, "insufficient_quota", "You exceeded your current quota, please "
                     "check your plan and billing details.", kind="insufficient_quota",
                     headers={"x-should-retry": "false"})


def finished(reason: str, content: str | None = '{"name": "x"}',
             refusal: str | None = None) -> Reply:
    """A chat completion with one choice that ended for ``reason``."""
    body = {"model": "gpt-4o-mini-2024-07-18",
            "usage": {"prompt_tokens": 3, "completion_tokens": 5},
            "choices": [{"index": 0, "finish_reason": reason, "logprobs": None,
                         "message": {"role": "assistant", "content": content,
                                     "refusal": refusal}}]}
    return Reply(200, json.dumps(body).encode())


def provider_lines(out: str) -> list[dict[str, Any]]:
    """The provider EMF lines in a captured stdout."""
    found = [json.loads(line) for line in out.splitlines() if '"_aws"' in line]
    return [line for line in found if obs.PROVIDER in line]


def call(lambda_env: StartEnvironment, redis_server: RedisServer, url: str,
         app: Any = structured, body: dict[str, Any] | None = None,
         env: dict[str, str] | None = None) -> tuple[Any, str]:
    """One request to ``app``'s handler against the stub at ``url``: (result, user)."""
    user = uuid.uuid4().hex
    lambda_env({"REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h", "ATTO_ENV": "dev",
                "LLM_BASE_URL": url, "LLM_API_KEY": "k", "LLM_RATE": "1000/s", **(env or {})},
               unset=("LLM_SECRET_ARN", "POWERTOOLS_METRICS_DISABLED", "ATTO_EVENT_BUS"))
    path = "/v1/structured" if app is structured else "/v1/embeddings"
    res = invoke(app.handler, http_event("POST", path, user=user,
                                         body=body or {"prompt": "hi", "schema": SCHEMA}),
                 FakeContext(timeout_s=5.0))
    return res, user


# -- quota and billing ---------------------------------------------------------------------

def test_quota_429_is_not_retried_nor_paused(lambda_env: StartEnvironment,
                                              redis_server: RedisServer,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """insufficient_quota: one call, no fleet pause, 503 provider_quota_exceeded, refunded."""
    capsys.readouterr()
    with HttpStub([QUOTA, chat_reply('{"name": "x"}')]) as stub:
        res, user = call(lambda_env, redis_server, stub.url)
        assert len(stub.seen) == 1
    assert res.status == 503, res.body
    assert res.body["error"]["code"] == "provider_quota_exceeded"
    assert res.body["error"]["provider"] == "llm"
    assert "quota, please check" not in json.dumps(res.body)  # not the provider's words
    assert res.headers["retry-after"] == "60"
    assert used(user) == 0
    (line,) = provider_lines(capsys.readouterr().out)
    assert line[obs.UPSTREAM_QUOTA] == [1] or line[obs.UPSTREAM_QUOTA] == 1
    assert obs.UPSTREAM_429 not in line and obs.PROVIDER_BUSY not in line


@pytest.mark.parametrize("reply", [
    Reply(429, b'{"error": {"message": "m", "type": "requests", "code": null}}',
          headers={"x-should-retry": "false"}),
    openai_error(429, "billing_hard_limit_reached", "Billing hard limit has been reached",
                 kind="invalid_request_error")])
async def test_other_quota_signals(standalone_client: Any, uid: str, reply: Reply) -> None:
    """x-should-retry: false and the billing code are quota refusals too: no pause is set."""
    with HttpStub([reply]) as stub:
        client = LLMClient(env={"LLM_BASE_URL": stub.url, "LLM_API_KEY": "k",
                                "LLM_MODEL": f"m{uid}"}, redis=standalone_client)
        with pytest.raises(ProviderQuotaExceeded):
            await client.structured("hi", SCHEMA)
        assert len(stub.seen) == 1
    [state] = provider_keys(f"llm|m{uid}", "gcra")
    assert await standalone_client.hget(state, "pause") is None


@pytest.mark.parametrize("status", [432, 433])
async def test_tavily_plan_limits_are_quota(standalone_client: Any, uid: str,
                                            status: int) -> None:
    """Tavily's 432 (plan) and 433 (pay-as-you-go) are quota refusals, not retried."""
    body = json.dumps({"detail": {"error": "This request exceeds your plan's set usage "
                                           "limit."}}).encode()
    with HttpStub([Reply(status, body)]) as stub:
        client = SearchClient(env={"SEARCH_BASE_URL": stub.url, "SEARCH_API_KEY": "k",
                                   "SEARCH_RATE": "1000/s"}, redis=standalone_client)
        with pytest.raises(ProviderQuotaExceeded) as failed:
            await client.search(f"q {uid}")
        assert len(stub.seen) == 1
    assert failed.value.extra["provider"] == "search"


# -- Retry-After in milliseconds -------------------------------------------------------------

async def test_retry_after_ms_pauses_for_milliseconds(standalone_client: Any, uid: str) -> None:
    """retry-after-ms: 105 pauses the model for about 105 ms (not 1 s), then it is retried."""
    limited = openai_error(429, "rate_limit_exceeded", "Rate limit reached", kind="requests",
                           headers={"retry-after-ms": "105"})
    with HttpStub([limited, chat_reply('{"name": "x"}')]) as stub:
        client = LLMClient(env={"LLM_BASE_URL": stub.url, "LLM_API_KEY": "k",
                                "LLM_MODEL": f"m{uid}"}, redis=standalone_client)
        before = time.time()
        result = await client.structured("hi", SCHEMA)
        assert result.data == {"name": "x"}
    [state] = provider_keys(f"llm|m{uid}", "gcra")
    pause_until = float(await standalone_client.hget(state, "pause")) / 1000
    assert before + 0.1 <= pause_until <= before + 0.5
    assert stub.seen[1].at >= pause_until - 0.01


# -- error bodies ------------------------------------------------------------------------------

def test_rejected_schema_is_the_callers_422(lambda_env: StartEnvironment,
                                            redis_server: RedisServer) -> None:
    """OpenAI's invalid_json_schema answers 422 schema_rejected with its reason, refunded."""
    reason = "Invalid schema for response_format 'result': 'format' value 'color' is unknown."
    rejected = openai_error(400, "invalid_json_schema", reason, kind="invalid_request_error",
                            param="response_format")
    with HttpStub([rejected]) as stub:
        res, user = call(lambda_env, redis_server, stub.url)
        strict_flags = [json.loads(s.body)["response_format"]["json_schema"]["strict"]
                        for s in stub.seen]
    assert res.status == 422, res.body
    assert res.body["error"]["code"] == "schema_rejected"
    assert res.body["error"]["reason"] == reason
    assert strict_flags == [True, False]  # strict refused: asked once more without it
    assert used(user) == 0


def test_a_strict_schema_refused_then_answered_says_so_and_is_charged(
        lambda_env: StartEnvironment, redis_server: RedisServer) -> None:
    """A provider refusing the schema in strict mode, then answering without it: 200 with
    strict false and the provider's reason in strict_rejected, charged like any answer."""
    reason = "Invalid schema for response_format 'result': strict mode is not supported."
    rejected = openai_error(400, "invalid_json_schema", reason, kind="invalid_request_error",
                            param="response_format")
    with HttpStub([rejected, chat_reply('{"name": "x"}')]) as stub:
        res, user = call(lambda_env, redis_server, stub.url)
        strict_flags = [json.loads(s.body)["response_format"]["json_schema"]["strict"]
                        for s in stub.seen]
    assert res.status == 200, res.body
    assert strict_flags == [True, False]
    assert (res.body["strict"], res.body["strict_rejected"]) == (False, reason)
    assert used(user) == 8


@pytest.mark.parametrize(("reply", "code"), [
    (openai_error(401, "invalid_api_key", "Incorrect API key provided: sk-abc12***********wxyz."
                  " You can find your API key at https://platform.openai.com/account/api-keys.",
                  kind="invalid_request_error"), "invalid_api_key"),
    (openai_error(404, "model_not_found", "The model `gpt-9` does not exist or you do not "
                  "have access to it.", kind="invalid_request_error"), "model_not_found")])
def test_operator_problems_are_logged_not_shown(
        lambda_env: StartEnvironment, redis_server: RedisServer,
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
        reply: Reply, code: str) -> None:
    """A bad key or model is a 502 without the provider's words, logged with its code, counted."""
    capsys.readouterr()
    with caplog.at_level(logging.ERROR, "atto_providers"), HttpStub([reply]) as stub:
        res, user = call(lambda_env, redis_server, stub.url)
    assert res.status == 502 and res.body["error"]["code"] == "provider_error"
    text = json.dumps(res.body)
    assert code not in text and "platform.openai.com" not in text and "gpt-9" not in text
    assert used(user) == 0
    logged = [r.getMessage() for r in caplog.records if "refused the request" in r.getMessage()]
    assert logged and code in logged[0] and "sk-abc12" not in logged[0]
    (line,) = provider_lines(capsys.readouterr().out)
    assert obs.UPSTREAM_REJECTED in line and obs.UPSTREAM_QUOTA not in line


# -- finish reasons and refusals -----------------------------------------------------------------

@pytest.mark.parametrize(("reply", "status", "code"), [
    (finished("length", '{"name": "unfinish'), 502, "output_truncated"),
    (finished("content_filter", None), 422, "content_filtered"),
    (finished("stop", None, refusal="I can't help with that."), 422, "model_refused")])
def test_each_unusable_ending_has_its_code(lambda_env: StartEnvironment,
                                           redis_server: RedisServer, reply: Reply,
                                           status: int, code: str) -> None:
    """length, content_filter and a refusal each answer their own code, refunded, and say
    so once."""
    with HttpStub([reply]) as stub:
        res, user = call(lambda_env, redis_server, stub.url)
    assert res.status == status and res.body["error"]["code"] == code, res.body
    assert res.body["error"]["message"].count("refunded") == 1, res.body
    if code == "model_refused":
        assert res.body["error"]["refusal"] == "I can't help with that."
    assert used(user) == 0


# -- strict mode ------------------------------------------------------------------------------

@pytest.mark.parametrize(("schema", "strict"), [
    (SCHEMA, True),
    ({"type": "object", "properties": {"name": {"type": "string"},
                                       "age": {"type": "integer"}}, "required": ["name"]}, False),
    ({"type": "object", "properties": {"name": {"type": "string", "minLength": 1}},
      "required": ["name"]}, False)])
def test_strict_mode_when_the_schema_fits(lambda_env: StartEnvironment,
                                          redis_server: RedisServer, schema: dict[str, Any],
                                          strict: bool) -> None:
    """A schema in strict mode's subset is sent strict (closed); others are not, and say so."""
    with HttpStub([chat_reply('{"name": "x"}')]) as stub:
        res, _ = call(lambda_env, redis_server, stub.url,
                      body={"prompt": "hi", "schema": schema})
        sent = json.loads(stub.seen[0].body)["response_format"]["json_schema"]
    assert res.status == 200, res.body
    assert res.body["strict"] is strict and sent["strict"] is strict
    assert res.body["strict_rejected"] is None
    if strict:
        assert sent["schema"] == {**schema, "additionalProperties": False}
    else:
        assert sent["schema"] == schema


# -- per-model throttle -------------------------------------------------------------------------

def test_embeddings_429_does_not_pause_chat(lambda_env: StartEnvironment,
                                            redis_server: RedisServer) -> None:
    """A 429 of the embedding model pauses that model's throttle only, not the chat model's."""
    limited = openai_error(429, "rate_limit_exceeded", "Rate limit reached", kind="requests",
                           headers={"retry-after": "30"})
    uid = uuid.uuid4().hex[:8]
    env = {"LLM_MODEL": f"chat{uid}", "LLM_EMBEDDING_MODEL": f"emb{uid}"}
    with HttpStub([limited]) as stub:
        res, _ = call(lambda_env, redis_server, stub.url, app=embeddings,
                      body={"input": ["hello"]}, env=env)
    assert res.status == 503 and res.body["error"]["code"] == "provider_busy"
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        [emb] = provider_keys(f"llm|emb{uid}", "gcra")
        [chat] = provider_keys(f"llm|chat{uid}", "gcra")
        assert float(client.hget(emb, "pause") or 0) / 1000 > time.time() + 20
        assert client.hget(chat, "pause") is None
    finally:
        client.close()


async def test_throttle_by_provider_shares_one_throttle(standalone_client: Any,
                                                         uid: str) -> None:
    """LLM_THROTTLE_BY=provider: every model takes the llm throttle; a bad value is refused."""
    from usage_limits.exceptions import InvalidArgument

    client = LLMClient(env={"LLM_THROTTLE_BY": "provider", "LLM_MODEL": f"m{uid}"},
                       redis=standalone_client)
    assert client.throttle_for(client._throttle_key(f"m{uid}")).provider == "llm"
    per_model = LLMClient(env={"LLM_MODEL": f"m{uid}"}, redis=standalone_client)
    assert per_model.throttle_for(per_model._throttle_key(f"m{uid}")).provider == f"llm|m{uid}"
    with pytest.raises(InvalidArgument, match="LLM_THROTTLE_BY"):
        LLMClient(env={"LLM_THROTTLE_BY": "route"})
