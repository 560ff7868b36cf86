"""Error bodies and rate-limit headers in each upstream API's own shape.

Dialects: ``openai``, ``adzuna``, ``tavily``, ``brave`` and ``html`` (web pages).
Handlers raise ``ApiFault``; the gate renders it with the endpoint's dialect.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from starlette.responses import HTMLResponse, JSONResponse, Response


@dataclass
class ApiFault(Exception):
    """An error answer: status, message and dialect-specific details.

    Attributes:
        status: HTTP status.
        message: human-readable text.
        kind: what went wrong: ``auth``, ``invalid``, ``rate``, ``tokens``,
            ``too_large``, ``forced``, ``random``, ``not_found``, ``server``.
        retry_after_s: exact seconds for ``Retry-After`` (rounded up on the wire).
        details: extra fields (``param``, ``code`` for OpenAI; ``exception`` for Adzuna).
    """

    status: int
    message: str = ""
    kind: str = "invalid"
    retry_after_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)


def retry_after_headers(dialect: str, retry_after_s: float | None) -> dict[str, str]:
    """``Retry-After`` in whole seconds, rounded up so that waiting it is always enough."""
    if retry_after_s is None:
        return {}
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s - 1e-9)))}
    if dialect == "openai":
        headers["retry-after-ms"] = str(max(1, math.ceil(retry_after_s * 1000)))
    return headers


def render(dialect: str, fault: ApiFault, *, model: str = "") -> Response:
    """The fault as the dialect's error response."""
    headers = retry_after_headers(dialect, fault.retry_after_s)
    reason = _reason(fault.status)
    message = fault.message or _default_message(dialect, fault, model)
    if dialect == "openai":
        body: Any = {"error": {"message": message, "type": _openai_type(fault),
                               "param": fault.details.get("param"),
                               "code": fault.details.get("code", _openai_code(fault))}}
    elif dialect == "adzuna":
        body = {"__CLASS__": "Adzuna::API::Response::Exception",
                "exception": fault.details.get("exception", _adzuna_code(fault)),
                "display": message, "doc": "https://api.adzuna.com/v1/doc"}
    elif dialect == "tavily":
        body = {"detail": {"error": message}}
    elif dialect == "brave":
        body = {"type": "ErrorResponse",
                "error": {"id": str(uuid.uuid4()), "status": fault.status,
                          "code": fault.details.get("code", _brave_code(fault)),
                          "detail": message,
                          "meta": fault.details.get("meta", {"component": "emulator"})},
                "time": int(time.time())}
    else:
        html = (f"<!doctype html><html><head><title>{fault.status} {reason}</title></head>"
                f"<body><h1>{fault.status} {reason}</h1><p>{message}</p></body></html>")
        return HTMLResponse(html, status_code=fault.status, headers=headers)
    return JSONResponse(body, status_code=fault.status, headers=headers)


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def _default_message(dialect: str, fault: ApiFault, model: str) -> str:
    wait = "" if fault.retry_after_s is None else \
        f" Please try again in {fault.retry_after_s:.3g}s."
    if fault.kind in ("rate", "tokens", "too_large") or fault.status == 429:
        if dialect == "openai":
            what = "tokens" if fault.kind in ("tokens", "too_large") else "requests"
            unit = f"{what} per {_window_text(what, fault.details.get('window_s', 60.0))}"
            limit = fault.details.get("limit")
            limit_text = f" Limit {limit}." if limit is not None else ""
            if fault.kind == "too_large":
                return (f"Request too large for {model or 'the model'} on {unit}:{limit_text} "
                        "The input or output tokens must be reduced in order to run "
                        "successfully.")
            return f"Rate limit reached for {model or 'the model'} on {unit}:{limit_text}{wait}"
        if dialect == "tavily":
            return "Your request has been blocked due to excessive requests."
        if dialect == "brave":
            return "Request rate limit exceeded for plan."
        return f"Too many requests.{wait}"
    if fault.status >= 500:
        if dialect == "openai":
            if fault.status == 503:
                return "The server is overloaded or not ready yet."
            return "The server had an error while processing your request. Sorry about that!"
        return f"{_reason(fault.status)} (emulated upstream failure)"
    return _reason(fault.status)


def _window_text(what: str, window_s: float) -> str:
    letter = what[0].upper()
    names = {1.0: ("second", "S"), 60.0: ("min", "M"), 3600.0: ("hour", "H"),
             86400.0: ("day", "D")}
    if float(window_s) in names:
        word, abbr = names[float(window_s)]
        return f"{word} ({letter}P{abbr})"
    return f"{window_s:g} s"


def _openai_type(fault: ApiFault) -> str:
    if fault.kind in ("tokens", "too_large"):
        return "tokens"
    if fault.status == 429:
        return "requests"
    if fault.status >= 500:
        return "server_error"
    return str(fault.details.get("type", "invalid_request_error"))


def _openai_code(fault: ApiFault) -> str | None:
    if fault.status == 429:
        return "rate_limit_exceeded"
    if fault.kind == "auth":
        return "invalid_api_key"
    return None


def _adzuna_code(fault: ApiFault) -> str:
    return {401: "AUTH_FAIL", 400: "BAD_REQUEST", 404: "NOT_FOUND",
            429: "RATE_LIMIT_EXCEEDED"}.get(fault.status, "INTERNAL_ERROR")


def _brave_code(fault: ApiFault) -> str:
    if fault.status == 429:
        return "RATE_LIMITED"
    if fault.kind == "auth":
        return "SUBSCRIPTION_TOKEN_INVALID"
    if fault.status == 422:
        return "VALIDATION"
    return "INTERNAL_ERROR" if fault.status >= 500 else "BAD_REQUEST"


def openai_rate_headers(limit: int, remaining: int, reset_s: float) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*-requests`` headers."""
    return {"x-ratelimit-limit-requests": str(limit),
            "x-ratelimit-remaining-requests": str(remaining),
            "x-ratelimit-reset-requests": _duration(reset_s)}


def brave_rate_headers(limit: int, remaining: int, reset_s: float) -> dict[str, str]:
    """Brave's ``X-RateLimit-*`` headers (per-window part only)."""
    return {"X-RateLimit-Limit": str(limit), "X-RateLimit-Remaining": str(remaining),
            "X-RateLimit-Reset": str(max(0, math.ceil(reset_s)))}


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes)}m{secs:.3g}s" if minutes else f"{secs:.3g}s"


def json_body(raw: bytes) -> Any:
    """The request body parsed as JSON.

    Raises:
        ApiFault: 400 when the body is not JSON.
    """
    try:
        return json.loads(raw or b"null")
    except ValueError as exc:
        raise ApiFault(400, "We could not parse the JSON body of your request.",
                       details={"code": "invalid_json"}) from exc
