"""A small OpenID Connect provider for the sign-in tests, on a private loopback port.

It serves discovery, an authorization endpoint that "signs the user in" at once and
redirects to the client's redirect URI with a code, and a token endpoint that checks
what a real provider checks: the client id, the redirect URI of the code, the PKCE
``S256`` challenge against the verifier, single use of each code, and refresh tokens.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit


@dataclass
class Grant:
    """A code the authorization endpoint issued, with what it was issued for."""

    client_id: str
    redirect_uri: str
    challenge: str
    method: str
    scope: str


@dataclass
class OIDCStandIn:
    """The provider; ``deny`` makes the next authorization answer ``access_denied``."""

    client_id: str = "atto-desktop"
    expires_in: int = 3600
    deny: bool = False
    authorize_requests: list[dict[str, str]] = field(default_factory=list)
    token_requests: list[dict[str, str]] = field(default_factory=list)
    codes: dict[str, Grant] = field(default_factory=dict)
    refresh_tokens: set[str] = field(default_factory=set)
    access_tokens: list[str] = field(default_factory=list)
    revoked: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                standin._get(self)

            def do_POST(self) -> None:  # noqa: N802
                standin._post(self)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> OIDCStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # --- endpoints ----------------------------------------------------------------------------

    def _get(self, req: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(req.path)
        if parts.path == "/.well-known/openid-configuration":
            _json(req, 200, {"issuer": self.url,
                             "authorization_endpoint": self.url + "/authorize",
                             "token_endpoint": self.url + "/token",
                             "revocation_endpoint": self.url + "/revoke",
                             "code_challenge_methods_supported": ["S256"]})
            return
        if parts.path != "/authorize":
            _json(req, 404, {"error": "not_found"})
            return
        q = {k: v[0] for k, v in parse_qs(parts.query).items()}
        self.authorize_requests.append(q)
        if q.get("client_id") != self.client_id or q.get("response_type") != "code":
            _json(req, 400, {"error": "invalid_request"})
            return
        if self.deny:
            self.deny = False
            answer = {"error": "access_denied", "state": q.get("state", "")}
        else:
            code = secrets.token_urlsafe(16)
            self.codes[code] = Grant(q["client_id"], q["redirect_uri"],
                                     q.get("code_challenge", ""),
                                     q.get("code_challenge_method", ""), q.get("scope", ""))
            answer = {"code": code, "state": q.get("state", "")}
        req.send_response(302)
        req.send_header("Location", q["redirect_uri"] + "?" + urlencode(answer))
        req.send_header("Content-Length", "0")
        req.end_headers()

    def _post(self, req: BaseHTTPRequestHandler) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        form = {k: v[0] for k, v in parse_qs(req.rfile.read(length).decode()).items()}
        path = urlsplit(req.path).path
        if path == "/revoke":
            self.revoked.append(form.get("token", ""))
            self.refresh_tokens.discard(form.get("token", ""))
            _json(req, 200, {})
            return
        if path != "/token":
            _json(req, 404, {"error": "not_found"})
            return
        self.token_requests.append(form)
        if form.get("client_id") != self.client_id:
            _json(req, 401, {"error": "invalid_client"})
            return
        grant_type = form.get("grant_type")
        if grant_type == "authorization_code":
            grant = self.codes.pop(form.get("code", ""), None)  # a code works once
            verifier = form.get("code_verifier", "")
            if grant is None or grant.redirect_uri != form.get("redirect_uri") \
                    or grant.method != "S256" or not verifier \
                    or s256(verifier) != grant.challenge:
                _json(req, 400, {"error": "invalid_grant"})
                return
            _json(req, 200, self._issue(refresh=True, scope=grant.scope))
        elif grant_type == "refresh_token":
            if form.get("refresh_token") not in self.refresh_tokens:
                _json(req, 400, {"error": "invalid_grant"})
                return
            _json(req, 200, self._issue(refresh=False, scope=None))  # as Cognito: no new one
        else:
            _json(req, 400, {"error": "unsupported_grant_type"})

    def _issue(self, *, refresh: bool, scope: str | None) -> dict[str, Any]:
        access = "at-" + secrets.token_urlsafe(8)
        self.access_tokens.append(access)
        body: dict[str, Any] = {"access_token": access, "id_token": "id-" + access,
                                "token_type": "Bearer", "expires_in": self.expires_in}
        if scope:
            body["scope"] = scope
        if refresh:
            token = "rt-" + secrets.token_urlsafe(8)
            self.refresh_tokens.add(token)
            body["refresh_token"] = token
        return body


def s256(verifier: str) -> str:
    """RFC 7636's S256 transform, written out independently of the client's."""
    digest = hashlib.sha256(verifier.encode()).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def _json(req: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    req.send_response(status)
    req.send_header("Content-Type", "application/json")
    req.send_header("Content-Length", str(len(data)))
    req.end_headers()
    req.wfile.write(data)
