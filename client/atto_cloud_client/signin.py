"""Sign-in for a desktop app: OAuth 2.0 authorization code with PKCE over a loopback redirect.

The flow of RFC 8252 (OAuth 2.0 for native apps) with RFC 7636 (PKCE, ``S256``):

1. a one-shot HTTP listener on ``127.0.0.1`` (an ephemeral port by default, or a fixed
   one for providers that match redirect URIs exactly, as Cognito does);
2. the system browser opens the provider's authorization page (the opener is injectable);
3. the provider redirects to ``http://127.0.0.1:<port>/callback?code=...&state=...``; the
   state is checked against the one sent;
4. the code and the PKCE verifier are exchanged for tokens at the token endpoint; the
   tokens go to the app's ``TokenStore``;
5. later, ``access_token()`` returns a valid token, refreshing it with the refresh token
   when it is about to expire (or when the API said 401).

``LoopbackSignIn.access_token`` is a token provider for ``AttoClient``::

    signin = LoopbackSignIn(OIDCEndpoints.cognito("atto-dev-123.auth.eu-west-1.amazoncognito.com"),
                            client_id="...", port=53682)
    client = AttoClient(API_URL, token_provider=signin.access_token)
    # or AsyncAttoClient(API_URL, token_provider=signin.access_token_async)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import html
import secrets
import threading
import time
import webbrowser
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx

from .exceptions import SignInError
from .tokens import FileTokenStore, TokenSet, TokenStore

DISCOVERY_PATH = "/.well-known/openid-configuration"
DEFAULT_SCOPES = ("openid", "email", "profile")
#: Refresh an access token this long before it expires.
REFRESH_LEEWAY_S = 60.0


@dataclass(frozen=True)
class OIDCEndpoints:
    """Where the provider's authorization and token endpoints are.

    Attributes:
        authorization_endpoint: the page the browser opens.
        token_endpoint: where codes and refresh tokens are exchanged.
        revocation_endpoint: where a refresh token is revoked on sign-out, if any.
        issuer: the issuer, when known.
    """

    authorization_endpoint: str
    token_endpoint: str
    revocation_endpoint: str | None = None
    issuer: str | None = None

    @classmethod
    def discover(cls, issuer: str, *, http: httpx.Client | None = None,
                 timeout: float = 10.0) -> OIDCEndpoints:
        """Read ``<issuer>/.well-known/openid-configuration`` (OpenID Connect Discovery).

        Raises:
            SignInError: the document cannot be fetched or lacks the endpoints.
        """
        url = issuer.rstrip("/") + DISCOVERY_PATH
        try:
            if http is None:
                response = httpx.get(url, timeout=timeout)
            else:
                response = http.get(url, timeout=timeout)
            response.raise_for_status()
            doc = response.json()
            return cls(authorization_endpoint=doc["authorization_endpoint"],
                       token_endpoint=doc["token_endpoint"],
                       revocation_endpoint=doc.get("revocation_endpoint"),
                       issuer=doc.get("issuer", issuer))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise SignInError(f"OpenID discovery at {url} failed: {exc}") from exc

    @classmethod
    def cognito(cls, domain: str) -> OIDCEndpoints:
        """The endpoints of a Cognito user pool's hosted UI domain.

        Args:
            domain: ``<prefix>.auth.<region>.amazoncognito.com`` (the stack's
                ``UserPoolDomainUrl`` output, with or without ``https://``) or a custom domain.
        """
        base = domain if domain.startswith(("https://", "http://")) else f"https://{domain}"
        base = base.rstrip("/")
        return cls(authorization_endpoint=f"{base}/oauth2/authorize",
                   token_endpoint=f"{base}/oauth2/token",
                   revocation_endpoint=f"{base}/oauth2/revoke")


def pkce_pair() -> tuple[str, str]:
    """A PKCE ``code_verifier`` (86 characters) and its ``S256`` ``code_challenge``."""
    verifier = secrets.token_urlsafe(64)
    return verifier, s256(verifier)


def s256(verifier: str) -> str:
    """``BASE64URL(SHA256(verifier))`` without padding (RFC 7636 section 4.2)."""
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class _Callback:
    params: dict[str, str]


class _Listener:
    """A one-shot HTTP listener on the loopback interface that waits for the redirect."""

    def __init__(self, host: str, port: int, path: str) -> None:
        self.path = path
        self.result: _Callback | None = None
        self.done = threading.Event()
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                parts = urlsplit(self.path)
                if parts.path != listener.path or listener.done.is_set():
                    self.send_error(404)
                    return
                params = {k: v[0] for k, v in parse_qs(parts.query).items()}
                ok = "code" in params and "error" not in params
                text = ("Signed in to Atto Cloud. You can close this tab."
                        if ok else "Sign-in did not complete. You can close this tab.")
                page = f"<!doctype html><title>Atto Cloud</title><p>{html.escape(text)}</p>"
                body = page.encode()
                self.send_response(200 if ok else 400)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)
                listener.result = _Callback(params)
                listener.done.set()

            def log_message(self, format: str, *args: Any) -> None:  # the code is secret
                return

        try:
            self.server = HTTPServer((host, port), Handler)
        except OSError as exc:
            raise SignInError(f"cannot listen on {host}:{port} for the sign-in redirect: "
                              f"{exc}") from exc
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.1}, daemon=True)

    def __enter__(self) -> _Listener:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def wait(self, timeout_s: float) -> _Callback:
        if not self.done.wait(timeout_s) or self.result is None:
            raise SignInError(f"no sign-in redirect within {timeout_s:.0f} s")
        return self.result


class LoopbackSignIn:
    """Sign a user in through the browser, keep the tokens, and keep them fresh.

    Args:
        endpoints: the provider's endpoints (``OIDCEndpoints.cognito(...)``,
            ``OIDCEndpoints.discover(issuer)`` or given explicitly).
        client_id: the public app client's id (no secret: a desktop app cannot keep one).
        store: where the tokens live (``FileTokenStore.default()`` if None).
        scopes: the scopes to ask for.
        port: the loopback port; 0 for an ephemeral one (RFC 8252 section 7.3). Cognito
            matches redirect URIs exactly: use the port registered in the app client.
        redirect_path: the path of the redirect URI.
        redirect_host: ``127.0.0.1`` (RFC 8252's advice) or ``localhost``, as registered.
        opener: opens the authorization URL (``webbrowser.open`` by default).
        interactive: when no usable tokens are stored, ``access_token()`` starts a sign-in
            (True) or raises ``SignInError`` (False).
        timeout_s: how long to wait for the browser's redirect.
        extra_params: more authorization parameters (``identity_provider``, ``prompt``...).
        http: an ``httpx.Client`` for the token endpoint, injectable.
        clock: Unix time, injectable.
    """

    def __init__(self, endpoints: OIDCEndpoints, client_id: str, *,
                 store: TokenStore | None = None, scopes: Sequence[str] = DEFAULT_SCOPES,
                 port: int = 0, redirect_path: str = "/callback",
                 redirect_host: str = "127.0.0.1",
                 opener: Callable[[str], Any] = webbrowser.open, interactive: bool = True,
                 timeout_s: float = 300.0, extra_params: Mapping[str, str] | None = None,
                 http: httpx.Client | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if redirect_host not in ("127.0.0.1", "localhost", "[::1]"):
            raise ValueError("redirect_host must be a loopback name: 127.0.0.1, localhost "
                             "or [::1]")
        self.endpoints = endpoints
        self.client_id = client_id
        self.store: TokenStore = store if store is not None else FileTokenStore.default()
        self.scopes = tuple(scopes)
        self.port = port
        self.redirect_path = redirect_path if redirect_path.startswith("/") \
            else "/" + redirect_path
        self.redirect_host = redirect_host
        self.opener = opener
        self.interactive = interactive
        self.timeout_s = timeout_s
        self.extra_params = dict(extra_params or {})
        self._owns_http = http is None
        self._http = http or httpx.Client(timeout=15.0)
        self._clock = clock
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the HTTP connections to the token endpoint (only a client made here)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> LoopbackSignIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the browser flow ---------------------------------------------------------------------

    def sign_in(self) -> TokenSet:
        """Run the browser flow once and store the tokens.

        Returns:
            The new tokens.

        Raises:
            SignInError: the user or provider refused, the state did not match, no redirect
                came in time, or the token exchange failed.
        """
        verifier, challenge = pkce_pair()
        state = secrets.token_urlsafe(24)
        bind = "::1" if self.redirect_host == "[::1]" else "127.0.0.1"
        with _Listener(bind, self.port, self.redirect_path) as listener:
            redirect_uri = f"http://{self.redirect_host}:{listener.port}{self.redirect_path}"
            query = {"response_type": "code", "client_id": self.client_id,
                     "redirect_uri": redirect_uri, "scope": " ".join(self.scopes),
                     "state": state, "code_challenge": challenge,
                     "code_challenge_method": "S256", **self.extra_params}
            separator = "&" if "?" in self.endpoints.authorization_endpoint else "?"
            self.opener(self.endpoints.authorization_endpoint + separator + urlencode(query))
            params = listener.wait(self.timeout_s).params
        if not secrets.compare_digest(params.get("state", ""), state):
            raise SignInError("the sign-in redirect carried the wrong state: refused")
        if "error" in params:
            detail = params.get("error_description", "")
            raise SignInError(f"sign-in refused: {params['error']} {detail}".strip())
        if not params.get("code"):
            raise SignInError("the sign-in redirect carried no code")
        tokens = self._token_request({"grant_type": "authorization_code",
                                      "code": params["code"], "redirect_uri": redirect_uri,
                                      "client_id": self.client_id,
                                      "code_verifier": verifier}, previous=None)
        self.store.save(tokens)
        return tokens

    # --- tokens -------------------------------------------------------------------------------

    def refresh(self) -> TokenSet:
        """New tokens from the stored refresh token; the store is updated.

        Raises:
            SignInError: no refresh token is stored, or the provider refused it.
        """
        current = self.store.load()
        if current is None or not current.refresh_token:
            raise SignInError("no refresh token stored: sign in first")
        tokens = self._token_request({"grant_type": "refresh_token",
                                      "refresh_token": current.refresh_token,
                                      "client_id": self.client_id}, previous=current)
        self.store.save(tokens)
        return tokens

    def access_token(self, force_refresh: bool = False) -> str:
        """A valid access token: the stored one, refreshed when it is about to expire (or
        when ``force_refresh``), else a new sign-in when ``interactive``.

        This is the ``token_provider`` for ``AttoClient``: after a 401 the client calls it
        with ``force_refresh=True``.

        Raises:
            SignInError: no usable tokens and not interactive, or sign-in failed.
        """
        with self._lock:
            tokens = self.store.load()
            if tokens is not None and not force_refresh and not tokens.expires_within(
                    REFRESH_LEEWAY_S, now=self._clock()):
                return tokens.access_token
            if tokens is not None and tokens.refresh_token:
                try:
                    return self.refresh().access_token
                except SignInError:
                    if not self.interactive:
                        raise
            if not self.interactive:
                raise SignInError("not signed in (or the session expired): sign in first")
            return self.sign_in().access_token

    async def access_token_async(self, force_refresh: bool = False) -> str:
        """``access_token`` in a worker thread: the token provider for ``AsyncAttoClient``
        (a refresh, or a sign-in waiting for the browser, never blocks the event loop).

        Raises:
            SignInError: as ``access_token``.
        """
        return await asyncio.to_thread(self.access_token, force_refresh)

    def sign_out(self) -> None:
        """Forget the tokens, revoking the refresh token first when the provider can."""
        tokens = self.store.load()
        self.store.clear()
        if tokens and tokens.refresh_token and self.endpoints.revocation_endpoint:
            # the tokens are gone from this machine whether or not the provider answers
            with contextlib.suppress(httpx.HTTPError):
                self._http.post(self.endpoints.revocation_endpoint,
                                data={"token": tokens.refresh_token,
                                      "client_id": self.client_id})

    def _token_request(self, form: dict[str, str], *, previous: TokenSet | None) -> TokenSet:
        now = self._clock()
        try:
            response = self._http.post(self.endpoints.token_endpoint, data=form,
                                       headers={"Accept": "application/json"})
        except httpx.HTTPError as exc:
            raise SignInError(f"the token endpoint could not be reached: {exc}") from exc
        try:
            body = response.json()
        except ValueError:
            body = {}
        if response.status_code != 200 or not isinstance(body, dict):
            code = body.get("error", f"http_{response.status_code}") \
                if isinstance(body, dict) else f"http_{response.status_code}"
            raise SignInError(f"the token endpoint refused the {form['grant_type']} grant: "
                              f"{code}")
        return TokenSet.from_token_response(body, now=now, previous=previous)
