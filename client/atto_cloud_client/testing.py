"""Test your app's use of Atto Cloud without a server: ``MockApi`` over ``httpx.MockTransport``.

``MockApi`` answers every route with a plausible example body, meters a token budget
(``RateLimit`` headers, 429 ``budget_exceeded`` with ``Retry-After``), replays a repeated
``Idempotency-Key`` with ``Idempotent-Replayed: true`` without charging again, and lets a
test queue any answer or connection error for a route::

    from atto_cloud_client import AttoClient, ProviderBusy
    from atto_cloud_client.testing import MockApi, error

    api = MockApi()
    api.queue("POST /v1/structured", error(503, "provider_busy", "busy", retry_after_s=1))
    slept = []
    client = AttoClient(transport=api.transport, user="alice", sleep=slept.append)
    result = client.structured("Summarise: Python engineer", {"type": "object"})
    assert slept and slept[0] >= 1 and api.charged == 8   # retried once, charged once

Everything here is test support: it is not the server's behaviour in every detail (the
server's own tests cover that).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from ._core import key_of

#: Tokens per route, as the server's price list.
PRICES: dict[str, int] = {
    "POST /v1/embeddings": 1,
    "GET /v1/salary": 2,
    "POST /v1/structured": 8,
    "POST /v1/job-extraction": 10,
    "POST /v1/company-research": 20,
    "POST /v1/market-context": 30,
}
FREE_ROUTES = ("GET /v1/usage",)

Handler = Callable[[httpx.Request], httpx.Response]
Queued = httpx.Response | Exception | Handler


def error(status: int, code: str, message: str = "", *, retry_after_s: float | None = None,
          headers: dict[str, str] | None = None, **details: Any) -> httpx.Response:
    """An error answer in the contract's shape, with ``Retry-After`` when given.

    Args:
        status: the HTTP status.
        code: the error code (``budget_exceeded``, ``provider_busy``, ...).
        message: the message.
        retry_after_s: also sets the ``Retry-After`` header (whole seconds, rounded up).
        headers: more headers.
        **details: more fields of the error object (``limit``, ``remaining``, ...).

    Returns:
        The response, ready to queue.
    """
    body: dict[str, Any] = {"code": code, "message": message or code, **details}
    all_headers = dict(headers or {})
    if retry_after_s is not None:
        body.setdefault("retry_after_s", retry_after_s)
        all_headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return httpx.Response(status, json={"error": body}, headers=all_headers)


def ratelimit_headers(windows: Iterable[tuple[str, int, int, int, int]]) -> dict[str, str]:
    """The two budget headers for rows of ``(name, limit, window_s, remaining, reset_s)``."""
    windows = list(windows)
    return {
        "RateLimit-Policy": ", ".join(f'"{n}";q={q};w={w}' for n, q, w, _, _ in windows),
        "RateLimit": ", ".join(f'"{n}";r={r};t={t}' for n, _, _, r, t in windows),
    }


@dataclass(frozen=True)
class Charge:
    """A charge the mock recorded: the key, tokens, path (as the server's ledger) and time."""

    key: str
    cost: int
    route: str
    at: float


class MockApi:
    """An in-memory Atto Cloud for tests, behind ``httpx.MockTransport``.

    Args:
        windows: the budget as ``(limit, window_s)`` pairs (default 100 tokens per hour).
        user_id: the ``user_id`` that ``GET /v1/usage`` reports.
        clock: Unix time, injectable.

    Attributes:
        requests: every request received, in order (retries included).
        charges: every charge made (one per key).
    """

    def __init__(self, *, windows: Iterable[tuple[int, int]] = ((100, 3600),),
                 user_id: str = "local-user", clock: Callable[[], float] = time.time) -> None:
        self.windows = tuple(windows)
        self.user_id = user_id
        self.clock = clock
        self.requests: list[httpx.Request] = []
        self.charges: list[Charge] = []
        self._queued: dict[str, list[Queued]] = {}
        self._stored: dict[str, tuple[str, bytes, httpx.Response]] = {}

    @property
    def transport(self) -> httpx.MockTransport:
        """A transport for ``AttoClient`` or ``AsyncAttoClient`` (``transport=``)."""
        return httpx.MockTransport(self.handle)

    @property
    def charged(self) -> int:
        """Tokens charged so far."""
        return sum(c.cost for c in self.charges)

    def queue(self, route: str, *answers: Queued) -> None:
        """Answer the next requests to ``route`` (``"POST /v1/structured"``) with ``answers``:
        a response, an exception to raise (``httpx.ConnectError("...")``), or a function
        of the request. When the queue is empty the route behaves normally again."""
        self._queued.setdefault(route, []).extend(answers)

    def handle(self, request: httpx.Request) -> httpx.Response:
        """Answer one request (the MockTransport handler)."""
        self.requests.append(request)
        route = f"{request.method} {request.url.path}"
        queued = self._queued.get(route)
        if queued:
            answer = queued.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer(request) if callable(answer) else answer
        if route not in PRICES and route not in FREE_ROUTES:
            return error(404, "not_found", f"no route for {route}")
        field = request.headers.get("idempotency-key")
        key = None if field is None else key_of(field)
        fingerprint = request.url.query + request.content
        if key is not None and key in self._stored:
            stored_route, stored_print, stored = self._stored[key]
            if (stored_route, stored_print) != (route, fingerprint):
                return error(422, "idempotency_key_reused",
                             "the Idempotency-Key was used for another request")
            return httpx.Response(stored.status_code, content=stored.content,
                                  headers={**stored.headers, "Idempotent-Replayed": "true"})
        if route in FREE_ROUTES:
            return httpx.Response(200, json=self._usage())
        cost = PRICES[route]
        now = self.clock()
        for limit, window_s in self.windows:
            spent = self._spent(now, window_s)
            if spent + cost > limit:
                wait = self._wait(now, window_s, limit, cost)
                return error(429, "budget_exceeded",
                             f"token budget exceeded: this request costs {cost} tokens",
                             retry_after_s=wait, limit=limit, remaining=limit - spent,
                             window_s=window_s, cost=cost, headers=self._headers(now))
        self.charges.append(Charge(key or f"anon-{len(self.charges)}", cost,
                                   request.url.path, now))
        response = httpx.Response(200, json=EXAMPLES[route](request),
                                  headers=self._headers(now))
        if key is not None:
            self._stored[key] = (route, fingerprint, response)
        return response

    # --- budget -----------------------------------------------------------------------------

    def _in_window(self, now: float, window_s: int) -> list[Charge]:
        return [c for c in self.charges if c.at > now - window_s]

    def _spent(self, now: float, window_s: int) -> int:
        return sum(c.cost for c in self._in_window(now, window_s))

    def _wait(self, now: float, window_s: int, limit: int, cost: int) -> float:
        spent = self._spent(now, window_s)
        for charge in self._in_window(now, window_s):  # oldest first
            spent -= charge.cost
            if spent + cost <= limit:
                return max(0.001, charge.at + window_s - now)
        return float(window_s)

    def _headers(self, now: float) -> dict[str, str]:
        rows = []
        for limit, window_s in self.windows:
            charges = self._in_window(now, window_s)
            reset = round(charges[0].at + window_s - now) if charges else 0
            rows.append((_label(window_s), limit, window_s,
                         max(0, limit - self._spent(now, window_s)), max(0, reset)))
        return ratelimit_headers(rows)

    def _usage(self) -> dict[str, Any]:
        now = self.clock()
        windows = []
        for limit, window_s in self.windows:
            charges = self._in_window(now, window_s)
            used = sum(c.cost for c in charges)
            windows.append({"limit": limit, "used": used, "remaining": max(0, limit - used),
                            "window_s": window_s,
                            "resets_at": _rfc3339(charges[0].at + window_s) if charges
                            else None})
        return {"user_id": self.user_id, "windows": windows,
                "events": [{"request_id": c.key, "cost": c.cost, "route": c.route,
                            "at": _rfc3339(c.at)} for c in reversed(self.charges)],
                "prices": dict(PRICES)}


def _rfc3339(unix_s: float) -> str:
    """Unix time as the server writes an instant: RFC 3339 UTC, milliseconds, ``Z``."""
    moment = datetime.fromtimestamp(unix_s, tz=UTC).isoformat(timespec="milliseconds")
    return moment.replace("+00:00", "Z")


def _label(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _body(request: httpx.Request) -> dict[str, Any]:
    try:
        value = json.loads(request.content or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _structured(request: httpx.Request) -> dict[str, Any]:
    return {"data": {}, "model": "mock-model", "usage": {"prompt_tokens": 10,
                                                         "completion_tokens": 2}}


def _embeddings(request: httpx.Request) -> dict[str, Any]:
    texts = _body(request).get("input") or [""]
    size = _body(request).get("dimensions") or 8
    return {"data": [{"index": i, "embedding": [round(0.01 * (i + 1), 4)] * size}
                     for i in range(len(texts))],
            "model": "mock-embedding", "usage": {"prompt_tokens": 2 * len(texts)}}


def _company(request: httpx.Request) -> dict[str, Any]:
    company = _body(request).get("company", "Example Ltd")
    url = "https://example.com/about"
    return {"company": company, "summary": f"{company} makes example products [1].",
            "key_facts": [{"fact": "Founded in 2001.", "source_url": url}],
            "sources": [{"title": f"About {company}", "url": url}], "model": "mock-model"}


def _salary(request: httpx.Request) -> dict[str, Any]:
    q = request.url.params
    return {"title": q.get("title", ""), "location": q.get("location"),
            "country": q.get("country", "gb"), "currency": "GBP",
            "histogram": [{"min": 40000.0, "max": 60000.0, "count": 6},
                          {"min": 60000.0, "max": None, "count": 4}],
            "percentiles": {"p25": 48000.0, "median": 56000.0, "p75": 65000.0},
            "mean": 57000.0, "sample_count": 10, "open_positions": 12,
            "source": {"name": "Adzuna", "url": "https://www.adzuna.co.uk"}}


def _job(request: httpx.Request) -> dict[str, Any]:
    body = _body(request)
    return {"title": "Senior Python Developer", "company": "Example Ltd", "location": "London",
            "salary": {"min": 70000.0, "max": 85000.0, "currency": "GBP", "period": "year"},
            "employment_type": "full_time", "remote": False, "skills": ["Python"],
            "description_summary": "Build example services.",
            "source_url": body.get("url") or body.get("source_url"), "structured_data": False,
            "model": "mock-model"}


def _market(request: httpx.Request) -> dict[str, Any]:
    body = _body(request)
    return {"role": body.get("role", ""), "location": body.get("location"),
            "country": body.get("country", "gb"), "currency": "GBP",
            "demand": {"open_positions": 120, "mean_salary": 52000.0, "salary_change_pct": 1.5},
            "salary_trend": [{"month": "2026-01", "mean": 51000.0},
                             {"month": "2026-02", "mean": 51765.0}],
            "narrative": "Demand is steady. Salaries rose slightly.",
            "sources": [{"name": "Adzuna", "url": "https://www.adzuna.co.uk",
                         "used_for": "open positions, mean and monthly advertised salaries"},
                        {"name": "mock-model", "url": None, "used_for": "narrative"}]}


#: The example answer of every metered route.
EXAMPLES: dict[str, Callable[[httpx.Request], dict[str, Any]]] = {
    "POST /v1/structured": _structured,
    "POST /v1/embeddings": _embeddings,
    "POST /v1/company-research": _company,
    "GET /v1/salary": _salary,
    "POST /v1/job-extraction": _job,
    "POST /v1/market-context": _market,
}
