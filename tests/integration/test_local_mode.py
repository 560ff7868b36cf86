"""Local mode as a newcomer meets it: `make serve`, `make invoke`, their errors and events."""

from __future__ import annotations

import importlib
import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from local.lambda_events import http_event, invoke
from local.redis_servers import RedisServer, free_port
from local.template import every_function, functions
from tests import serving

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("route", [("GET", "/v1/usage", "usage"),
                                   ("POST", "/v1/structured", "structured")])
def test_local_401_names_the_user_header(route: tuple[str, str, str], redis_server: RedisServer,
                                         lambda_env: StartEnvironment) -> None:
    """In local mode a request without a user gets a 401 that says to send X-Atto-User."""
    method, path, name = route
    lambda_env({"ATTO_ENV": "local", "REDIS_URL": redis_server.url})
    handler = importlib.import_module(f"functions.{name}.app").handler
    body = {"prompt": "x", "schema": {"type": "string"}} if method == "POST" else None
    res = invoke(handler, http_event(method, path, body=body, user=None))
    assert res.status == 401
    assert res.body["error"]["code"] == "unauthorized"
    assert "X-Atto-User" in res.body["error"]["message"]


def test_cloud_401_does_not_offer_the_local_header(redis_server: RedisServer,
                                                   lambda_env: StartEnvironment) -> None:
    """Outside local mode the 401 asks for a bearer token and does not mention X-Atto-User."""
    lambda_env({"ATTO_ENV": "dev", "REDIS_URL": redis_server.url})
    handler = importlib.import_module("functions.usage.app").handler
    res = invoke(handler, http_event("GET", "/v1/usage", user=None,
                                     headers={"X-Atto-User": "alice"}))
    assert res.status == 401
    assert "bearer token" in res.body["error"]["message"]
    assert "X-Atto-User" not in res.body["error"]["message"]


def test_invoke_with_a_missing_event_file_is_one_line_and_exit_2() -> None:
    """`make invoke` with an EVENT file that does not exist says so in one line and exits 2."""
    out = serving.invoke("structured", "events/no_such_event.json")
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "events/no_such_event.json" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_invoke_with_a_misspelt_function_lists_each_function_once() -> None:
    """`make invoke FN=structurd` says the name is unknown and lists every function once
    (admin serves several routes), in one line, exit status 2."""
    out = serving.invoke("structurd", "events/structured.json")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "'structurd'" in lines[0], out.stderr
    known = lines[0].split("known: ", 1)[1].split(", ")
    assert known == sorted(set(known)) and {"admin", "auditor", "structured"} <= set(known)
    assert known == sorted(fn.name for fn in every_function())


@pytest.mark.slow
def test_make_invoke_runs_the_scheduled_auditor() -> None:
    """`make invoke FN=auditor` (no route; its EVENT defaults to
    events/auditor_schedule.json) runs one audit on the local stack and prints its report."""
    out = subprocess.run(["make", "-s", "invoke", "FN=auditor"], cwd=ROOT,
                         env=serving.fresh_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["balanced"] is True and report["users_not_audited"] == 0
    assert report["grants_expired_swept"] == 0


def test_invoke_audits_a_named_user_in_the_local_tables(tmp_path: Path) -> None:
    """The auditor, invoked with an event naming a user, reads that user's grants and
    usage records from the local DynamoDB tables and its windows from the local Redis it
    started: the user is audited (not left unaudited for a missing backend), a user never
    seen."""
    event = tmp_path / "audit_alice.json"
    event.write_text(json.dumps({"users": ["alice"]}))
    out = serving.invoke("auditor", event)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert (report["users_audited"], report["users_not_audited"]) == (1, 0)
    assert report["balanced"] is True
    assert "the ledger holds nothing of the user" in " ".join(report["notes"]["alice"])


def test_invoke_with_an_event_that_is_not_json_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """An EVENT file that is not a JSON object is refused in one line with exit status 2."""
    event = tmp_path / "broken.json"
    event.write_text("{not json")
    out = serving.invoke("structured", str(event))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(event) in lines[0], out.stderr


#: A batch of 64 texts, about 513 kB of JSON: above the default body cap of 256 KiB, within
#: the 1 MiB that template.yaml gives the embeddings function.
BIG_BATCH = {"input": ["senior python engineer " * 340] * 64}


def test_template_gives_embeddings_a_larger_body_cap() -> None:
    """The template's own environment is what makes the big batch fit (a guard on the data)."""
    caps = {fn.logical_id: fn.env.get("ATTO_MAX_BODY_BYTES") for fn in functions()}
    assert caps["EmbeddingsFunction"] == str(1024 * 1024)
    assert caps["StructuredFunction"] is None
    assert 256 * 1024 < len(json.dumps(BIG_BATCH)) < 1024 * 1024


@pytest.mark.slow
def test_serve_applies_each_functions_template_environment() -> None:
    """Under `make serve` embeddings takes a 513 kB batch (its 1 MiB cap) while structured,
    served by the same worker in between, still refuses a body over 256 KiB."""
    big_prompt = {"prompt": "x" * 300_000, "schema": {"type": "string"}}
    with serving.serve() as served:
        def post(path: str, body: object, user: str) -> httpx.Response:
            return httpx.post(served.url + path, json=body, timeout=120,
                              headers={"X-Atto-User": user})

        # a 513 kB batch costs 63 tokens (priced by size): one per user fits a 100/1h plan
        first = post("/v1/embeddings", BIG_BATCH, "env-check-1")
        refused = post("/v1/structured", big_prompt, "env-check-1")
        again = post("/v1/embeddings", BIG_BATCH, "env-check-2")
    assert first.status_code == 200, first.text
    assert len(first.json()["data"]) == 64
    assert refused.status_code == 413
    assert refused.json()["error"]["limit_bytes"] == 256 * 1024
    assert again.status_code == 200, again.text


@pytest.mark.slow
def test_invoke_applies_the_functions_template_environment(tmp_path: Path) -> None:
    """`make invoke` gives embeddings its template body cap: the 513 kB batch is answered."""
    event = tmp_path / "big.json"
    event.write_text(json.dumps(http_event("POST", "/v1/embeddings", body=BIG_BATCH)))
    out = serving.invoke("embeddings", event)
    assert out.returncode == 0, out.stderr[-2000:]
    response = json.loads(out.stdout)
    assert response["statusCode"] == 200, response["body"]
    assert len(response["body"]["data"]) == 64


@pytest.mark.slow
def test_serve_with_its_port_taken_says_so_before_any_banner() -> None:
    """`make serve` on a port in use exits 2 with one clear line and prints no banner."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        out = subprocess.run([sys.executable, "-m", "local.serve"], cwd=ROOT,
                             env=serving.fresh_env({"PORT": str(port)}), capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 2
    assert "Atto Cloud (local) on" not in out.stdout
    assert re.fullmatch(rf"make serve: port {port} on 127\.0\.0\.1 is already in use.*\n",
                        out.stderr), out.stderr


def test_emulator_with_its_port_taken_says_so_before_any_banner() -> None:
    """The emulator on a port in use exits 2 with one clear line and prints no banner."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        out = subprocess.run([sys.executable, "-m", "local.emulator", "--port", str(port)],
                             cwd=ROOT, env=serving.fresh_env({}), capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 2
    assert "serving on" not in out.stderr
    assert re.fullmatch(rf"emulator: port {port} on 127\.0\.0\.1 is already in use.*\n",
                        out.stderr), out.stderr


@pytest.mark.parametrize("content_type",
                         ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_body_not_sent_as_json_gets_415_naming_the_header(
        content_type: str | None, redis_server: RedisServer,
        lambda_env: StartEnvironment) -> None:
    """A JSON body sent with another Content-Type (curl -d without -H) or none gets 415
    whose message names Content-Type: application/json, and nothing is charged."""
    lambda_env({"ATTO_ENV": "local", "REDIS_URL": redis_server.url})
    structured = importlib.import_module("functions.structured.app").handler
    usage = importlib.import_module("functions.usage.app").handler
    user = f"ct-{str(content_type).replace('/', '-')}"
    event = http_event("POST", "/v1/structured", user=user,
                       body={"prompt": "x", "schema": {"type": "string"}},
                       headers={"Content-Type": content_type or ""})
    if content_type is None:
        del event["headers"]["content-type"]
    res = invoke(structured, event)
    assert res.status == 415, res.body
    assert res.body["error"]["code"] == "invalid_request"
    assert "Content-Type: application/json" in res.body["error"]["message"]
    assert invoke(usage, http_event("GET", "/v1/usage", user=user)).body["events"] == []


def test_a_json_body_that_fails_validation_still_gets_422_with_details(
        redis_server: RedisServer, lambda_env: StartEnvironment) -> None:
    """With Content-Type: application/json a wrong body keeps its 422 and its details."""
    lambda_env({"ATTO_ENV": "local", "REDIS_URL": redis_server.url})
    structured = importlib.import_module("functions.structured.app").handler
    res = invoke(structured, http_event("POST", "/v1/structured", body={"prompt": 5}))
    assert res.status == 422
    assert {tuple(d["loc"]) for d in res.body["error"]["details"]} >= {("body", "schema")}


def test_local_unknown_plan_header_is_400_naming_the_plans(
        redis_server: RedisServer, lambda_env: StartEnvironment) -> None:
    """In local mode an X-Atto-Plan naming no plan is refused 400 with the plans' names,
    on free and metered routes, instead of falling back to the default."""
    lambda_env({"ATTO_ENV": "local", "REDIS_URL": redis_server.url,
                "ATTO_PLANS": "free=100/1h;pro=400/1h", "ATTO_DEFAULT_PLAN": "free"},
               unset=("ATTO_BUDGET",))
    for name, method, path, body in [
            ("usage", "GET", "/v1/usage", None),
            ("structured", "POST", "/v1/structured",
             {"prompt": "x", "schema": {"type": "string"}})]:
        handler = importlib.import_module(f"functions.{name}.app").handler
        res = invoke(handler, http_event(method, path, body=body, user="plan-typo",
                                         headers={"X-Atto-Plan": "gold"}))
        assert res.status == 400, res.body
        assert "free, pro" in res.body["error"]["message"]
        assert "X-Atto-Plan" in res.body["error"]["message"]
    usage = importlib.import_module("functions.usage.app").handler
    res = invoke(usage, http_event("GET", "/v1/usage", user="plan-typo",
                                   headers={"X-Atto-Plan": "pro"}))
    assert res.status == 200 and res.body["plan"] == "pro"
