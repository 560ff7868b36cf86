"""Handlers answer the events `sam local generate-event` makes, and `make invoke` runs one."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import atto_providers.llm as llm
from local.emulator import EmulatorProcess
from local.lambda_events import invoke, lambda_loop
from local.redis_servers import RedisServer
from usage_limits.web import idempotency, runtime, settings

ROOT = Path(__file__).resolve().parents[2]
SAM = ROOT / ".tools" / "bin" / "sam"
structured = importlib.import_module("functions.structured.app")
usage_fn = importlib.import_module("functions.usage.app")


def generate_event(method: str, path: str, body: Any = None) -> dict[str, Any]:
    """`sam local generate-event apigateway http-api-proxy` for this route."""
    if not SAM.exists():
        pytest.fail("the SAM CLI is missing: run `make tools`")
    args = [str(SAM), "local", "generate-event", "apigateway", "http-api-proxy",
            "--method", method, "--path", path.lstrip("/")]
    if body is not None:
        args += ["--body", json.dumps(body)]
    env = {**os.environ, "SAM_CLI_TELEMETRY": "0"}
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=env, timeout=60)
    return json.loads(out.stdout)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer) -> Iterator[EmulatorProcess]:
    """Handlers over the session's redis-server and an emulator, outside local mode."""
    with EmulatorProcess() as emu:
        for name, value in {"REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h",
                            "LLM_BASE_URL": emu.openai_base_url, "LLM_API_KEY": "k",
                            "LLM_RATE": "1000/s"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("ATTO_ENV", raising=False)
        settings.cache_clear()
        runtime.set_redis(None)
        idempotency.reset()
        llm._client = None
        with lambda_loop():
            yield emu
        settings.cache_clear()
        runtime.set_redis(None)
        llm._client = None


def with_sub(event: dict[str, Any], user: str) -> dict[str, Any]:
    """The sample event as the local app sends it: a user, a JSON body, its own request id."""
    event["requestContext"]["authorizer"]["jwt"]["claims"]["sub"] = user
    event["headers"]["content-type"] = "application/json"
    event["requestContext"]["requestId"] = uuid.uuid4().hex
    return event


def test_generated_event_without_sub_is_401(env: EmulatorProcess) -> None:
    """SAM's sample event has JWT claims but no `sub`: nobody is identified, nothing runs."""
    event = generate_event("POST", "/v1/structured", {"prompt": "x", "schema": {"type": "string"}})
    res = invoke(structured.handler, event)
    assert res.status == 401 and res.body["error"]["code"] == "unauthorized"
    assert env.family_stats("llm")["arrivals"] == 0


def test_generated_event_with_sub_is_served_and_charged(env: EmulatorProcess) -> None:
    """The same event with a `sub` claim (its body base64-encoded by SAM) is answered and
    charged."""
    user = uuid.uuid4().hex
    body = {"prompt": "Senior Python engineer", "schema": {
        "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}}
    res = invoke(structured.handler, with_sub(generate_event("POST", "/v1/structured", body), user))
    assert res.status == 200 and isinstance(res.body["data"]["title"], str)
    usage = invoke(usage_fn.handler, with_sub(generate_event("GET", "/v1/usage"), user))
    assert usage.status == 200 and usage.body["windows"][0]["used"] == 8


def test_make_invoke_runs_a_handler_with_an_event_file() -> None:
    """`make invoke` (python -m local.invoke) starts what it needs and prints the response."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "LLM_BASE_URL")}
    out = subprocess.run([sys.executable, "-m", "local.invoke", "structured",
                          "events/structured.json"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    response = json.loads(out.stdout)
    assert response["statusCode"] == 200
    assert "ratelimit" in {k.lower() for k in response["headers"]}
    assert isinstance(response["body"]["data"], dict)
