"""Schemathesis against every function's OpenAPI schema, through its ASGI app.

Each function of template.yaml is loaded from its own ``app.py``; its schema
(``app.openapi()``, what ``/openapi.json`` serves) drives Schemathesis, whose requests go
to the same app in process. The app runs in local mode (``ATTO_ENV=local``) with a fresh
``X-Atto-User`` per case, so no budget runs out, against the session's real redis-server
and a healthy emulator for every provider, with the function's own web settings from
template.yaml (e.g. the embeddings body cap). Nothing fails on purpose here, so any 5xx is a
bug; every response must also have a documented status, content type and body.

Phases: examples, coverage and fuzzing, positive and negative data; ``MAX_EXAMPLES``
fuzzed cases per operation, derandomized (the same cases every run), no deadline.

Worked around, each for a stated reason:

- ``schema.parametrize()`` on schemas built at import, not ``schemathesis.pytest.
  from_fixture``: the lazy loader of Schemathesis 4.32 reads ``Node._nodeid``, which
  pytest 9.2 no longer has. Importing the apps is harmless (nothing connects at import),
  and the environment is set by a module fixture before the first request.
- ``POST /v1/job-extraction``: a ``url`` that passes the fetcher's offline checks
  (``atto_providers.fetch.check_url``) would be fetched from the internet. The test is
  hermetic, so such a URL is replaced by the emulator's job page; URLs the offline checks
  refuse are sent as generated (and get a documented 400).
- Hypothesis' ``too_slow`` health check is off: it times data generation on a shared
  machine, not the API.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import atto_providers.fetch as fetch
import atto_providers.llm as llm
import atto_providers.salary as salary
import atto_providers.search as search
from local.dynamodb import DynamoServer
from local.emulator import EmulatorProcess
from local.redis_servers import RedisServer
from local.template import FunctionSpec, functions
from usage_limits.entitlements.store import set_store
from usage_limits.web import idempotency, runtime, settings

#: Fuzzed cases per operation (the examples and coverage phases add their own).
MAX_EXAMPLES = 25
CONFIG = {
    "suppress-health-check": ["too_slow"],
    "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
}
#: What every response is checked for.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
#: The emulator's page fetched instead of URLs that would leave the machine.
JOB_PAGE = "senior-python-developer-leeds"
LOCAL_USER_HEADER = "X-Atto-User"
#: Web-layer settings a function may set in template.yaml (embeddings raises the body cap).
FUNCTION_SETTINGS = ("ATTO_MAX_BODY_BYTES", "ATTO_DEADLINE_MARGIN_S", "ATTO_REQUEST_TIMEOUT_S")

SPECS = functions()


def _app(spec: FunctionSpec) -> Any:
    """The function's FastAPI app (``functions/structured`` -> ``functions.structured.app``)."""
    module = ".".join(Path(spec.code_dir).parts) + "." + spec.handler.partition(".")[0]
    return importlib.import_module(module).app


def _reset() -> None:
    settings.cache_clear()
    set_store(None)
    runtime.set_redis(None)
    idempotency.reset()
    llm._client = None
    salary._client = None
    search._client = None
    fetch._fetcher = None


@pytest.fixture(scope="module")
def local_env(redis_server: RedisServer, emulator: EmulatorProcess) -> Iterator[EmulatorProcess]:
    """Local mode, real Redis, every provider on the emulator, throttles that never wait, and
    a local DynamoDB for the operator API and the usage records."""
    emulator.reset()
    with pytest.MonkeyPatch.context() as env, DynamoServer() as dynamo:
        for name, value in {
            "ATTO_ENTITLEMENTS_TABLE": dynamo.table, "ATTO_DYNAMODB_ENDPOINT": dynamo.url,
            "ATTO_USAGE_TABLE": dynamo.usage_table,  # the statements read it
            "AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local",
            "AWS_DEFAULT_REGION": "us-east-1",
            "ATTO_ENV": "local", "REDIS_URL": redis_server.url, "ATTO_BUDGET": "1000/1h",
            "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "test-llm-key",
            "SALARY_BASE_URL": emulator.adzuna_base_url, "SALARY_APP_ID": "test-id",
            "SALARY_APP_KEY": "test-key",
            "SEARCH_BASE_URL": emulator.tavily_base_url, "SEARCH_API_KEY": "test-search-key",
            "PAGES_ALLOW_PRIVATE_HOSTS": "127.0.0.1",
            "LLM_RATE": "1000/s", "SALARY_RATE": "1000/s", "SEARCH_RATE": "1000/s",
            "PAGES_RATE": "1000/s",
        }.items():
            env.setenv(name, value)
        for name in ("LLM_SECRET_ARN", "SALARY_SECRET_ARN", "SEARCH_SECRET_ARN",
                     "AWS_LAMBDA_FUNCTION_NAME", "LLM_CONCURRENCY", "SALARY_CONCURRENCY",
                     "SEARCH_CONCURRENCY", "PAGES_CONCURRENCY"):
            env.delenv(name, raising=False)
        _reset()
        yield emulator
    _reset()


def _hermetic(case: Any, emulator: EmulatorProcess) -> None:
    """Point a job-extraction URL that would be fetched from the internet at the emulator."""
    body = case.body
    if case.path != "/v1/job-extraction" or not isinstance(body, dict):
        return
    url = body.get("url")
    if not isinstance(url, str):
        return
    try:
        fetch.check_url(url)
    except fetch.PageRefused:
        return  # refused before any network access: sent as generated
    body["url"] = emulator.job_page_url(JOB_PAGE)


def _operation_test(spec: FunctionSpec) -> Callable[..., None]:
    """A Schemathesis test of every operation in ``spec``'s app."""
    schema = schemathesis.openapi.from_dict(_app(spec).openapi(),
                                            config=SchemathesisConfig.from_dict(CONFIG))
    schema.app = _app(spec)  # requests go to the app in process (ASGI)

    own = {name: spec.env[name] for name in FUNCTION_SETTINGS if name in spec.env}

    @schema.parametrize()
    def test(case: Any, local_env: EmulatorProcess) -> None:
        _hermetic(case, local_env)
        with pytest.MonkeyPatch.context() as env:
            for name, value in own.items():
                env.setenv(name, value)
            settings.cache_clear()
            case.call_and_validate(headers={LOCAL_USER_HEADER: f"fuzz-{uuid.uuid4().hex}"},
                                   checks=CHECKS)
        settings.cache_clear()

    test.__doc__ = (f"Every generated request to {spec.route_key} gets a documented, non-5xx "
                    "answer whose body fits the schema.")
    return test


# One test per function (test_structured, test_embeddings, ...), each parametrized by
# Schemathesis over the operations of that function's app.
for _spec in SPECS:
    globals()["test_" + Path(_spec.code_dir).name] = _operation_test(_spec)


@pytest.mark.parametrize("spec", SPECS, ids=[spec.logical_id for spec in SPECS])
def test_each_schema_declares_its_template_route(spec: FunctionSpec) -> None:
    """The app's schema has the route template.yaml sends to it, so the fuzzing reaches it."""
    paths = _app(spec).openapi()["paths"]
    assert spec.method.lower() in paths.get(spec.path, {})
