"""The operator CLI's client: SigV4 signatures checked by an independent verifier, no
signing for loopback, the stack's URL from CloudFormation (moto), errors in the API's shape."""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

import boto3
import pytest
from moto import mock_aws

from atto_admin import AdminClient, AdminError, stack_url
from atto_admin.cli import main

ROOT = Path(__file__).resolve().parents[2]
KEY_ID, SECRET = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"


class Captured(BaseHTTPRequestHandler):
    """Records each request and answers with what the test queued."""

    requests: list[dict[str, Any]] = []
    answer: tuple[int, Any] = (200, {"ok": True})

    def _handle(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        Captured.requests.append({"method": self.command, "path": self.path,
                                  "headers": {k.lower(): v for k, v in self.headers.items()},
                                  "body": body})
        status, payload = Captured.answer
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = _handle

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A loopback HTTP server that records requests; static AWS credentials in the env."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    Captured.requests = []
    Captured.answer = (200, {"ok": True})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Captured)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def verify_sigv4(req: dict[str, Any], region: str, service: str = "execute-api") -> None:
    """Recompute the request's SigV4 signature from scratch and compare (AWS's algorithm)."""
    auth = req["headers"]["authorization"]
    algorithm, _, rest = auth.partition(" ")
    assert algorithm == "AWS4-HMAC-SHA256"
    fields = dict(part.strip().split("=", 1) for part in rest.split(","))
    key_id, date, cred_region, cred_service, terminal = fields["Credential"].split("/")
    assert (key_id, cred_region, cred_service, terminal) == (KEY_ID, region, service,
                                                             "aws4_request")
    signed = fields["SignedHeaders"].split(";")
    assert "host" in signed and "x-amz-date" in signed
    url = urlsplit(req["path"])
    query = "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}"
                     for k, v in sorted(parse_qsl(url.query, keep_blank_values=True)))
    headers = "".join(f"{h}:{' '.join(req['headers'][h].split())}\n" for h in signed)
    # Every service but S3 encodes the (already encoded) path a second time.
    canonical = "\n".join([req["method"], quote(url.path, safe="/-_.~"), query, headers,
                           fields["SignedHeaders"], hashlib.sha256(req["body"]).hexdigest()])
    stamp = req["headers"]["x-amz-date"]
    scope = f"{date}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + SECRET).encode(), date), region), service),
                "aws4_request")
    assert hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest() == fields["Signature"]


def test_signed_requests_carry_a_valid_sigv4_signature(server: str) -> None:
    """With signing on, a change with a body and a query with parameters are both signed
    correctly for execute-api in the chosen region (verified independently)."""
    client = AdminClient(server, sign=True, region="eu-west-1")
    client.create_grant("user 1/é", tokens=500, kind="paid", reference="inv_123",
                        reason="bought", expires_at="2027-01-31T00:00:00Z")
    client.log("user 1", limit=5)
    grant, audit = Captured.requests
    assert grant["path"] == "/admin/v1/users/user%201%2F%C3%A9/grants"
    assert json.loads(grant["body"]) == {"tokens": 500, "kind": "paid", "reference": "inv_123",
                                         "reason": "bought",
                                         "expires_at": "2027-01-31T00:00:00Z"}
    for req in (grant, audit):
        verify_sigv4(req, "eu-west-1")
    assert dict(parse_qsl(urlsplit(audit["path"]).query)) == {"user_id": "user 1", "limit": "5"}


def test_a_tampered_request_fails_verification(server: str) -> None:
    """The verifier rejects a signed request whose body was changed after signing."""
    AdminClient(server, sign=True, region="us-east-1").set_plan("u", "pro", "r")
    req = Captured.requests[0]
    verify_sigv4(req, "us-east-1")
    with pytest.raises(AssertionError):
        verify_sigv4({**req, "body": req["body"].replace(b"pro", b"max")}, "us-east-1")


def test_loopback_is_not_signed_by_default(server: str) -> None:
    """Against make serve (a loopback URL) nothing is signed."""
    AdminClient(server).show("alice")
    assert "authorization" not in Captured.requests[0]["headers"]
    assert Captured.requests[0]["path"] == "/admin/v1/users/alice"


def test_region_comes_from_the_execute_api_host() -> None:
    """A deployed URL names its signing region; the client uses it."""
    client = AdminClient("https://abc123.execute-api.ap-south-1.amazonaws.com/")
    assert client.signer is not None and client.signer.region == "ap-south-1"


def test_errors_keep_the_api_code_and_message(server: str) -> None:
    """A 4xx answer becomes AdminError with the body's code and message; API Gateway's own
    {"message"} bodies are read too."""
    Captured.answer = (404, {"error": {"code": "not_found", "message": "no grant 'x'"}})
    with pytest.raises(AdminError) as caught:
        AdminClient(server).void_grant("u", "x", "r")
    assert (caught.value.status, caught.value.code, caught.value.message) == \
        (404, "not_found", "no grant 'x'")
    Captured.answer = (403, {"message": "Forbidden"})
    with pytest.raises(AdminError) as caught:
        AdminClient(server).show("u")
    assert (caught.value.status, caught.value.message) == (403, "Forbidden")


def test_url_comes_from_the_stack_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """--stack reads the AdminApiUrl output with DescribeStacks; a stack without it fails."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        cf = boto3.client("cloudformation", region_name="us-east-1")
        url = "https://abc123.execute-api.us-east-1.amazonaws.com/"
        for name, outputs in (("with", {"AdminApiUrl": {"Value": url}}), ("without", {})):
            cf.create_stack(StackName=name, TemplateBody=json.dumps({
                "Resources": {"T": {"Type": "AWS::SNS::Topic"}}, "Outputs": outputs}))
        assert stack_url("with", region="us-east-1") == url
        with pytest.raises(AdminError, match="AdminApiUrl"):
            stack_url("without", region="us-east-1")


def test_cli_prints_json_or_lines_and_exits_1_on_errors(
        server: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints the answer as JSON; without it a readable line; an API error prints
    its code and exits 1."""
    Captured.answer = (200, {"user_id": "u", "override": {"plan": "pro"}})
    assert main(["--url", server, "--json", "plan", "set", "u", "pro", "--reason", "r"]) == 0
    assert json.loads(capsys.readouterr().out)["override"]["plan"] == "pro"
    assert main(["--url", server, "plan", "set", "u", "pro", "--reason", "r"]) == 0
    assert capsys.readouterr().out.strip() == "u is now on plan pro"
    Captured.answer = (400, {"error": {"code": "invalid_request", "message": "bad"}})
    assert main(["--url", server, "plan", "set", "u", "x", "--reason", "r"]) == 1
    assert "HTTP 400 invalid_request: bad" in capsys.readouterr().err


def test_the_cli_never_imports_the_layers() -> None:
    """atto_admin depends on the HTTP contract only: importing it loads no usage_limits."""
    code = ("import sys, atto_admin.cli; "
            "sys.exit(any(m.split('.')[0] in ('usage_limits', 'atto_providers') "
            "for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tools",
                            env={"PYTHONPATH": str(ROOT / "tools"), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_an_explicit_stack_beats_the_environment_and_every_change_names_its_target(
        server: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--stack wins over ATTO_ADMIN_URL; a change prints where it goes; a change to a prod
    stack is refused without --yes when there is no terminal to ask on."""
    from atto_admin import cli

    monkeypatch.setenv("ATTO_ADMIN_URL", "http://127.0.0.1:9")
    monkeypatch.setattr(cli, "stack_url", lambda name, **kw: server)
    Captured.answer = (200, {"user_id": "u", "override": {"plan": "pro"}})
    assert main(["--stack", "atto-cloud-dev", "plan", "set", "u", "pro", "--reason", "r"]) == 0
    assert f"plan set -> {server} (stack atto-cloud-dev)" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["plan", "set", "u", "pro", "--reason", "r", "--stack", "atto-cloud-prod"]) == 1
    assert "pass --yes" in capsys.readouterr().err
    assert main(["--stack", "atto-cloud-prod", "--yes", "plan", "set", "u", "pro",
                 "--reason", "r"]) == 0
    assert "(stack atto-cloud-prod)" in capsys.readouterr().err


def _books_answer(divergences: list[dict[str, Any]]) -> dict[str, Any]:
    return {"balanced": not divergences, "divergences": divergences,
            "divergence_count": len(divergences),
            "divergence_tokens": sum(d["tokens"] for d in divergences),
            "users_active": 1, "users_audited": 1, "users_not_audited": 0, "sample": 1.0,
            "since": "2026-12-02T10:00:00.000Z", "until": "2026-12-02T11:00:00.000Z",
            "started": "2026-12-02T11:00:00.000Z", "duration_ms": 5, "repaired": [],
            "notes": {}}


def test_audit_prints_each_divergence_with_its_fix_and_exits_3(
        server: str, capsys: pytest.CaptureFixture[str]) -> None:
    """audit posts the user and --repair to the books route, prints every divergence with
    its fix and exits 3 when the books do not balance, 0 when they do."""
    divergence = {"kind": "grant_consumed", "user_id": "u", "tokens": 1,
                  "request_ids": ["r:1"], "reference": "inv", "detail": "consumed 5, its "
                  "charge records hold 4", "fix": "atto-admin show u", "repaired": False,
                  "nonce": ""}
    Captured.answer = (200, _books_answer([divergence]))
    assert main(["--url", server, "audit", "--user", "u", "--repair"]) == 3
    out = capsys.readouterr().out
    assert "1 divergences, 1 tokens off" in out and "grant_consumed" in out
    assert "fix: atto-admin show u" in out
    request = Captured.requests[-1]
    assert (request["method"], request["path"]) == ("POST", "/admin/v1/books")
    assert json.loads(request["body"]) == {"user_id": "u", "repair": True}
    Captured.answer = (200, _books_answer([]))
    assert main(["--url", server, "audit"]) == 0
    assert "the books balance" in capsys.readouterr().out
    assert json.loads(Captured.requests[-1]["body"]) == {"repair": False}


def test_audit_that_could_not_read_a_user_never_says_the_books_balance(
        server: str, capsys: pytest.CaptureFixture[str]) -> None:
    """No divergence but a user not audited (Redis or DynamoDB did not answer): the output
    says so and prints the note, and the exit status is 4, not the 0 of balanced books."""
    answer = _books_answer([]) | {
        "users_audited": 0, "users_not_audited": 1,
        "notes": {"u": ["not audited: DynamoDB or Redis did not answer"]}}
    Captured.answer = (200, answer)
    assert main(["--url", server, "audit", "--user", "u"]) == 4
    out = capsys.readouterr().out
    assert "the books balance" not in out and "1 not audited" in out
    assert "note u: not audited: DynamoDB or Redis did not answer" in out


def test_reload_posts_to_the_users_reload_route(server: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """reload drops the user's cached copy through its route and says so."""
    Captured.answer = (200, {"user_id": "a b", "reloaded": True, "epoch": 4})
    assert main(["--url", server, "reload", "a b"]) == 0
    assert Captured.requests[-1]["path"] == "/admin/v1/users/a%20b/reload"
    assert "were dropped" in capsys.readouterr().out


def test_statement_lines_separate_charged_refunded_and_kept(
        server: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The statement's readable lines: the span, then what was charged, refunded whole and
    kept (charges and tokens; a refunded failure is not counted as kept), then every day."""
    zero = {"charges": 0, "reserved": 0, "refunds": 0, "refunded": 0, "kept": 0, "credit": 0}
    summary = {"charges": 4, "reserved": 28, "refunds": 2, "refunded": 15, "kept": 13,
               "credit": 8}
    Captured.answer = (200, {
        "user_id": "u", "from": "2026-11-01T00:00:00.000Z", "to": "2026-11-03T00:00:00.000Z",
        "records": [], "days": [{"day": "2026-11-02", **summary}, {"day": "2026-11-01", **zero}],
        "summary": summary, "cursor": None})
    assert main(["--url", server, "statement", "u"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "statement of u from 2026-11-01T00:00:00.000Z to 2026-11-03T00:00:00.000Z"
    assert [line.split()[:5] for line in lines[1:4]] == [
        ["charged", "4", "charges", "28", "tokens"], ["refunded", "2", "charges", "15", "tokens"],
        ["kept", "2", "charges", "13", "tokens"]]
    assert "(8 drawn from credit)" in lines[3]
    assert lines[5].split() == ["2026-11-02", "4", "28", "2", "15", "13", "8"]
    assert lines[6].split() == ["2026-11-01", "0", "0", "0", "0", "0", "0"]
