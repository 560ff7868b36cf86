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
        details: extra fields (``param``, ``code``, ``type`` for OpenAI; ``exception`` for
            Adzuna).
        headers: extra response headers (``x-should-retry``, ``retry-after-ms``).
    """

    status: int
    message: str = ""
    kind: str = "invalid"
    retry_after_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


#: Failures ``fail_next`` can send by name (``{"kind": ...}``), with their status. Those of
#: status 200 are answers the handler shapes (see ``local.emulator.llm``).
FAILURE_KINDS = {
    "quota": 429,            # OpenAI insufficient_quota: no Retry-After, x-should-retry: false
    "retry_after_ms": 429,   # a rate limit that says how long only in retry-after-ms
    "invalid_key": 401,      # OpenAI invalid_api_key
    "model_not_found": 404,  # OpenAI model_not_found
    "schema_rejected": 400,  # OpenAI invalid_json_schema
    "plan_limit": 432,       # Tavily: the plan's credits are spent
    "paygo_limit": 433,      # Tavily: the pay-as-you-go limit is reached
    "refusal": 200,          # a chat answer whose message is a refusal
    "length": 200,           # a chat answer cut at the output limit (finish_reason length)
    "content_filter": 200,   # a chat answer stopped by the content filter
    "nonconforming": 200,    # a chat answer that does not match the requested schema
}
ANSWER_KINDS = frozenset(k for k, status in FAILURE_KINDS.items() if status == 200)


def forced_fault(kind: str, retry_after_s: float | None, message: str = "") -> ApiFault:
    """The error answer of a named failure (``FAILURE_KINDS``, status not 200)."""
    status = FAILURE_KINDS[kind]
    if kind == "quota":
        return ApiFault(status, message or "You exceeded your current quota, please check "
                        "your plan and billing details. For more information on this error, "
                        "read the docs: https://platform.openai.com/docs/guides/error-codes/"
                        "api-errors.", kind="forced",
                        details={"code": "insufficient_quota", "type": "insufficient_quota"},
                        headers={"x-should-retry": "false"})
    if kind == "retry_after_ms":
        wait_ms = max(1, math.ceil((0.1 if retry_after_s is None else retry_after_s) * 1000))
        return ApiFault(status, message or f"Rate limit reached. Please try again in "
                        f"{wait_ms}ms.", kind="rate",
                        details={"code": "rate_limit_exceeded", "type": "requests"},
                        headers={"retry-after-ms": str(wait_ms)})
    if kind == "invalid_key":
        return ApiFault(status, message or "Incorrect API key provided: sk-emu***********0000. "
                        "You can find your API key at https://platform.openai.com/account/"
                        "api-keys.", kind="auth", details={"code": "invalid_api_key"})
    if kind == "model_not_found":
        return ApiFault(status, message or "The model does not exist or you do not have "
                        "access to it.", kind="not_found", details={"code": "model_not_found"})
    if kind == "schema_rejected":
        return ApiFault(status, message or "Invalid schema for response_format 'result': "
                        "schema rejected by the emulator on request.", kind="invalid",
                        details={"code": "invalid_json_schema", "param": "response_format"})
    text = ("This request exceeds your plan's set usage limit. Please upgrade your plan or "
            "contact support@tavily.com" if kind == "plan_limit" else
            "This request exceeds the pay-as-you-go limit. You can increase your limit on "
            "the Tavily dashboard.")
    return ApiFault(status, message or text, kind="forced")


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
    headers = {**retry_after_headers(dialect, fault.retry_after_s), **fault.headers}
    reason = _reason(fault.status)
    message = fault.message or _default_message(dialect, fault, model)
    if dialect == "openai":
        body: Any = {"error": {"message": message,
                               "type": fault.details.get("type", _openai_type(fault)),
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
    if fault.kind == "not_found":
        return "model_not_found"
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
