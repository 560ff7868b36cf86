"""POST /v1/job-extraction through its Mangum handler, a real redis-server and the emulator.

The emulator serves job pages on 127.0.0.1, which is not public: the tests run in local
mode with ``PAGES_ALLOW_PRIVATE_HOSTS=127.0.0.1`` (honoured only there), and one test
shows that without local mode the same page is refused.
"""

from __future__ import annotations

import asyncio
import importlib
import socket
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import pytest
import redis

import atto_providers.fetch as fetch
from atto_providers.llm import DEFAULT_MODEL
from local.emulator import EmulatorProcess
from local.emulator.pages import job_posting
from local.lambda_events import (
    FakeContext,
    Result,
    fresh_environment,
    http_event,
    invoke,
)
from local.redis_servers import RedisServer
from tests.ledger import used
from usage_limits.keys import provider_keys
from usage_limits.web.errors import REFUNDED

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

ROUTE = "/v1/job-extraction"
COST = 10
SLUG = "senior-python-developer-leeds"


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer,
        emulator: EmulatorProcess) -> EmulatorProcess:
    """Local mode, the emulator allowlisted, fast throttles, fresh clients and settings."""
    emulator.reset()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "1000/1h", "ATTO_ENV": "local",
        "PAGES_ALLOW_PRIVATE_HOSTS": "127.0.0.1", "LLM_BASE_URL": emulator.openai_base_url,
        "LLM_API_KEY": "test-key", "LLM_RATE": "1000/s", "PAGES_RATE": "1000/s",
    }, unset=(
        "LLM_SECRET_ARN", "PAGES_BURST", "PAGES_CONCURRENCY",
    ))
    return emulator


@pytest.fixture
def handler(env: EmulatorProcess) -> Any:
    """The function's Mangum handler."""
    return importlib.import_module("functions.job_extraction.app").handler


def post(handler: Any, body: Any, *, user: str, headers: dict[str, str] | None = None,
         context: FakeContext | None = None) -> Result:
    return invoke(handler, http_event("POST", ROUTE, body=body, user=user, headers=headers),
                  context)


def arrivals(emu: EmulatorProcess, family: str) -> int:
    return int(emu.family_stats(family)["arrivals"])


def user_id() -> str:
    return uuid.uuid4().hex


def refused(res: Result, reason: str) -> None:
    assert res.status == 400, res.body
    assert res.body["error"]["code"] == "invalid_request"
    assert res.body["error"]["reason"] == reason
    assert res.body["error"]["message"]


# -- success ------------------------------------------------------------------------------

def test_url_with_json_ld_is_extracted_grounded_and_charged(handler: Any,
                                                            env: EmulatorProcess) -> None:
    """A job page's JSON-LD facts win over the model's reading; the route costs 10 tokens."""
    user, url = user_id(), env.job_page_url(SLUG)
    res = post(handler, {"url": url}, user=user)
    assert res.status == 200, res.body
    job, expected = res.body, job_posting(SLUG)
    assert job["title"] == expected["title"] and job["company"] == expected["company"]
    assert job["location"].startswith(expected["city"])
    assert job["salary"] == {"min": expected["salary_min"], "max": expected["salary_max"],
                             "currency": "GBP", "period": "year"}
    assert job["skills"] == expected["skills"]
    assert job["description_summary"] and job["structured_data"] is True
    assert job["source_url"] == url and job["model"]
    assert res.headers["ratelimit"].startswith('"1h";r=990;')
    assert used(user) == COST
    assert arrivals(env, "pages") == 1 and arrivals(env, "llm") == 1


def test_url_without_json_ld_is_extracted_by_the_model(handler: Any,
                                                       env: EmulatorProcess) -> None:
    """Without JSON-LD the listing comes from the page text and the model alone."""
    user = user_id()
    res = post(handler, {"url": env.job_page_url(SLUG) + "?jsonld=0"}, user=user)
    assert res.status == 200, res.body
    assert res.body["structured_data"] is False
    assert res.body["title"] and res.body["description_summary"]
    assert isinstance(res.body["skills"], list)
    assert res.body["employment_type"] in (None, "full_time", "part_time", "contract",
                                           "temporary", "internship", "volunteer", "other")
    assert used(user) == COST


def test_redirects_up_to_five_are_followed(handler: Any, env: EmulatorProcess) -> None:
    """Five redirects are followed, each checked, and source_url is where the page was."""
    user = user_id()
    res = post(handler, {"url": f"{env.pages_url}/redirect/4"}, user=user)
    assert res.status == 200, res.body
    assert res.body["source_url"] == f"{env.pages_url}/job/redirected-software-engineer"
    assert arrivals(env, "pages") == 6
    assert used(user) == COST


def test_pasted_html_is_extracted_without_fetching(handler: Any, env: EmulatorProcess) -> None:
    """Pasted HTML is parsed in place (JSON-LD included); no page is fetched."""
    user = user_id()
    html = httpx.get(env.job_page_url(SLUG), trust_env=False).text
    env.reset()
    res = post(handler, {"html": html, "source_url": "https://jobs.example/123"}, user=user)
    assert res.status == 200, res.body
    assert res.body["title"] == job_posting(SLUG)["title"]
    assert res.body["source_url"] == "https://jobs.example/123"
    assert arrivals(env, "pages") == 0 and arrivals(env, "llm") == 1
    assert used(user) == COST


def test_pasted_text_is_extracted(handler: Any, env: EmulatorProcess) -> None:
    """Plain pasted text goes to the model and gives a schema-valid listing."""
    user = user_id()
    text = ("Backend Engineer at Bluefin Robotics, Bristol. Hybrid. GBP 60,000-70,000 a "
            "year. Python, PostgreSQL, AWS. You will build and run our fleet APIs.")
    res = post(handler, {"text": text}, user=user)
    assert res.status == 200, res.body
    assert res.body["title"] and res.body["source_url"] is None
    assert res.body["structured_data"] is False
    assert used(user) == COST


# -- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    {}, {"url": "https://jobs.example/1", "text": "x"}, {"html": "<p>x</p>", "text": "x"},
    {"url": "https://jobs.example/1", "extra": 1}, {"text": "   "}, {"url": ""},
    {"url": 42}, {"url": "https://jobs.example/1", "source_url": "https://jobs.example/1"},
    {"text": "x", "source_url": "ftp://jobs.example/1"}, ["not", "an", "object"],
])
def test_bad_bodies_are_422_and_charge_nothing(handler: Any, env: EmulatorProcess,
                                               body: Any) -> None:
    """Anything but exactly one of url, html, text (strict fields) is 422 invalid_request."""
    user = user_id()
    res = post(handler, body, user=user)
    assert res.status == 422 and res.body["error"]["code"] == "invalid_request"
    assert used(user) == 0
    assert arrivals(env, "pages") == 0 and arrivals(env, "llm") == 0


# -- safe fetch through the handler -------------------------------------------------------

@pytest.mark.parametrize(("url", "reason"), [
    ("file:///etc/passwd", "unsupported_scheme"),
    ("gopher://127.0.0.1:6379/_FLUSHALL", "unsupported_scheme"),
    ("http://admin:secret@jobs.example/", "credentials_in_url"),
    ("http://localhost/", "private_address"),
    ("http://[::1]/", "private_address"),
    ("http://0.0.0.0/", "private_address"),
    ("http://2130706433/", "private_address"),
    ("http://0x7f000001/", "private_address"),
    ("http://017700000001/", "private_address"),
    ("http://10.0.0.1/", "private_address"),
    ("http://192.168.0.1/", "private_address"),
    ("http://100.64.0.1/", "private_address"),
    ("http://169.254.169.254/latest/meta-data/iam/", "private_address"),
    ("http://[::ffff:169.254.169.254]/", "private_address"),
    ("http://[fd00::1]/", "private_address"),
])
def test_refused_urls_are_400_with_a_reason_and_charge_nothing(
        handler: Any, env: EmulatorProcess, monkeypatch: pytest.MonkeyPatch, url: str,
        reason: str) -> None:
    """With the deployed policy, each way of reaching a non-public target is a 400 with a reason."""
    monkeypatch.setenv("ATTO_ENV", "dev")  # the allowlist is ignored: the cloud's policy
    fresh_environment()
    user = user_id()
    refused(post(handler, {"url": url}, user=user), reason)
    assert used(user) == 0 and arrivals(env, "llm") == 0


def test_default_policy_refuses_the_loopback_emulator(handler: Any, env: EmulatorProcess,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside local mode the allowlist is ignored: the emulator on 127.0.0.1 is refused."""
    monkeypatch.setenv("ATTO_ENV", "dev")
    fresh_environment()
    user = user_id()
    refused(post(handler, {"url": env.job_page_url(SLUG)}, user=user), "private_address")
    assert arrivals(env, "pages") == 0 and used(user) == 0


def test_other_loopback_addresses_stay_refused_in_local_mode(handler: Any,
                                                             env: EmulatorProcess) -> None:
    """The allowlist names 127.0.0.1 only: 127.0.0.2 and the name localhost stay refused."""
    user = user_id()
    port = env.port
    refused(post(handler, {"url": f"http://127.0.0.2:{port}/pages/job/x"}, user=user),
            "private_address")
    refused(post(handler, {"url": f"http://localhost:{port}/pages/job/x"}, user=user),
            "private_address")
    assert arrivals(env, "pages") == 0


def test_name_resolving_to_a_private_address_is_refused(
        handler: Any, env: EmulatorProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A public-looking name whose DNS answer is private is refused before any connection."""
    async def resolve(host: str, port: int) -> list[str]:
        return {"careers.example": ["10.1.2.3"]}.get(host) or ["93.184.216.34"]

    monkeypatch.setattr(fetch, "resolve_host", resolve)
    user = user_id()
    refused(post(handler, {"url": "https://careers.example/jobs/1"}, user=user),
            "private_address")
    assert used(user) == 0


def test_connection_is_pinned_to_the_checked_address(
        handler: Any, env: EmulatorProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host is resolved once and the connection goes to that address (no rebinding)."""
    answers = [["127.0.0.1"], ["169.254.169.254"]]
    calls: list[str] = []

    async def rebinding(host: str, port: int) -> list[str]:
        calls.append(host)
        return answers[min(len(calls), len(answers)) - 1]

    monkeypatch.setattr(fetch, "resolve_host", rebinding)
    user = user_id()
    # pinned.invalid never resolves in real DNS: only the pinned address can serve it
    res = post(handler, {"url": f"http://pinned.invalid:{env.port}/pages/job/{SLUG}"},
               user=user)
    assert res.status == 200, res.body
    assert calls == ["pinned.invalid"]
    assert res.body["title"] == job_posting(SLUG)["title"]


@pytest.mark.parametrize("target", [
    "http://169.254.169.254/latest/meta-data/", "http://10.0.0.8/admin",
    "http://localhost/", "http://[::ffff:127.0.0.1]:{port}/pages/job/x", "file:///etc/passwd",
])
def test_redirect_to_a_refused_url_is_refused_on_the_hop(handler: Any, env: EmulatorProcess,
                                                         target: str) -> None:
    """An allowed page that redirects somewhere refused is refused at that hop."""
    user = user_id()
    to = quote(target.format(port=env.port), safe="")
    res = post(handler, {"url": f"{env.pages_url}/redirect?to={to}"}, user=user)
    assert res.status == 400, res.body
    assert res.body["error"]["reason"] in ("private_address", "unsupported_scheme")
    assert res.body["error"]["redirects"] == 1
    assert arrivals(env, "pages") == 1 and arrivals(env, "llm") == 0
    assert used(user) == 0


def test_redirect_loop_is_refused(handler: Any, env: EmulatorProcess) -> None:
    """A redirect back to a URL already fetched is a redirect_loop."""
    user = user_id()
    refused(post(handler, {"url": f"{env.pages_url}/redirect?to=%23again"}, user=user),
            "redirect_loop")
    assert used(user) == 0


def test_more_than_five_redirects_are_refused(handler: Any, env: EmulatorProcess) -> None:
    """The sixth redirect is not followed."""
    user = user_id()
    refused(post(handler, {"url": f"{env.pages_url}/redirect/5"}, user=user),
            "too_many_redirects")
    assert arrivals(env, "pages") == 6 and used(user) == 0


@pytest.mark.parametrize("query", ["mb=3", "mb=3&chunked=1"])
def test_oversized_page_is_refused(handler: Any, env: EmulatorProcess, query: str) -> None:
    """Over 2 MiB is refused, by Content-Length or while streaming, nothing charged."""
    user = user_id()
    res = post(handler, {"url": f"{env.pages_url}/big?{query}"}, user=user)
    refused(res, "too_large")
    assert res.body["error"]["limit_bytes"] == 2 * 1024 * 1024
    assert arrivals(env, "llm") == 0 and used(user) == 0


def test_page_just_under_the_cap_is_read(handler: Any, env: EmulatorProcess) -> None:
    """A streamed page under the cap is read whole."""
    user = user_id()
    res = post(handler, {"url": f"{env.pages_url}/big?mb=1.5&chunked=1"}, user=user)
    assert res.status == 200, res.body
    assert used(user) == COST


def test_wrong_content_type_is_refused(handler: Any, env: EmulatorProcess) -> None:
    """Only HTML and plain text are accepted."""
    user = user_id()
    res = post(handler, {"url": f"{env.pages_url}/image/logo.png"}, user=user)
    refused(res, "unsupported_content_type")
    assert res.body["error"]["content_type"] == "image/png"
    assert used(user) == 0


def test_slow_page_times_out_within_the_deadline(handler: Any, env: EmulatorProcess) -> None:
    """A page slower than the request's deadline is a 502 timeout, refunded."""
    user = user_id()
    res = post(handler, {"url": f"{env.pages_url}/slow?ms=8000"}, user=user,
               context=FakeContext(timeout_s=2.0))
    assert res.status == 502, res.body
    assert res.body["error"]["code"] == "provider_error"
    assert res.body["error"]["provider"] == "pages" and res.body["error"]["reason"] == "timeout"
    assert used(user) == 0


def test_fetch_time_is_capped_by_the_policy(env: EmulatorProcess) -> None:
    """The fetcher gives up after max_time_s even with a long deadline."""
    from usage_limits.web import ProviderError

    fetcher = fetch.PageFetcher(policy=fetch.FetchPolicy(
        max_time_s=0.5, allow_private=fetch.FetchPolicy.from_env(
            {"ATTO_ENV": "local", "PAGES_ALLOW_PRIVATE_HOSTS": "127.0.0.1"}).allow_private))
    with pytest.raises(ProviderError) as info:
        asyncio.get_event_loop().run_until_complete(
            fetcher.fetch(f"{env.pages_url}/slow?ms=5000"))
    assert info.value.extra["reason"] == "timeout"


def test_page_error_status_is_502_and_refunded(handler: Any, env: EmulatorProcess) -> None:
    """A page that answers 500 is a provider_error of the pages provider."""
    user = user_id()
    res = post(handler, {"url": f"{env.pages_url}/status/500"}, user=user)
    assert res.status == 502
    assert res.body["error"]["message"].endswith("; " + REFUNDED)
    assert res.body["error"]["provider"] == "pages"
    assert res.body["error"]["upstream_status"] == 500
    assert used(user) == 0


def test_site_rate_limit_is_503_with_retry_after(handler: Any, env: EmulatorProcess) -> None:
    """A site's 429 is provider_busy with its Retry-After, refunded, and says so in the
    same words as a 502."""
    env.fail_next(1, 429, family="pages", retry_after_s=7)
    user = user_id()
    res = post(handler, {"url": env.job_page_url(SLUG)}, user=user)
    assert res.status == 503 and res.body["error"]["code"] == "provider_busy"
    assert res.body["error"]["message"].endswith(REFUNDED)
    assert res.headers["retry-after"] == "7"
    assert used(user) == 0


def test_closed_port_is_502_unreachable(handler: Any, env: EmulatorProcess) -> None:
    """A page nobody serves is a provider_error (unreachable), refunded."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    user = user_id()
    res = post(handler, {"url": f"http://127.0.0.1:{port}/job"}, user=user)
    assert res.status == 502 and res.body["error"]["reason"] == "unreachable"
    assert used(user) == 0


# -- the model ----------------------------------------------------------------------------

def test_llm_failure_is_502_and_refunded(handler: Any, env: EmulatorProcess) -> None:
    """The model's 500 is a provider_error and the tokens come back."""
    env.fail_next(1, 500, family="llm")
    user = user_id()
    res = post(handler, {"url": env.job_page_url(SLUG)}, user=user)
    assert res.status == 502 and res.body["error"]["provider"] == "llm"
    assert res.headers["ratelimit"].startswith('"1h";r=1000;')
    assert used(user) == 0


def test_llm_429_pauses_every_instance_and_is_retried(handler: Any, env: EmulatorProcess,
                                                      redis_server: RedisServer) -> None:
    """An upstream 429 sets the model's shared pause; the retry waits for it and succeeds."""
    env.fail_next(1, 429, family="llm", retry_after_s=0.3)
    user = user_id()
    res = post(handler, {"text": "Data Engineer at Cobalt Fintech in London, Python and SQL."},
               user=user)
    assert res.status == 200, res.body
    stats = env.family_stats("llm")
    assert stats["arrivals"] == 2 and stats["status_counts"] == {"200": 1, "429": 1}
    client = redis.Redis.from_url(redis_server.url)
    [state] = provider_keys(f"llm|{DEFAULT_MODEL}", "gcra")
    try:
        pause_until = float(client.hget(state, "pause") or 0) / 1000
    finally:
        client.close()
    first, second = stats["arrival_times"]
    assert pause_until >= first + 0.3 - 0.01
    assert second >= pause_until - 0.01
    assert used(user) == COST


# -- idempotency --------------------------------------------------------------------------

def test_repeat_with_the_same_key_is_charged_once(handler: Any, env: EmulatorProcess) -> None:
    """The same Idempotency-Key replays the stored answer: one charge, one fetch, one call."""
    user, key = user_id(), str(uuid.uuid4())
    body = {"url": env.job_page_url(SLUG)}
    first = post(handler, body, user=user, headers={"Idempotency-Key": key})
    second = post(handler, body, user=user, headers={"Idempotency-Key": key})
    assert first.status == 200 and second.status == 200
    assert second.headers.get("idempotent-replayed") == "true"
    assert second.body == first.body
    assert arrivals(env, "pages") == 1 and arrivals(env, "llm") == 1
    assert used(user) == COST


def test_same_key_for_another_request_is_422(handler: Any, env: EmulatorProcess) -> None:
    """Reusing a key with a different body is 422 idempotency_key_reused, charged nothing
    more."""
    user, key = user_id(), str(uuid.uuid4())
    assert post(handler, {"text": "Nurse in Leeds, NHS band 5."}, user=user,
                headers={"Idempotency-Key": key}).status == 200
    res = post(handler, {"text": "Teacher in York."}, user=user,
               headers={"Idempotency-Key": key})
    assert res.status == 422 and res.body["error"]["code"] == "idempotency_key_reused"
    assert arrivals(env, "llm") == 1 and used(user) == COST


# -- TLS to a pinned address --------------------------------------------------------------

@pytest.fixture
def tls_site(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
             emulator: EmulatorProcess) -> Iterator[dict[str, Any]]:
    """An HTTPS job page on 127.0.0.1 whose certificate names jobs.test, trusted by fetch."""
    x509 = pytest.importorskip("cryptography.x509")
    import datetime
    import ssl
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: Any, issuer: Any, issuer_key: Any, ca: bool) -> Any:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (x509.CertificateBuilder().subject_name(name)
                   .issuer_name(issuer or name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(hours=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
        return builder.sign(issuer_key or key, hashes.SHA256())

    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca_cert = cert("Test CA", ca_key, None, None, ca=True)
    leaf = cert("jobs.test", leaf_key, ca_cert.subject, ca_key, ca=False)
    pem = serialization.Encoding.PEM
    (tmp_path / "leaf.pem").write_bytes(leaf.public_bytes(pem) + leaf_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    seen: dict[str, Any] = {"sni": [], "host": []}
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "leaf.pem")
    server_ctx.sni_callback = lambda sock, name, ctx: seen["sni"].append(name)
    page = httpx.get(emulator.job_page_url(SLUG), trust_env=False).content

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen["host"].append(self.headers.get("Host"))
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = server_ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client_ctx = ssl.create_default_context(cadata=ca_cert.public_bytes(pem).decode())
    monkeypatch.setattr(fetch, "_ssl", client_ctx)

    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    monkeypatch.setattr(fetch, "resolve_host", resolve)
    try:
        yield {"port": server.server_address[1], **seen}
    finally:
        server.shutdown()
        server.server_close()


def test_tls_uses_the_url_host_while_connecting_to_the_pinned_address(
        handler: Any, env: EmulatorProcess, tls_site: dict[str, Any]) -> None:
    """SNI, certificate check and Host use the URL's name; the socket goes to the checked IP."""
    port, user = tls_site["port"], user_id()
    res = post(handler, {"url": f"https://jobs.test:{port}/job/1"}, user=user)
    assert res.status == 200, res.body
    assert res.body["title"] == job_posting(SLUG)["title"]
    assert tls_site["sni"] == ["jobs.test"] and tls_site["host"] == [f"jobs.test:{port}"]
    assert used(user) == COST


def test_tls_certificate_for_another_name_is_refused(
        handler: Any, env: EmulatorProcess, tls_site: dict[str, Any]) -> None:
    """A certificate that does not name the URL's host fails verification: 502 unreachable."""
    user = user_id()
    res = post(handler, {"url": f"https://evil.test:{tls_site['port']}/job/1"}, user=user)
    assert res.status == 502 and res.body["error"]["reason"] == "unreachable"
    assert used(user) == 0
