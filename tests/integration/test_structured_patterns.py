"""A caller's JSON Schema regexes are matched in linear time: a backtracking pattern cannot
hold the event loop, and a regex that cannot be matched that way is refused before any
charge. Handlers run through Mangum with the real redis-server and a loopback LLM stub."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from local.lambda_events import http_event, invoke
from local.redis_servers import RedisServer
from tests.httpstub import HttpStub, chat_reply
from tests.ledger import used

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.conftest import StartEnvironment

ROOT = Path(__file__).resolve().parents[2]
structured = importlib.import_module("functions.structured.app")

#: Backtracking needs about 2**40 steps for this answer (hours); RE2 needs 41.
EVIL = "^(a+)+$"
ANSWER = "a" * 40 + "b"
#: Seconds the child process gets: the linear check takes milliseconds, the backtracking
#: one would take hours, so the bound decides nothing but which of the two ran.
CHILD_LIMIT_S = 60


def check_in_child(value: Any, schema: dict[str, Any]) -> str:
    """Run ``llm._check(value, schema)`` in a child process; its outcome's class name."""
    code = ("import json, sys\n"
            "from atto_providers.llm import _check\n"
            "value, schema = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
            "try:\n    _check(value, schema)\n    print('valid')\n"
            "except Exception as exc:\n    print(type(exc).__name__)\n")
    path = ":".join(str(ROOT / p) for p in (".", "layers/usage_limits", "layers/providers"))
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(value), json.dumps(schema)],
                              capture_output=True, text=True, timeout=CHILD_LIMIT_S,
                              env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"}, check=True)
    except subprocess.TimeoutExpired:
        return "still running"
    return done.stdout.strip()


def test_backtracking_pattern_is_checked_in_linear_time() -> None:
    """``^(a+)+$`` against 40 a's and a b is found invalid at once, not after hours."""
    assert check_in_child(ANSWER, {"type": "string", "pattern": EVIL}) == "ProviderError"


def test_backtracking_property_pattern_is_checked_in_linear_time() -> None:
    """A backtracking ``patternProperties`` key with ``additionalProperties: false`` too."""
    schema = {"type": "object", "patternProperties": {EVIL: {"type": "integer"}},
              "additionalProperties": False}
    assert check_in_child({ANSWER: 1}, schema) == "ProviderError"
    assert check_in_child({"aaa": 1}, schema) == "valid"


@pytest.fixture
def stub_llm(lambda_env: StartEnvironment, redis_server: RedisServer,
             request: pytest.FixtureRequest) -> Iterator[HttpStub]:
    """The structured function's environment with a loopback LLM answering ``param``."""
    with HttpStub([chat_reply(json.dumps(request.param))]) as stub:
        lambda_env({"REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h",
                    "LLM_BASE_URL": stub.url, "LLM_API_KEY": "k", "LLM_RATE": "1000/s"},
                   unset=("ATTO_ENV", "LLM_SECRET_ARN"))
        yield stub


def ask(user: str, schema: dict[str, Any]) -> Any:
    return invoke(structured.handler, http_event("POST", "/v1/structured", user=user,
                                                 body={"prompt": "answer", "schema": schema}))


@pytest.mark.parametrize("stub_llm", [ANSWER], indirect=True)
def test_steered_answer_is_a_refunded_502(stub_llm: HttpStub) -> None:
    """An answer that would make ``^(a+)+$`` backtrack is a 502 at once, and refunded."""
    user = uuid.uuid4().hex
    res = ask(user, {"type": "string", "pattern": EVIL})
    assert res.status == 502
    assert res.body["error"]["code"] == "provider_error"
    assert used(user) == 0


@pytest.mark.parametrize("stub_llm", ["abc-123"], indirect=True)
def test_matching_answer_passes(stub_llm: HttpStub) -> None:
    """An answer that matches an ordinary pattern is returned and charged."""
    user = uuid.uuid4().hex
    res = ask(user, {"type": "string", "pattern": r"^[a-z]+-\d+$"})
    assert res.status == 200, res.body
    assert res.body["data"] == "abc-123"
    assert used(user) == 8


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": r"^(a)\1$"},
    {"type": "string", "pattern": "^(?=a)a$"},
    {"type": "object", "patternProperties": {"(x{1000}){1000}": {}}},
    {"type": "object", "patternProperties": {"^a": {}}, "unevaluatedProperties": False},
])
@pytest.mark.parametrize("stub_llm", ["a"], indirect=True)
def test_regex_that_cannot_be_linear_is_refused_before_any_charge(
        stub_llm: HttpStub, schema: dict[str, Any]) -> None:
    """A regex RE2 cannot run is a 422 naming it; nothing is charged, no provider called."""
    user = uuid.uuid4().hex
    res = ask(user, schema)
    assert res.status == 422, res.body
    assert "regex" in json.dumps(res.body) or "unevaluatedProperties" in json.dumps(res.body)
    assert stub_llm.seen == []
    assert used(user) == 0
