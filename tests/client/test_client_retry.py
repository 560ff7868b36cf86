"""The client's retry rules, typed errors and parsed headers, over httpx.MockTransport
(``atto_cloud_client.testing.MockApi``), with an injected clock and sleep."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import atto_cloud_client
import httpx
import pytest
from atto_cloud_client import (
    AccountSuspended,
    ApiError,
    AsyncAttoClient,
    AttoClient,
    BudgetExceeded,
    CostExceedsPlan,
    IdempotencyConflict,
    InternalError,
    InvalidRequest,
    LimiterUnavailable,
    PayloadTooLarge,
    ProviderBusy,
    ProviderError,
    RateLimitStatus,
    RetryPolicy,
    TransportError,
    Unauthorized,
)
from atto_cloud_client import exceptions as ex
from atto_cloud_client._core import key_of
from atto_cloud_client.testing import MockApi, error

STRUCTURED = "POST /v1/structured"


class FakeTime:
    """A clock that only moves when the client sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def client(api: MockApi, time: FakeTime, **kwargs: object) -> AttoClient:
    return AttoClient(transport=api.transport, user="alice", sleep=time.sleep,
                      clock=time.clock, **kwargs)  # type: ignore[arg-type]


def keys(api: MockApi) -> list[str | None]:
    """The key each request carried, unquoted (the client sends the draft's sf-string)."""
    return [None if (f := r.headers.get("idempotency-key")) is None else key_of(f)
            for r in api.requests]


# --- Retry-After and the total time ----------------------------------------------------------


@pytest.mark.parametrize("code", ["provider_busy", "limiter_unavailable"])
def test_503_is_retried_after_its_retry_after_with_the_same_key(code: str) -> None:
    """A 503 with Retry-After 3 is retried after 3 to 3.6 s (20% jitter), with the same
    Idempotency-Key and body, and the retry's answer is returned."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, error(503, code, "try later", retry_after_s=3))
    result = client(api, time, rand=lambda: 0.999).structured("x", {"type": "object"})
    assert len(time.slept) == 1 and 3.0 <= time.slept[0] <= 3.6
    assert time.slept[0] > 3.5  # the jitter stretched it (rand near 1)
    assert len(set(keys(api))) == 1 and len(api.requests) == 2
    assert api.requests[0].content == api.requests[1].content
    assert result.info.attempts == 2 and api.charged == 8


def test_retry_after_is_never_shortened_by_jitter() -> None:
    """With the smallest random draw the wait is exactly Retry-After, never less."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, error(503, "provider_busy", "busy", retry_after_s=2))
    client(api, time, rand=lambda: 0.0).structured("x", {"type": "object"})
    assert time.slept == [2.0]


def test_a_wait_past_the_total_time_is_not_started() -> None:
    """A Retry-After longer than the time left raises at once, without sleeping."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, error(503, "provider_busy", "busy", retry_after_s=30,
                                provider="llm"))
    with pytest.raises(ProviderBusy) as raised:
        client(api, time, retry=RetryPolicy(total_s=10)).structured("x", {})
    assert time.slept == [] and raised.value.provider == "llm"
    assert raised.value.retry_after_s == 30 and raised.value.attempts == 1


def test_max_attempts_bounds_the_retries() -> None:
    """Four 503s against max_attempts=3: three attempts, two waits, then the typed error."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, *[error(503, "limiter_unavailable", "down", retry_after_s=1)] * 4)
    with pytest.raises(LimiterUnavailable) as raised:
        client(api, time, retry=RetryPolicy(max_attempts=3)).structured("x", {})
    assert len(api.requests) == 3 and len(time.slept) == 2 and raised.value.attempts == 3


def test_connection_errors_are_retried_with_growing_jittered_backoff() -> None:
    """Connection errors are retried with backoff 0.25, 0.5, 1 s (+-10%), same key; the
    last error is raised as TransportError when attempts run out."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, *[httpx.ConnectError("refused")] * 4)
    with pytest.raises(TransportError) as raised:
        client(api, time, retry=RetryPolicy(max_attempts=4)).structured("x", {})
    assert raised.value.attempts == 4 and len(set(keys(api))) == 1
    for slept, base in zip(time.slept, [0.25, 0.5, 1.0], strict=True):
        assert base * 0.9 <= slept <= base * 1.1


def test_a_read_timeout_is_retried_and_then_succeeds() -> None:
    """A read timeout (the answer may be lost) is retried under the same key."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, httpx.ReadTimeout("slow"))
    result = client(api, time).structured("x", {})
    assert result.info.attempts == 2 and len(set(keys(api))) == 1 and api.charged == 8


@pytest.mark.parametrize(("status", "code", "cls"), [
    (400, "invalid_request", InvalidRequest),
    (401, "unauthorized", Unauthorized),
    (403, "account_suspended", AccountSuspended),
    (413, "payload_too_large", PayloadTooLarge),
    (422, "invalid_request", InvalidRequest),
    (422, "cost_exceeds_plan", CostExceedsPlan),
    (422, "idempotency_key_reused", ex.IdempotencyKeyReused),
    (422, "idempotency_answer_gone", ex.IdempotencyAnswerGone),
    (422, "schema_rejected", ex.SchemaRejected),
    (422, "model_refused", ex.ModelRefused),
    (422, "content_filtered", ex.ContentFiltered),
    (429, "budget_exceeded", BudgetExceeded),
    (500, "internal_error", InternalError),
    (502, "provider_error", ProviderError),
    (502, "output_truncated", ex.OutputTruncated),
    (503, "provider_quota_exceeded", ex.ProviderQuotaExceeded),
])
def test_other_errors_are_raised_typed_after_one_attempt(status: int, code: str,
                                                         cls: type[ApiError]) -> None:
    """Every error code but the retried ones (409 in flight, the other 503s) raises its own
    class after one attempt, no wait, even with a Retry-After (a provider out of quota)."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, error(status, code, "no", retry_after_s=5, limit=100))
    with pytest.raises(cls) as raised:
        client(api, time).structured("x", {})
    assert type(raised.value) is cls and raised.value.code == code
    assert raised.value.status == status and raised.value.message == "no"
    assert len(api.requests) == 1 and time.slept == []


def test_a_reused_key_is_not_retried_but_a_key_in_flight_is() -> None:
    """422 idempotency_key_reused (the key served another request) is raised at once as its
    own class; 409 idempotency_conflict (in flight) is another class, and retried."""
    api, time = MockApi(), FakeTime()
    atto = client(api, time, rand=lambda: 0.0)
    atto.structured("x", {"type": "object"}, idempotency_key="k-1")
    with pytest.raises(ex.IdempotencyKeyReused) as raised:
        atto.structured("another prompt", {"type": "object"}, idempotency_key="k-1")
    assert raised.value.status == 422 and not isinstance(raised.value, IdempotencyConflict)
    assert len(api.requests) == 2 and time.slept == [] and api.charged == 8


def test_a_409_in_progress_is_retried_after_its_retry_after_with_the_same_key() -> None:
    """A 409 whose Retry-After says the key's first request is still running is retried
    with the same key, and the stored answer the retry gets is returned."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, error(409, "idempotency_conflict", "a request with this "
                                "Idempotency-Key is still in progress", retry_after_s=1))
    result = client(api, time, rand=lambda: 0.0).structured("x", {"type": "object"})
    assert time.slept == [1.0] and len(set(keys(api))) == 1 and len(api.requests) == 2
    assert result.info.attempts == 2


def test_budget_exceeded_is_waited_out_only_when_asked() -> None:
    """With retry_budget_exceeded, a 429 whose Retry-After fits the total time is waited
    out and retried under the same key."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, error(429, "budget_exceeded", "spent", retry_after_s=4, limit=100,
                                remaining=4, window_s=3600, cost=8))
    policy = RetryPolicy(retry_budget_exceeded=True, jitter=0)
    result = client(api, time, retry=policy).structured("x", {})
    assert time.slept == [4.0] and result.info.attempts == 2 and len(set(keys(api))) == 1


def test_unknown_codes_fall_back_by_status() -> None:
    """API Gateway's own 401 and an unknown 418 become Unauthorized and a plain ApiError."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, httpx.Response(401, json={"message": "Unauthorized"}),
              httpx.Response(418, text="teapot"))
    with pytest.raises(Unauthorized) as first:
        client(api, time).structured("x", {})
    with pytest.raises(ApiError) as second:
        client(api, time).structured("x", {})
    assert first.value.code == "http_401" and first.value.message == "Unauthorized"
    assert type(second.value) is ApiError and second.value.code == "http_418"


def test_gateway_throttling_429_is_not_a_budget_error() -> None:
    """API Gateway's stage throttling (429 without the error body) is a plain ApiError."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, httpx.Response(429, json={"message": "Too Many Requests"}))
    with pytest.raises(ApiError) as raised:
        client(api, time).structured("x", {})
    assert not isinstance(raised.value, BudgetExceeded) and raised.value.status == 429


def test_a_success_of_the_wrong_shape_is_an_error_not_a_crash() -> None:
    """A 200 whose body is not the route's shape raises ApiError unexpected_response."""
    api, time = MockApi(), FakeTime()
    api.queue(STRUCTURED, httpx.Response(200, json={"nothing": True}))
    with pytest.raises(ApiError) as raised:
        client(api, time).structured("x", {})
    assert raised.value.code == "unexpected_response"


# --- keys and auth ----------------------------------------------------------------------------


def test_every_call_has_its_own_key_and_the_callers_key_is_kept() -> None:
    """Two calls send two different keys; a caller's key is sent as given (as the IETF
    draft's sf-string, escaped) and replays."""
    api, time = MockApi(), FakeTime()
    atto = client(api, time)
    atto.embeddings(["a"])
    atto.embeddings(["a"])
    mine = atto.embeddings(["a"], idempotency_key="mine-1")
    again = atto.embeddings(["a"], idempotency_key="mine-1")
    sent = keys(api)
    assert sent[0] != sent[1] and sent[2:] == ["mine-1", "mine-1"]
    assert api.requests[2].headers["idempotency-key"] == '"mine-1"'
    quoted = atto.embeddings(["a"], idempotency_key='say "hi" \\ bye')
    assert api.requests[-1].headers["idempotency-key"] == '"say \\"hi\\" \\\\ bye"'
    assert quoted.info.request_id == 'say "hi" \\ bye'
    assert mine.info.replayed is False and again.info.replayed is True and api.charged == 4


@pytest.mark.parametrize("key", ["", "x" * 129, "caf\u00e9", "tab\there"])
def test_a_key_the_server_would_refuse_is_refused_before_sending(key: str) -> None:
    """Empty, too long or non-printable-ASCII keys raise ValueError; nothing is sent."""
    api, time = MockApi(), FakeTime()
    with pytest.raises(ValueError):
        client(api, time).embeddings(["a"], idempotency_key=key)
    assert api.requests == []


def test_bearer_token_is_refreshed_once_after_a_401() -> None:
    """The token provider's token is sent; after a 401 a plain provider is simply called
    again and the call repeated once under the same key."""
    api, time = MockApi(), FakeTime()
    tokens = iter(["stale", "fresh"])
    api.queue(STRUCTURED, error(401, "unauthorized", "expired"))
    atto = AttoClient(transport=api.transport, token_provider=lambda: next(tokens),
                      sleep=time.sleep, clock=time.clock)
    atto.structured("x", {})
    assert [r.headers["authorization"] for r in api.requests] == ["Bearer stale",
                                                                  "Bearer fresh"]
    assert len(set(keys(api))) == 1 and time.slept == []
    assert "x-atto-user" not in api.requests[0].headers


def test_local_user_header_and_extra_headers_are_sent() -> None:
    """``user`` sets X-Atto-User and ``headers`` adds the app's own on every request."""
    api, time = MockApi(), FakeTime()
    client(api, time, headers={"X-Atto-Plan": "pro"}).usage()
    (request,) = api.requests
    assert request.headers["x-atto-user"] == "alice" and request.headers["x-atto-plan"] == "pro"


# --- headers and credit -----------------------------------------------------------------------


def test_ratelimit_headers_of_the_last_answer_are_data() -> None:
    """After each metered call, ``rate_limit`` holds every window's remaining and reset; a
    429 updates it too, and a free call without headers leaves it alone."""
    api, time = MockApi(windows=[(20, 60), (50, 86400)]), FakeTime()
    atto = client(api, time)
    atto.structured("x", {})
    assert [(w.name, w.limit, w.window_s, w.remaining) for w in atto.rate_limit.windows] == [
        ("1m", 20, 60, 12), ("1d", 50, 86400, 42)]
    atto.structured("x", {})
    with pytest.raises(BudgetExceeded) as raised:
        atto.structured("x", {})
    assert atto.rate_limit.remaining == 4 and raised.value.rate_limit == atto.rate_limit
    assert (raised.value.limit, raised.value.remaining, raised.value.window_s) == (20, 4, 60)
    assert raised.value.window.name == "1m" and raised.value.window.remaining == 4
    atto.usage()
    assert atto.rate_limit.window("1m").remaining == 4
    assert atto.rate_limit.window("1m").fraction_left == pytest.approx(0.2)
    assert atto.last_response.rate_limit is None and atto.last_response.status == 200


@pytest.mark.parametrize(("policy", "status", "expected"), [
    ('"1h";q=100;w=3600, "30d";q=1000;w=2592000', '"1h";r=92;t=3512, "30d";r=992;t=2591912',
     [("1h", 100, 3600, 92, 3512), ("30d", 1000, 2592000, 992, 2591912)]),
    ("default;q=50;w=60;qu=\"tokens\"", "default;r=0;t=17",  # bare names, extra params
     [("default", 50, 60, 0, 17)]),
    ('"a";q=5;w=10, ???, "b";q=7;w=20', '"b";r=3;t=4',       # junk skipped, join by name
     [("a", 5, 10, None, None), ("b", 7, 20, 3, 4)]),
    ("", '"only";r=1;t=2', [("only", None, None, 1, 2)]),
])
def test_ratelimit_header_parsing(policy: str, status: str,
                                  expected: list[tuple[object, ...]]) -> None:
    """RFC 8941 lists: quoted or bare names, extra parameters, junk items skipped, the two
    headers joined by window name."""
    parsed = RateLimitStatus.from_headers(httpx.Headers({"RateLimit-Policy": policy,
                                                         "RateLimit": status}))
    assert parsed is not None
    assert [(w.name, w.limit, w.window_s, w.remaining, w.reset_s)
            for w in parsed.windows] == expected


def test_no_ratelimit_headers_parse_to_none() -> None:
    """An answer without either header has no rate-limit status."""
    assert RateLimitStatus.from_headers(httpx.Headers({})) is None


def test_credit_is_read_from_usage_and_429_when_present() -> None:
    """A ``credit``/``grants`` field in GET /v1/usage or a 429 body is parsed into
    CreditBalance (and kept as ``client.credit``); without it credit is None."""
    api, time = MockApi(), FakeTime()
    atto = client(api, time)
    assert atto.usage().credit is None and atto.credit is None
    grants = [{"reference": "inv_1", "kind": "paid", "remaining": 300, "tokens": 500,
               "expires_at": "2027-01-31T00:00:00Z"},
              {"reference": "promo", "kind": "promo", "remaining": 20, "expires_at": None}]
    api.queue("GET /v1/usage", httpx.Response(200, json={
        "user_id": "alice", "plan": "pro", "windows": [], "prices": {}, "credit": 320,
        "events": [{"request_id": "k", "cost": 8, "route": "/v1/structured",
                    "at": "1970-01-01T00:00:01.500Z",
                    "draws": [{"reference": "inv_1", "tokens": 5},
                              {"reference": "promo", "tokens": 3}]}],
        "grants": grants}))
    usage = atto.usage()
    assert usage.plan == "pro" and usage.events[0].from_grants == 8
    assert usage.events[0].at == 1.5  # the RFC 3339 instant, as Unix time
    assert usage.events[0].draws == (("inv_1", 5), ("promo", 3))
    assert usage.credit.remaining == 320 and [g.reference for g in usage.credit.grants] == [
        "inv_1", "promo"]
    assert atto.credit == usage.credit
    api.queue(STRUCTURED, error(429, "budget_exceeded", "spent", retry_after_s=60,
                                limit=1000, remaining=0, window_s=2592000, cost=8,
                                credit={"remaining": 4, "grants": grants[1:]}))
    with pytest.raises(BudgetExceeded) as raised:
        atto.structured("x", {})
    assert raised.value.credit.remaining == 4 and atto.credit.remaining == 4


# --- async --------------------------------------------------------------------------------


def test_async_client_follows_the_same_rules() -> None:
    """The async client retries a 503 after Retry-After with an async sleep and an async
    token provider, under one key, and raises the typed 429."""
    api = MockApi(windows=[(10, 60)])
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def token() -> str:
        return "t"

    async def run() -> None:
        async with AsyncAttoClient(transport=api.transport, token_provider=token,
                                   sleep=sleep) as atto:
            api.queue(STRUCTURED, error(503, "provider_busy", "busy", retry_after_s=1))
            result = await atto.structured("x", {})
            assert result.info.attempts == 2
            with pytest.raises(BudgetExceeded):
                await atto.structured("x", {})

    asyncio.run(run())
    assert len(slept) == 1 and 1.0 <= slept[0] <= 1.2
    assert api.requests[0].headers["idempotency-key"] == api.requests[1].headers[
        "idempotency-key"] and api.requests[0].headers["authorization"] == "Bearer t"


# --- the package's shape ------------------------------------------------------------------


def test_exceptions_module_opens_with_the_whole_hierarchy() -> None:
    """Every exception class appears in the module's tree, under its own parent."""
    tree = ex.__doc__ or ""
    classes = [c for c in vars(ex).values()
               if isinstance(c, type) and issubclass(c, ex.AttoError)]
    depth = {}
    for line in tree.splitlines():
        match = re.match(r"^([\s│├└─]*)([A-Z][A-Za-z]+)\b", line)
        if match and match.group(2) in {c.__name__ for c in classes}:
            depth[match.group(2)] = len(match.group(1))
    assert set(depth) == {c.__name__ for c in classes}
    for cls in classes:
        if cls is not ex.AttoError:
            assert depth[cls.__base__.__name__] < depth[cls.__name__], cls.__name__


def test_exports_are_importable() -> None:
    """Every name in ``__all__`` exists, and the test double is not imported by default."""
    for name in atto_cloud_client.__all__:
        assert hasattr(atto_cloud_client, name), name
    source = Path(atto_cloud_client.__file__).read_text()
    assert "testing" not in re.findall(r"^from \.(\w+)", source, re.M)


def test_every_metered_answer_reports_the_credit_and_what_may_be_spent() -> None:
    """An answer whose quota item counts 484 of credit (atto-credit) sets ``client.credit``
    and a ``rate_limit.remaining`` that includes it, while ``used`` and ``fraction_left``
    stay of the quota itself."""
    api, time = MockApi(), FakeTime()
    atto = client(api, time)
    api.queue(STRUCTURED, httpx.Response(200, json={"data": "x", "model": "m", "usage": {
        "prompt_tokens": 1, "completion_tokens": 1}},
                                         headers={
        "RateLimit-Policy": '"1h";q=100;w=3600;atto-qu="tokens", '
                            '"30d";q=24;w=2592000;atto-qu="tokens"',
        "RateLimit": '"1h";r=68;t=3599, "30d";r=484;t=2591999;atto-credit=484'}))
    atto.structured("x", {})
    assert atto.credit is not None and atto.credit.remaining == 484
    assert atto.rate_limit.remaining == 68 and atto.rate_limit.credit == 484
    quota = atto.rate_limit.window("30d")
    assert (quota.remaining, quota.credit, quota.quota_remaining, quota.used) == (484, 484, 0, 24)
    assert quota.fraction_left == 0.0
