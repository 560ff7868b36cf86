"""The loopback PKCE sign-in against a local OpenID Connect stand-in (no network): the
browser flow, the state check, the code exchange, refresh, sign-out and the token stores."""

from __future__ import annotations

import asyncio
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from atto_cloud_client import (
    AsyncAttoClient,
    AttoClient,
    FileTokenStore,
    LoopbackSignIn,
    MemoryTokenStore,
    OIDCEndpoints,
    SignInError,
    TokenSet,
)
from atto_cloud_client.testing import MockApi, error

from local.redis_servers import free_port
from tests.client.oidc_standin import OIDCStandIn, s256


@pytest.fixture
def provider() -> Iterator[OIDCStandIn]:
    """A fresh OIDC stand-in on a private port."""
    with OIDCStandIn() as standin:
        yield standin


def browser(opened: list[str]) -> Callable[[str], None]:
    """A "browser" that follows the authorization redirect back to the loopback listener."""

    def open_url(url: str) -> None:
        opened.append(url)
        httpx.get(url, follow_redirects=True, timeout=10)

    return open_url


def signin_for(provider: OIDCStandIn, tmp_path: Path, opened: list[str],
               **kwargs: object) -> LoopbackSignIn:
    return LoopbackSignIn(OIDCEndpoints.discover(provider.url), provider.client_id,
                          store=FileTokenStore(tmp_path / "atto" / "tokens.json"),
                          opener=browser(opened), timeout_s=10, **kwargs)  # type: ignore[arg-type]


def test_sign_in_sends_an_s256_challenge_and_exchanges_the_code(provider: OIDCStandIn,
                                                                 tmp_path: Path) -> None:
    """The browser is sent to the authorization endpoint with an S256 challenge, state and
    a 127.0.0.1 redirect on an ephemeral port; the code is exchanged with the verifier
    that matches the challenge; the tokens are stored."""
    opened: list[str] = []
    now = 1_000_000.0
    signin = signin_for(provider, tmp_path, opened, clock=lambda: now)
    tokens = signin.sign_in()
    (url,) = opened
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    assert url.startswith(provider.url + "/authorize?")
    assert query["code_challenge_method"] == "S256" and len(query["state"]) >= 32
    assert query["scope"] == "openid email profile" and query["response_type"] == "code"
    redirect = urlsplit(query["redirect_uri"])
    assert (redirect.scheme, redirect.hostname, redirect.path) == ("http", "127.0.0.1",
                                                                  "/callback")
    assert redirect.port and redirect.port > 0
    (exchange,) = provider.token_requests
    assert exchange["grant_type"] == "authorization_code"
    assert exchange["redirect_uri"] == query["redirect_uri"]
    assert s256(exchange["code_verifier"]) == query["code_challenge"]
    assert 43 <= len(exchange["code_verifier"]) <= 128
    assert tokens.access_token == provider.access_tokens[0] and tokens.refresh_token
    assert tokens.expires_at == now + 3600 and tokens.scope == "openid email profile"
    assert signin.store.load() == tokens


def test_tokens_file_is_private_to_its_owner(provider: OIDCStandIn, tmp_path: Path) -> None:
    """The file store writes the tokens with mode 0600 in a folder it makes with 0700."""
    signin = signin_for(provider, tmp_path, [])
    signin.sign_in()
    path = tmp_path / "atto" / "tokens.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["tokens.json"]  # no temporary left


def test_a_fixed_port_is_used_for_providers_that_match_exactly(provider: OIDCStandIn,
                                                               tmp_path: Path) -> None:
    """``port=`` and ``redirect_host='localhost'`` give exactly the registered redirect URI."""
    port = free_port()
    opened: list[str] = []
    signin_for(provider, tmp_path, opened, port=port, redirect_host="localhost").sign_in()
    query = parse_qs(urlsplit(opened[0]).query)
    assert query["redirect_uri"] == [f"http://localhost:{port}/callback"]


def test_a_busy_fixed_port_is_a_sign_in_error(provider: OIDCStandIn, tmp_path: Path) -> None:
    """When the registered port is taken, sign-in fails clearly and no browser opens."""
    opened: list[str] = []
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SignInError, match=f"cannot listen on 127.0.0.1:{port}"):
            signin_for(provider, tmp_path, opened, port=port).sign_in()
    assert opened == []


def test_a_redirect_with_the_wrong_state_is_refused(provider: OIDCStandIn,
                                                    tmp_path: Path) -> None:
    """A callback whose state differs from the one sent raises SignInError and no code is
    exchanged."""

    def forged(url: str) -> None:
        answer = httpx.get(url, timeout=10)
        location = answer.headers["location"].replace("state=", "state=forged")
        httpx.get(location, timeout=10)

    signin = LoopbackSignIn(OIDCEndpoints.discover(provider.url), provider.client_id,
                            store=MemoryTokenStore(), opener=forged, timeout_s=10)
    with pytest.raises(SignInError, match="state"):
        signin.sign_in()
    assert provider.token_requests == [] and signin.store.load() is None


def test_a_denied_sign_in_raises_and_stores_nothing(provider: OIDCStandIn,
                                                    tmp_path: Path) -> None:
    """``error=access_denied`` on the redirect raises SignInError naming it."""
    provider.deny = True
    signin = signin_for(provider, tmp_path, [])
    with pytest.raises(SignInError, match="access_denied"):
        signin.sign_in()
    assert provider.token_requests == [] and signin.store.load() is None


def test_no_redirect_in_time_raises(provider: OIDCStandIn, tmp_path: Path) -> None:
    """When the browser never comes back the sign-in gives up after ``timeout_s``."""
    signin = LoopbackSignIn(OIDCEndpoints.discover(provider.url), provider.client_id,
                            store=MemoryTokenStore(), opener=lambda url: None, timeout_s=0.2)
    with pytest.raises(SignInError, match="no sign-in redirect"):
        signin.sign_in()


def test_an_expiring_token_is_refreshed_and_the_refresh_token_kept(provider: OIDCStandIn,
                                                                    tmp_path: Path) -> None:
    """access_token() returns the stored token while valid, refreshes it within a minute of
    expiry (keeping the refresh token when none is sent back), and on force_refresh."""
    now = [1_000_000.0]
    opened: list[str] = []
    signin = signin_for(provider, tmp_path, opened, clock=lambda: now[0])
    first = signin.sign_in()
    assert signin.access_token() == first.access_token and len(provider.token_requests) == 1
    now[0] += 3600 - 30  # inside the refresh leeway
    second = signin.access_token()
    refresh = provider.token_requests[-1]
    assert refresh == {"grant_type": "refresh_token", "refresh_token": first.refresh_token,
                       "client_id": provider.client_id}
    assert second == provider.access_tokens[1] != first.access_token
    stored = signin.store.load()
    assert stored.refresh_token == first.refresh_token and stored.id_token == "id-" + second
    assert signin.access_token(force_refresh=True) == provider.access_tokens[2]
    assert len(opened) == 1  # never back to the browser


def test_a_refused_refresh_token_leads_to_a_new_sign_in_or_an_error(provider: OIDCStandIn,
                                                                     tmp_path: Path) -> None:
    """When the provider refuses the refresh token, an interactive session signs in again;
    a non-interactive one raises SignInError."""
    opened: list[str] = []
    signin = signin_for(provider, tmp_path, opened)
    signin.sign_in()
    provider.refresh_tokens.clear()
    fresh = signin.access_token(force_refresh=True)
    assert len(opened) == 2 and fresh == provider.access_tokens[-1]
    provider.refresh_tokens.clear()
    quiet = signin_for(provider, tmp_path, opened, interactive=False)
    with pytest.raises(SignInError, match="invalid_grant"):
        quiet.access_token(force_refresh=True)
    assert len(opened) == 2


def test_without_tokens_a_non_interactive_session_raises(provider: OIDCStandIn,
                                                         tmp_path: Path) -> None:
    """Nothing stored and interactive=False: SignInError, and no browser opened."""
    opened: list[str] = []
    with pytest.raises(SignInError, match="not signed in"):
        signin_for(provider, tmp_path, opened, interactive=False).access_token()
    assert opened == []


def test_sign_out_revokes_and_forgets(provider: OIDCStandIn, tmp_path: Path) -> None:
    """sign_out() revokes the refresh token at the provider and empties the store."""
    signin = signin_for(provider, tmp_path, [])
    tokens = signin.sign_in()
    signin.sign_out()
    assert provider.revoked == [tokens.refresh_token] and signin.store.load() is None
    assert not (tmp_path / "atto" / "tokens.json").exists()


def test_the_client_uses_sign_in_as_its_token_provider(provider: OIDCStandIn,
                                                       tmp_path: Path) -> None:
    """AttoClient sends the stored access token; after a 401 it forces one refresh and
    repeats the call with the new token."""
    signin = signin_for(provider, tmp_path, [])
    first = signin.sign_in().access_token
    api = MockApi()
    api.queue("GET /v1/usage", error(401, "unauthorized", "token revoked"))
    with AttoClient(transport=api.transport, token_provider=signin.access_token) as atto:
        atto.usage()
    sent = [r.headers["authorization"] for r in api.requests]
    assert sent == [f"Bearer {first}", f"Bearer {provider.access_tokens[1]}"]


def test_the_async_client_uses_sign_in_without_blocking(provider: OIDCStandIn,
                                                        tmp_path: Path) -> None:
    """AsyncAttoClient with access_token_async sends the token and, after a 401, the
    refreshed one."""
    signin = signin_for(provider, tmp_path, [])
    first = signin.sign_in().access_token
    api = MockApi()
    api.queue("GET /v1/usage", error(401, "unauthorized", "token revoked"))

    async def run() -> None:
        async with AsyncAttoClient(transport=api.transport,
                                   token_provider=signin.access_token_async) as atto:
            await atto.usage()

    asyncio.run(run())
    sent = [r.headers["authorization"] for r in api.requests]
    assert sent == [f"Bearer {first}", f"Bearer {provider.access_tokens[1]}"]


def test_cognito_endpoints_come_from_the_domain() -> None:
    """The hosted UI domain gives Cognito's authorize, token and revoke endpoints."""
    endpoints = OIDCEndpoints.cognito("atto-dev-1.auth.eu-west-1.amazoncognito.com")
    base = "https://atto-dev-1.auth.eu-west-1.amazoncognito.com/oauth2/"
    assert (endpoints.authorization_endpoint, endpoints.token_endpoint,
            endpoints.revocation_endpoint) == (base + "authorize", base + "token",
                                               base + "revoke")


def test_discovery_failure_is_a_sign_in_error(provider: OIDCStandIn) -> None:
    """An issuer without a discovery document raises SignInError."""
    with pytest.raises(SignInError, match="discovery"):
        OIDCEndpoints.discover(provider.url + "/nowhere")


def test_file_store_tolerates_a_missing_or_broken_file(tmp_path: Path) -> None:
    """load() is None for a missing or unreadable file; save() replaces it whole."""
    store = FileTokenStore(tmp_path / "t.json")
    assert store.load() is None
    (tmp_path / "t.json").write_text("{not json")
    assert store.load() is None
    store.save(TokenSet("a", refresh_token="r", expires_at=5.0))
    assert store.load() == TokenSet("a", refresh_token="r", expires_at=5.0)
    store.clear()
    store.clear()  # twice is fine
    assert store.load() is None
