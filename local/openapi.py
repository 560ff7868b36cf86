"""What ``make serve``'s one OpenAPI document adds to the functions' own: the local identity
headers as security schemes and ``Idempotency-Key`` as a parameter, so that "Try it out" in
``/docs`` sends what the server reads.

``X-Atto-User`` and ``X-Atto-Plan`` exist only in local mode (``ATTO_ENV=local``): in AWS
the JWT authorizer's claims name the user and the plan, and the headers are ignored. That is
why they are declared here, in the document only ``make serve`` serves, and not by the
functions. ``Idempotency-Key`` is read on every metered route, locally and in AWS.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from usage_limits.web.identity import (
    IDEMPOTENCY_HEADER,
    LOCAL_PLAN_HEADER,
    LOCAL_USER_HEADER,
    MAX_IDEMPOTENCY_KEY,
)


def _header(name: str) -> str:
    """A header name as documents write it: ``x-atto-user`` -> ``X-Atto-User``."""
    return "-".join(part.capitalize() for part in name.split("-"))


#: The security schemes of the local document (OpenAPI ``apiKey`` in a header).
SECURITY_SCHEMES: dict[str, dict[str, Any]] = {
    "AttoUser": {
        "type": "apiKey", "in": "header", "name": _header(LOCAL_USER_HEADER),
        "description": "Local mode only (make serve): the user the request is for. In AWS "
                       "the JWT authorizer's `sub` claim names the user and this header is "
                       "ignored."},
    "AttoPlan": {
        "type": "apiKey", "in": "header", "name": _header(LOCAL_PLAN_HEADER),
        "description": "Local mode only, optional: the plan to charge under (make serve "
                       "defines `default`, `free` and `pro`); in AWS the JWT plan claim. A "
                       "name of no plan is refused with 400."},
}
#: Each ``/v1/`` operation: the user alone, or the user and a plan (either suffices).
USER_SECURITY: list[dict[str, list[str]]] = [{"AttoUser": []}, {"AttoUser": [], "AttoPlan": []}]
#: The header parameter of every metered operation.
IDEMPOTENCY_PARAMETER: dict[str, Any] = {
    "name": _header(IDEMPOTENCY_HEADER), "in": "header", "required": False,
    "description": "Charged once per user and key: a repeat after success replays the stored "
                   "answer (`Idempotent-Replayed: true`); the key is the request id support "
                   "refunds by.",
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY,
               "pattern": "^[ -~]+$"},
}

def metered_routes(apps: Iterable[Any]) -> set[tuple[str, str]]:
    """``(method, path)`` of every route of ``apps`` that declares a cost in tokens (a
    ``require_tokens`` dependency, recognised by its ``cost``)."""
    found: set[tuple[str, str]] = set()
    for app in apps:
        for route in app.routes:
            methods, dependant = getattr(route, "methods", None), getattr(route, "dependant", None)
            if not methods or dependant is None:
                continue
            stack = list(dependant.dependencies)
            while stack:
                dependency = stack.pop()
                if hasattr(dependency.call, "cost"):
                    found.update((method, route.path) for method in methods)
                stack.extend(dependency.dependencies)
    return found


def with_local_security(document: Mapping[str, Any],
                        metered: set[tuple[str, str]]) -> dict[str, Any]:
    """``document`` with ``SECURITY_SCHEMES`` on every ``/v1/`` operation and
    ``IDEMPOTENCY_PARAMETER`` on each metered one (``metered``: ``(METHOD, path)``)."""
    out = copy.deepcopy(dict(document))
    out.setdefault("components", {})["securitySchemes"] = copy.deepcopy(SECURITY_SCHEMES)
    for path, item in out.get("paths", {}).items():
        if not path.startswith("/v1/"):
            continue
        for method, operation in item.items():
            operation["security"] = copy.deepcopy(USER_SECURITY)
            if (method.upper(), path) in metered:
                operation.setdefault("parameters", []).append(copy.deepcopy(
                    IDEMPOTENCY_PARAMETER))
    return out
