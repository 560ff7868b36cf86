"""Who is calling, and which request id their charge is tied to.

Identity comes only from the API Gateway JWT authorizer's claims (``sub``), read from the
event Mangum puts in ``scope["aws.event"]``. Only in local mode (``ATTO_ENV=local``) may the
``X-Atto-User`` header name the user; everywhere else that header is ignored.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request

from .errors import InvalidRequest, Unauthorized
from .settings import settings

LOCAL_USER_HEADER = "x-atto-user"
IDEMPOTENCY_HEADER = "idempotency-key"
MAX_USER_ID = 256
MAX_IDEMPOTENCY_KEY = 128


def _claims(event: dict[str, Any]) -> dict[str, Any]:
    """The JWT authorizer's claims: ``authorizer.jwt.claims`` in a payload-v2 event.

    ``authorizer.claims`` is where payload v1 puts them; a v2 event never has it from a JWT
    authorizer, so in a v2 event it is ignored rather than trusted.
    """
    authorizer = (event.get("requestContext") or {}).get("authorizer") or {}
    if not isinstance(authorizer, dict):
        return {}
    jwt = authorizer.get("jwt") or {}
    claims = jwt.get("claims") if isinstance(jwt, dict) else None
    if not claims and event.get("version") != "2.0":
        claims = authorizer.get("claims")
    return claims if isinstance(claims, dict) else {}


def user_id(request: Request) -> str:
    """The caller's user id.

    Raises:
        Unauthorized: no JWT ``sub`` (and, in local mode, no ``X-Atto-User``).
    """
    event = request.scope.get("aws.event") or {}
    sub = _claims(event).get("sub")
    local = settings().local
    if not sub and local:
        sub = request.headers.get(LOCAL_USER_HEADER)
    if not isinstance(sub, str) or not sub.strip():
        if local:
            raise Unauthorized("no authenticated user: in local mode, name the user with the "
                               "X-Atto-User header (e.g. -H 'X-Atto-User: alice')")
        raise Unauthorized("no authenticated user: a valid bearer token is required")
    if len(sub) > MAX_USER_ID or not sub.isprintable():
        raise Unauthorized("the user identity is malformed")
    return sub


def request_id(request: Request) -> str:
    """The id a charge is tied to: the Idempotency-Key, else API Gateway's, else a new one.

    The three sources get distinct prefixes so they can never collide. Keys are scoped to
    the user because every ledger key is.

    Raises:
        InvalidRequest: the Idempotency-Key is empty, too long or not printable ASCII.
    """
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is not None:
        if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY or not all(" " <= c <= "~" for c in key):
            raise InvalidRequest(
                f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters")
        return "k:" + key
    event = request.scope.get("aws.event") or {}
    gateway_id = (event.get("requestContext") or {}).get("requestId")
    if isinstance(gateway_id, str) and gateway_id:
        return "r:" + gateway_id[:MAX_IDEMPOTENCY_KEY]
    return "g:" + uuid.uuid4().hex
