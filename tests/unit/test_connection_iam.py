"""ElastiCache IAM tokens: signed offline with dummy credentials and a fixed clock."""

from __future__ import annotations

import datetime as dt
import logging
from urllib.parse import parse_qs, urlencode

import botocore.auth
import botocore.session
import pytest
from botocore.credentials import Credentials
from botocore.model import ServiceId
from botocore.signers import RequestSigner
from redis.exceptions import AuthenticationError

from usage_limits.connection import CachedTokenProvider, ElastiCacheIAMProvider
from usage_limits.exceptions import InvalidArgument

START = 1_700_000_000.0


class FakeClock:
    """Wall-clock seconds that only move when a test says so."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """One fake clock for the provider's cache and for botocore's signing time."""
    fake = FakeClock()

    def utcnow(remove_tzinfo: bool = True) -> dt.datetime:
        now = dt.datetime.fromtimestamp(fake.now, dt.UTC)
        return now.replace(tzinfo=None) if remove_tzinfo else now

    monkeypatch.setattr(botocore.auth, "get_current_datetime", utcnow)
    return fake


def provider(clock: FakeClock, **kwargs: object) -> ElastiCacheIAMProvider:
    options: dict = {"serverless": True, **kwargs}
    return ElastiCacheIAMProvider("app-user", "atto-cache", "eu-west-1",
                                  credentials=Credentials("AKID", "SECRET"), clock=clock,
                                  **options)


def split(token: str) -> tuple[str, dict[str, str]]:
    host, _, query = token.partition("/?")
    return host, {k: v[0] for k, v in parse_qs(query, strict_parsing=True).items()}


def test_token_is_a_presigned_connect_request(clock: FakeClock) -> None:
    """The token carries Action, User, SigV4 fields for elasticache/region, 900 s, no scheme."""
    user, token = provider(clock).get_credentials()
    host, q = split(token)
    assert user == "app-user" and host == "atto-cache"
    assert not token.startswith(("http://", "https://"))
    assert q["Action"] == "connect" and q["User"] == "app-user"
    assert q["ResourceType"] == "ServerlessCache"
    assert q["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256"
    assert q["X-Amz-Credential"] == "AKID/20231114/eu-west-1/elasticache/aws4_request"
    assert q["X-Amz-Expires"] == "900" and q["X-Amz-Date"] == "20231114T221320Z"
    assert q["X-Amz-SignedHeaders"] == "host" and len(q["X-Amz-Signature"]) == 64


def test_node_based_cache_has_no_resource_type(clock: FakeClock) -> None:
    """A replication group id is signed without ResourceType=ServerlessCache."""
    _, q = split(provider(clock, serverless=False).get_credentials()[1])
    assert "ResourceType" not in q and q["Action"] == "connect"


def test_token_equals_botocore_request_signer(clock: FakeClock) -> None:
    """Same bytes as AWS's documented example built on botocore's RequestSigner."""
    session = botocore.session.get_session()
    signer = RequestSigner(ServiceId("elasticache"), "eu-west-1", "elasticache", "v4",
                           Credentials("AKID", "SECRET"), session.get_component("event_emitter"))
    query = urlencode({"Action": "connect", "User": "app-user", "ResourceType": "ServerlessCache"})
    expected = signer.generate_presigned_url(
        {"method": "GET", "url": f"http://atto-cache/?{query}", "body": {}, "headers": {},
         "context": {}}, operation_name="connect", expires_in=900, region_name="eu-west-1")
    assert provider(clock).get_credentials()[1] == expected.removeprefix("http://")


def test_session_token_is_signed_in(clock: FakeClock) -> None:
    """Temporary (Lambda role) credentials add X-Amz-Security-Token."""
    p = ElastiCacheIAMProvider("app-user", "atto-cache", "eu-west-1", clock=clock,
                               credentials=Credentials("AKID", "SECRET", "SESSION"))
    assert split(p.get_credentials()[1])[1]["X-Amz-Security-Token"] == "SESSION"


def test_token_is_cached_within_the_refresh_horizon(clock: FakeClock) -> None:
    """A second call before refresh_after_s returns the very same token."""
    p = provider(clock)
    first = p.get_credentials()
    clock.now += 599
    assert p.get_credentials() == first


def test_token_is_renewed_after_the_refresh_horizon(clock: FakeClock) -> None:
    """Once refresh_after_s passed, a new token with a new signing time is made."""
    p = provider(clock)
    first = p.get_credentials()[1]
    clock.now += 600
    second = p.get_credentials()[1]
    assert second != first
    assert split(second)[1]["X-Amz-Date"] == "20231114T222320Z"
    assert p.get_credentials()[1] == second


def test_clock_going_backwards_renews(clock: FakeClock) -> None:
    """A clock step backwards cannot keep a token alive past its real age."""
    p = provider(clock)
    first = p.get_credentials()[1]
    clock.now -= 3600
    assert p.get_credentials()[1] != first


async def test_async_variant_returns_the_cached_token(clock: FakeClock) -> None:
    """redis.asyncio calls get_credentials_async; it shares the cache with the sync call."""
    p = provider(clock)
    assert await p.get_credentials_async() == p.get_credentials()


def test_token_never_appears_in_repr_or_logs(clock: FakeClock,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """repr names user and cache only, and making a token logs nothing that contains it."""
    caplog.set_level(logging.DEBUG)
    p = provider(clock)
    token = p.get_credentials()[1]
    signature = split(token)[1]["X-Amz-Signature"]
    assert "atto-cache" in repr(p) and signature not in repr(p)
    assert signature not in caplog.text


def test_failure_to_sign_is_a_redis_authentication_error(clock: FakeClock) -> None:
    """A signing failure surfaces as a redis error, so redis-py drops the half-open socket."""
    p = CachedTokenProvider("app-user", lambda: 1 / 0, clock=clock)  # type: ignore[arg-type,return-value]
    with pytest.raises(AuthenticationError, match="ZeroDivisionError"):
        p.get_credentials()


def test_stub_token_function_is_called_once_per_horizon(clock: FakeClock) -> None:
    """CachedTokenProvider calls its token function once, then again after the horizon."""
    calls: list[float] = []

    def make() -> str:
        calls.append(clock.now)
        return f"tok-{len(calls)}"

    p = CachedTokenProvider("svc", make, refresh_after_s=10, clock=clock)
    assert [p.get_credentials(), p.get_credentials()] == [("svc", "tok-1")] * 2
    clock.now += 10
    assert p.get_credentials() == ("svc", "tok-2") and len(calls) == 2


@pytest.mark.parametrize("kwargs", [{"user_id": ""}, {"cache_name": ""}, {"region": ""},
                                    {"refresh_after_s": 900}])
def test_bad_provider_arguments(kwargs: dict[str, object]) -> None:
    """Empty names or a refresh horizon past the token's life raise InvalidArgument."""
    args: dict = {"user_id": "u", "cache_name": "c", "region": "r",
                  "credentials": Credentials("AKID", "SECRET"), **kwargs}
    with pytest.raises(InvalidArgument):
        ElastiCacheIAMProvider(**args)


def test_missing_aws_credentials_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: object) -> None:
    """With no credentials anywhere, building the provider says so."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", f"{tmp_path}/none")
    monkeypatch.setenv("AWS_CONFIG_FILE", f"{tmp_path}/none")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(InvalidArgument, match="no AWS credentials"):
        ElastiCacheIAMProvider("u", "c", "eu-west-1")
