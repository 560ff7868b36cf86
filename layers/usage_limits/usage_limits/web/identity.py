"""Who is calling, and which request id their charge is tied to.

Identity comes only from the API Gateway JWT authorizer's claims (``sub``), read from the
event Mangum puts in ``scope["aws.event"]``. Only in local mode (``ATTO_ENV=local``) may the
``X-Atto-User`` header name the user; everywhere else that header is ignored.

The user's plan claim (``ATTO_PLAN_CLAIM``) is read from the same claims; in local mode an
``X-Atto-Plan`` header stands in for it, and is ignored everywhere else.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from ..entitlements.plans import claim_names
from .errors import Forbidden, InvalidRequest, Unauthorized
from .settings import settings

if TYPE_CHECKING:
    from ..entitlements.plans import ResolvedPlan

log = logging.getLogger("usage_limits.web")

LOCAL_USER_HEADER = "x-atto-user"
LOCAL_PLAN_HEADER = "x-atto-plan"
IDEMPOTENCY_HEADER = "idempotency-key"
MAX_USER_ID = 256
MAX_IDEMPOTENCY_KEY = 128
#: Where a request's scope keeps what was found out about it (the middleware, the guard and
#: the route all ask the same questions of one request).
_SCOPE_KEY = "usage_limits.identity"


def _found(request: Request) -> dict[str, str]:
    """The identity answers already worked out for this request (user id, request id)."""
    scope = request.scope
    found: dict[str, str] | None = scope.get(_SCOPE_KEY)
    if found is None:
        found = scope[_SCOPE_KEY] = {}
    return found


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
    found = _found(request)
    known = found.get("user")
    if known is not None:
        return known
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
    found["user"] = sub
    return sub


def plan_claim(request: Request) -> object:
    """The value of the plan claim (``ATTO_PLAN_CLAIM``), or in local mode ``X-Atto-Plan``.

    Returns:
        The claim's raw value (a string or a list), or None when there is none.
    """
    conf = settings()
    if conf.local:
        header = request.headers.get(LOCAL_PLAN_HEADER)
        if header is not None:
            return header
    if conf.plan_claim is None:
        return None
    event = request.scope.get("aws.event") or {}
    return _claims(event).get(conf.plan_claim)


def plan(request: Request, override: str | None = None) -> ResolvedPlan:
    """The caller's plan: ``override``, else the plan claim, else the default.

    A claim that names no plan gets the default plan and a warning in the log, never an
    error: the token is valid, only its plan is unknown here. The local ``X-Atto-Plan``
    header is typed by hand, so one naming no plan is refused instead.

    Args:
        request: the request.
        override: an operator's override for this user (a plan name), if known.

    Returns:
        The plan and where it came from.

    Raises:
        InvalidRequest: in local mode, ``X-Atto-Plan`` names none of the plans (400).
    """
    conf = settings()
    plans = conf.plans
    if conf.local:
        header = request.headers.get(LOCAL_PLAN_HEADER)
        if header is not None and not any(plans.get(n) for n in claim_names(header)):
            raise InvalidRequest(f"X-Atto-Plan: {header[:64]!r} is not a plan here; the "
                                 f"plans are {', '.join(plans.by_name)}")
    resolved = plans.resolve(override=override, claim=plan_claim(request))
    if resolved.unknown_claim is not None:
        log.warning("plan claim names no plan; using the default plan",
                    extra={"claim": resolved.unknown_claim, "plan": resolved.plan.name})
    return resolved


def operator_principal(request: Request) -> str:
    """Who is calling an operator route: the IAM principal API Gateway verified.

    HTTP API's ``AWS_IAM`` authorization puts the signer in ``requestContext.authorizer.iam``
    (``userArn``). JWT claims are never read here. In local mode, where nothing signs,
    the principal is ``local``.

    Raises:
        Forbidden: outside local mode, the request carries no IAM principal.
    """
    event = request.scope.get("aws.event") or {}
    authorizer = (event.get("requestContext") or {}).get("authorizer") or {}
    iam = authorizer.get("iam") if isinstance(authorizer, dict) else None
    arn = iam.get("userArn") if isinstance(iam, dict) else None
    if isinstance(arn, str) and arn.strip():
        return arn
    if settings().local:
        return "local"
    raise Forbidden("operator routes need a request signed with AWS credentials (IAM)")


def request_id(request: Request) -> str:
    """The id a charge is tied to: the Idempotency-Key, else API Gateway's, else a new one.

    The three sources get distinct prefixes so they can never collide. Keys are scoped to
    the user because every ledger key is.

    Raises:
        InvalidRequest: the Idempotency-Key is malformed (``idempotency_key``).
    """
    found = _found(request)
    known = found.get("request_id")
    if known is None:
        known = found["request_id"] = _new_request_id(request)
    return known


def idempotency_key(field: str) -> str:
    """The key an ``Idempotency-Key`` field carries.

    The IETF draft (draft-ietf-httpapi-idempotency-key-header) defines the field as an RFC
    9651 Item whose value is a String: ``Idempotency-Key: "8e03978e-40d5-43e8"``, parsed
    here by ``http_sf`` (unescaping ``\\"`` and ``\\\\``; parameters, which the draft
    defines none of, are ignored as RFC 9651 asks). The bare form the README documented
    first (``Idempotency-Key: 8e03978e-40d5-43e8``) is still accepted, as the key itself:
    a field that does not open with a double quote is bare. Both forms of one key are one
    key, so a client of either kind is charged once.

    Args:
        field: the field's value.

    Returns:
        The key, unquoted: 1 to ``MAX_IDEMPOTENCY_KEY`` printable ASCII characters.

    Raises:
        InvalidRequest: a quoted field that is not an sf-string, or a key that is empty,
            too long or not printable ASCII (400, before anything is charged or stored).
    """
    key = field.strip(" \t")
    if key.startswith('"'):
        import http_sf  # only a quoted field needs the parser

        value: object = None
        try:  # an Item is (bare item, parameters)
            item = http_sf.parse(key.encode("ascii"), tltype="item")
            value = item[0] if isinstance(item, tuple) else None
        except (http_sf.StructuredFieldError, UnicodeEncodeError, ValueError):
            pass
        if type(value) is not str:
            raise InvalidRequest("Idempotency-Key: a quoted key must be an RFC 9651 string "
                                 '("...", with \\" and \\\\ escaped)')
        key = value
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY or not all(" " <= c <= "~" for c in key):
        raise InvalidRequest(
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters")
    return key


def _new_request_id(request: Request) -> str:
    field = request.headers.get(IDEMPOTENCY_HEADER)
    if field is not None:
        return "k:" + idempotency_key(field)
    event = request.scope.get("aws.event") or {}
    gateway_id = (event.get("requestContext") or {}).get("requestId")
    if isinstance(gateway_id, str) and gateway_id:
        return "r:" + gateway_id[:MAX_IDEMPOTENCY_KEY]
    return "g:" + uuid.uuid4().hex


#: The prefixes ``request_id`` gives ids by their source: ``k:`` an Idempotency-Key, ``r:``
#: API Gateway's request id, ``g:`` generated here. Only the ledger sees them.
REQUEST_ID_PREFIXES = ("k:", "r:", "g:")


def shown_id(request_id: str) -> str:
    """The id users and support see for a ledger id: without its source prefix.

    The response's ``X-Request-Id``, the error body's ``request_id``, ``GET /v1/usage`` and
    the operator API all show this form, and a support refund accepts it.

    Args:
        request_id: an id as ``request_id`` made it (``k:...``, ``r:...``, ``g:...``).

    Returns:
        The id without its prefix (an id without a known prefix unchanged).
    """
    if request_id[:2] in REQUEST_ID_PREFIXES and len(request_id) > 2:
        return request_id[2:]
    return request_id


def response_id(request: Request) -> str:
    """The id a response carries (``X-Request-Id`` and the error body): ``shown_id`` of the
    id the request's charge is tied to, even for a request that charges nothing.

    A malformed Idempotency-Key (answered 400 by the route) gets API Gateway's id, or a
    new one, so that answer too has an id to quote.
    """
    try:
        return shown_id(request_id(request))
    except InvalidRequest:
        event = request.scope.get("aws.event") or {}
        gateway_id = (event.get("requestContext") or {}).get("requestId")
        if isinstance(gateway_id, str) and gateway_id:
            return gateway_id[:MAX_IDEMPOTENCY_KEY]
        return uuid.uuid4().hex
