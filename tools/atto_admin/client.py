"""The operator API over HTTP: one method per route, SigV4-signed unless the URL is local.

Depends on the HTTP contract only (httpx, and botocore for credentials and signing).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import httpx

#: The stack output holding the operator API's base URL (template.yaml).
URL_OUTPUT = "AdminApiUrl"
#: API Gateway's service name for SigV4.
SERVICE = "execute-api"
_REGION_IN_HOST = re.compile(r"\.execute-api\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?$")


class AdminError(Exception):
    """The API answered an error, or could not be reached.

    Attributes:
        status: the HTTP status (0 when there was no answer).
        code: the error code of the body (``not_found``, ``invalid_request``, ...).
        body: the decoded body, if any.
    """

    def __init__(self, status: int, code: str, message: str, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.body = body


def is_local(url: str) -> bool:
    """True for a loopback URL (``make serve``), which is never signed."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: The variable naming the port of ``make serve`` (as ``make serve`` reads it), and its default.
PORT_ENV, DEFAULT_PORT = "PORT", 8000
#: The title of the OpenAPI document only ``make serve`` serves (local/serve.py).
LOCAL_TITLE = "Atto Cloud (local)"
#: Seconds the CLI waits for ``make serve`` to answer its probe. ``make serve`` answers
#: ``/openapi.json`` itself, ahead of the queue its worker runs one request at a time: with
#: 40 ``POST /v1/structured`` in flight it answered in 0.03-0.23 s here, while a route of the
#: operator API (queued behind them) took 1.6-3.5 s; the first answer builds the document
#: (0.36 s). 10 s is ample on a loaded machine and costs nothing when nothing listens
#: (refused at once): only a server that hangs makes the CLI wait that long.
LOCAL_PROBE_S = 10.0


def local_serve_url(timeout_s: float = LOCAL_PROBE_S) -> str:
    """The URL of the ``make serve`` answering on ``127.0.0.1:$PORT`` (8000).

    It is recognised by its OpenAPI document (``LOCAL_TITLE``): only local mode serves the
    operator API unsigned, and only ``make serve`` serves that document.

    Raises:
        AdminError: (``no_target``) nothing answers there as ``make serve`` does; the
            message names the URL, ``PORT`` and what happened.
    """
    port = os.environ.get(PORT_ENV) or str(DEFAULT_PORT)
    url = f"http://127.0.0.1:{port}"
    try:
        response = httpx.get(url + "/openapi.json", timeout=timeout_s)
        info = response.json().get("info") if response.status_code == 200 else None
        found = isinstance(info, dict) and info.get("title") == LOCAL_TITLE
        why = "what answers there is not make serve"
    except httpx.ConnectError:
        found, why = False, "nothing listens there"
    except httpx.TimeoutException:
        found, why = False, f"it did not answer within {timeout_s:g} s"
    except (httpx.HTTPError, ValueError, AttributeError):
        found, why = False, "what answers there is not make serve"
    if found:
        return url
    given = f"{PORT_ENV}={port}" if os.environ.get(PORT_ENV) else \
        f"{PORT_ENV} unset, so {DEFAULT_PORT}"
    raise AdminError(0, "no_target", f"no make serve at {url} ({given}): {why}. Start `make "
                     f"serve`, or set {PORT_ENV} to the port it runs on; for a deployed stack "
                     "pass --stack NAME (or set ATTO_STACK), for any other API --url URL "
                     "(or ATTO_ADMIN_URL)")


def region_of(url: str) -> str | None:
    """The region in an ``execute-api`` host name, if it has one."""
    match = _REGION_IN_HOST.search(urlsplit(url).hostname or "")
    return match.group(1) if match else None


def stack_url(stack: str, *, region: str | None = None, profile: str | None = None) -> str:
    """The operator API's base URL from a deployed stack's outputs (DescribeStacks).

    Raises:
        AdminError: the stack cannot be read or has no ``AdminApiUrl`` output.
    """
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        session = boto3.session.Session(profile_name=profile, region_name=region)
        reply = session.client("cloudformation").describe_stacks(StackName=stack)
    except (BotoCoreError, ClientError) as exc:
        raise AdminError(0, "stack_unreadable", f"cannot read stack {stack!r}: {exc}") from exc
    for output in reply["Stacks"][0].get("Outputs", []):
        if output["OutputKey"] == URL_OUTPUT:
            return str(output["OutputValue"])
    raise AdminError(0, "stack_unreadable", f"stack {stack!r} has no {URL_OUTPUT} output")


@dataclass
class Signer:
    """SigV4 signing with botocore's credentials."""

    region: str
    profile: str | None = None

    def headers(self, method: str, url: str, body: bytes | None,
                headers: dict[str, str]) -> dict[str, str]:
        """``headers`` plus the SigV4 ones for this exact request.

        Raises:
            AdminError: no AWS credentials could be found.
        """
        import botocore.session
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest

        session = botocore.session.Session(profile=self.profile)
        credentials = session.get_credentials()
        if credentials is None:
            raise AdminError(0, "no_credentials", "no AWS credentials found (pass --profile, "
                             "set AWS_ACCESS_KEY_ID, or run `aws sso login`; for make serve "
                             "pass --url http://127.0.0.1:8000)")
        request = AWSRequest(method=method, url=url, data=body or b"", headers=dict(headers))
        SigV4Auth(credentials.get_frozen_credentials(), SERVICE, self.region).add_auth(request)
        return dict(request.headers.items())


class AdminClient:
    """The operator API, one method per route.

    Args:
        url: the API's base URL (``https://<id>.execute-api.<region>.amazonaws.com/`` or
            ``http://127.0.0.1:8000``).
        sign: SigV4-sign requests (default: unless the URL is loopback).
        region: the signing region (default: from the host name, else botocore's).
        profile: the AWS profile of the credentials.
        timeout_s: seconds per request.
        transport: an httpx transport (tests).
    """

    def __init__(self, url: str, *, sign: bool | None = None, region: str | None = None,
                 profile: str | None = None, timeout_s: float = 15.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base = url.rstrip("/")
        self.signer: Signer | None = None
        if sign if sign is not None else not is_local(url):
            chosen = region or region_of(url)
            if chosen is None:
                import botocore.session

                chosen = botocore.session.Session(profile=profile).get_config_variable("region")
            if not chosen:
                raise AdminError(0, "no_region", "cannot tell the signing region: pass --region")
            self.signer = Signer(chosen, profile)
        self.http = httpx.Client(timeout=timeout_s, transport=transport)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                query: dict[str, Any] | None = None) -> tuple[int, Any]:
        """Send one request; (status, decoded body) for a 2xx answer.

        Raises:
            AdminError: a 4xx/5xx answer (with its code) or no answer at all.
        """
        params = {k: v for k, v in (query or {}).items() if v is not None}
        # %20, not +, for spaces: what SigV4 canonicalises and API Gateway decodes alike
        url = self.base + path + (("?" + urlencode(params, quote_via=quote)) if params else "")
        data = json.dumps(body).encode() if body is not None else None
        headers = {"accept": "application/json", "user-agent": "atto-admin/1.0"}
        if data is not None:
            headers["content-type"] = "application/json"
        if self.signer is not None:
            headers = self.signer.headers(method, url, data, headers)
        try:
            response = self.http.request(method, url, content=data, headers=headers)
        except httpx.HTTPError as exc:
            raise AdminError(0, "unreachable", f"{method} {url}: {exc}") from exc
        try:
            decoded = response.json()
        except ValueError:
            decoded = response.text
        if response.status_code >= 400:
            code, message = "error", str(decoded) or response.reason_phrase
            if isinstance(decoded, dict):  # ours: {"error": {...}}; API Gateway's: {"message"}
                found = decoded.get("error")
                error: dict[str, Any] = found if isinstance(found, dict) else {}
                code = str(error.get("code") or "error")
                message = str(error.get("message") or decoded.get("message")
                              or response.reason_phrase)
            raise AdminError(response.status_code, code, message, decoded)
        return response.status_code, decoded

    @staticmethod
    def _user(user_id: str) -> str:
        return "/admin/v1/users/" + quote(user_id, safe="")

    def show(self, user_id: str) -> Any:
        """The user's whole picture."""
        return self.request("GET", self._user(user_id))[1]

    def set_plan(self, user_id: str, plan: str, reason: str) -> Any:
        """Override the user's plan."""
        return self.request("PUT", self._user(user_id) + "/plan",
                            {"plan": plan, "reason": reason})[1]

    def clear_plan(self, user_id: str, reason: str) -> Any:
        """Remove the user's plan override."""
        return self.request("DELETE", self._user(user_id) + "/plan", {"reason": reason})[1]

    def create_grant(self, user_id: str, *, tokens: int, kind: str, reference: str,
                     reason: str, expires_at: str | None = None) -> Any:
        """Create a grant (once per reference)."""
        body: dict[str, Any] = {"tokens": tokens, "kind": kind, "reference": reference,
                                "reason": reason}
        if expires_at is not None:
            body["expires_at"] = expires_at
        return self.request("POST", self._user(user_id) + "/grants", body)[1]

    def void_grant(self, user_id: str, reference: str, reason: str) -> Any:
        """Void a grant."""
        return self.request("DELETE", self._user(user_id) + "/grants/" + quote(reference, safe=""),
                            {"reason": reason})[1]

    def refund(self, user_id: str, request_id: str, reason: str) -> Any:
        """Refund one charge (at most once)."""
        return self.request("POST", self._user(user_id) + "/refunds",
                            {"request_id": request_id, "reason": reason})[1]

    def suspend(self, user_id: str, reason: str, until: str | None = None) -> Any:
        """Suspend the user."""
        body: dict[str, Any] = {"reason": reason}
        if until is not None:
            body["until"] = until
        return self.request("PUT", self._user(user_id) + "/suspension", body)[1]

    def unsuspend(self, user_id: str, reason: str) -> Any:
        """Lift the user's suspension."""
        return self.request("DELETE", self._user(user_id) + "/suspension", {"reason": reason})[1]

    def statement(self, user_id: str, since: str | None = None, until: str | None = None,
                  *, page: int = 500) -> Any:
        """The user's whole statement of [since, until): every page's records, newest
        first, with the first page's per-day totals."""
        query: dict[str, Any] = {"from": since, "to": until, "limit": page}
        first = self.request("GET", self._user(user_id) + "/statement", query=query)[1]
        records, cursor = list(first["records"]), first.get("cursor")
        while cursor:
            more = self.request("GET", self._user(user_id) + "/statement",
                                query={**query, "cursor": cursor})[1]
            records += more["records"]
            cursor = more.get("cursor")
        return {**first, "records": records, "cursor": None}

    def grant_history(self, user_id: str, reference: str) -> Any:
        """A grant's history: created, draws, returns, void, expiry."""
        return self.request("GET", self._user(user_id) + "/grants/" + quote(reference, safe="")
                            + "/history")[1]

    def log(self, user_id: str | None = None, limit: int | None = None) -> Any:
        """Operator actions (the audit log), newest first."""
        return self.request("GET", "/admin/v1/audit", query={"user_id": user_id,
                                                              "limit": limit})[1]

    def audit(self, user_id: str | None = None, *, repair: bool = False) -> Any:
        """Check the books (the conservation audit): one user's, or the active users'."""
        body: dict[str, Any] = {"repair": repair}
        if user_id is not None:
            body["user_id"] = user_id
        return self.request("POST", "/admin/v1/books", body)[1]

    def reload(self, user_id: str) -> Any:
        """Drop the user's cached entitlements (the next request loads DynamoDB's)."""
        return self.request("POST", self._user(user_id) + "/reload")[1]
