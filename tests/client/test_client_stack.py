"""The client against the local stack (``make serve``'s functions, real Redis, the emulator):
every route, the budget headers, the typed errors and the idempotent retry."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from atto_cloud_client import (
    NO_RETRY,
    AsyncAttoClient,
    AttoClient,
    BudgetExceeded,
    CompanyResearch,
    EmbeddingsResult,
    IdempotencyConflict,
    IdempotencyKeyReused,
    InvalidRequest,
    JobListing,
    MarketContext,
    PayloadTooLarge,
    RetryPolicy,
    SalaryResult,
    StructuredResult,
    Unauthorized,
    Usage,
    UsageHistory,
    UsageTotals,
)
from atto_cloud_client._core import key_of

from local.emulator import EmulatorProcess
from tests.client.conftest import Served
from tests.client.proxy import DroppingProxy

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
pytestmark = pytest.mark.slow


def usage_of(served: Served, user: str) -> Usage:
    """The user's ledger as the app reads it: GET /v1/usage, straight to the server."""
    with AttoClient(served.url, user=user) as atto:
        return atto.usage()


def call_route(atto: AttoClient, route: str, emulator: EmulatorProcess) -> Any:
    """Call one route with a valid request."""
    if route == "structured":
        return atto.structured("Summarise: senior Python engineer, Berlin", SCHEMA)
    if route == "embeddings":
        return atto.embeddings(["senior python engineer", "data analyst"], dimensions=16)
    if route == "company_research":
        return atto.company_research("Acme Robotics", website="https://acme.example")
    if route == "salary":
        return atto.salary("python developer", location="London", country="gb")
    if route == "job_extraction":
        return atto.job_extraction(url=emulator.job_page_url())
    if route == "market_context":
        return atto.market_context("data engineer", location="Berlin", country="de")
    raise AssertionError(route)


ROUTES = {
    "structured": (StructuredResult, "POST /v1/structured"),
    "embeddings": (EmbeddingsResult, "POST /v1/embeddings"),
    "company_research": (CompanyResearch, "POST /v1/company-research"),
    "salary": (SalaryResult, "GET /v1/salary"),
    "job_extraction": (JobListing, "POST /v1/job-extraction"),
    "market_context": (MarketContext, "POST /v1/market-context"),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_metered_route_returns_its_typed_result_and_headers(
        route: str, served: Served, emulator: EmulatorProcess, user: str) -> None:
    """Each route answers its typed result, charged once under the call's key, and the
    client exposes the answer's RateLimit headers as the ledger's remaining tokens."""
    result_type, route_key = ROUTES[route]
    with AttoClient(served.url, user=user) as atto:
        result = call_route(atto, route, emulator)
        prices = atto.usage().prices
    assert isinstance(result, result_type)
    assert result.info.attempts == 1 and result.info.replayed is False
    ledger = usage_of(served, user)
    (event,) = ledger.events
    assert event.request_id == result.info.request_id
    assert event.route == route_key.split()[1]  # the ledger records the path
    price = prices[route_key]  # tokens, or a size rule whose smallest charge starts it
    assert 0 < event.cost <= (price if isinstance(price, int) else int(price.split()[0]))
    hour, month = atto.rate_limit.windows
    assert (hour.name, hour.limit, hour.window_s) == ("1h", 100, 3600)
    assert (month.name, month.limit, month.window_s) == ("30d", 1000, 2592000)
    assert hour.remaining == ledger.windows[0].remaining == 100 - event.cost
    assert month.remaining == 1000 - event.cost
    assert 0 < hour.reset_s <= 3600
    # the server's RFC 3339 instants, read as Unix time: the hour's window frees an hour
    # after the charge
    assert ledger.windows[0].resets_at == pytest.approx(event.at + 3600, abs=0.002)
    assert abs(event.at - time.time()) < 120


def test_result_fields_carry_the_answers(served: Served, emulator: EmulatorProcess,
                                         user: str) -> None:
    """The typed results hold the answers' content: the schema's field, one vector per
    text of the asked length, a histogram, a trend and a listing title."""
    with AttoClient(served.url, user=user) as atto:
        structured = atto.structured("Summarise: senior Python engineer, Berlin", SCHEMA)
        vectors = atto.embeddings(["a", "b", "c"], dimensions=8)
        salary = atto.salary("python developer", location="London")
        listing = atto.job_extraction(url=emulator.job_page_url())
    assert isinstance(structured.data["title"], str)
    assert [len(v) for v in vectors.vectors] == [8, 8, 8]
    assert salary.country == "gb" and salary.currency == "GBP" and salary.histogram
    assert salary.sample_count == sum(b.count for b in salary.histogram)
    assert listing.title and listing.source_url and listing.model


def test_async_client_calls_every_route(served: Served, emulator: EmulatorProcess,
                                        user: str) -> None:
    """The async client answers every route with the same typed results, concurrently."""

    async def run() -> list[Any]:
        async with AsyncAttoClient(served.url, user=user) as atto:
            return list(await asyncio.gather(
                atto.structured("Summarise: data engineer", SCHEMA),
                atto.embeddings(["one text"]),
                atto.company_research("Acme Robotics"),
                atto.salary("nurse"),
                atto.job_extraction(text="Senior nurse, London, full time, GBP 40,000."),
                atto.usage(),
            ))

    results = asyncio.run(run())
    assert [type(r) for r in results] == [StructuredResult, EmbeddingsResult, CompanyResearch,
                                         SalaryResult, JobListing, Usage]
    assert (results[0].strict, results[0].strict_rejected) == (True, None)  # the emulator's
    ledger = usage_of(served, user)
    assert len(ledger.events) == 5
    assert {e.request_id for e in ledger.events} == {r.info.request_id for r in results[:5]}


def test_usage_history_is_typed_and_paginated(served: Served, user: str) -> None:
    """Three charges come back as three typed records, newest first, across pages of two
    (sync and async), with the day's totals on the first page only; a bad span is
    InvalidRequest."""
    with AttoClient(served.url, user=user) as atto:
        keys = [f"hist-{user}-{i}" for i in range(3)]
        for key in keys:
            atto.embeddings(["a"], idempotency_key=key)
        first = atto.usage_history(limit=2)
        assert isinstance(first, UsageHistory) and first.cursor is not None
        assert first.days is not None and first.days[0].charges == 3
        assert first.summary == UsageTotals(charges=3, reserved=3, refunds=0, refunded=0,
                                            kept=3, credit=0)
        second = atto.usage_history(cursor=first.cursor, limit=2)
        assert second.days is None and second.summary is None and second.cursor is None
        records = [*first.records, *second.records]
        assert [r.request_id for r in records] == list(reversed(keys))
        assert all(r.state == "charged" and r.kept == r.cost == 1 for r in records)
        assert [r.request_id for r in atto.iter_usage_history(limit=1)] == list(reversed(keys))
        with pytest.raises(InvalidRequest):
            atto.usage_history(since="2026-11-02T00:00:00Z", until="2026-11-01T00:00:00Z")

    async def walk() -> list[str]:
        async with AsyncAttoClient(served.url, user=user) as atto:
            return [r.request_id async for r in atto.iter_usage_history(limit=2)]

    assert asyncio.run(walk()) == list(reversed(keys))


def test_budget_exceeded_is_typed_with_its_window_and_not_retried(served: Served,
                                                                  user: str) -> None:
    """The 13th structured call of a 100/1h budget raises BudgetExceeded with Retry-After,
    limit, remaining and window, after one attempt and no sleep."""
    slept: list[float] = []
    with AttoClient(served.url, user=user, sleep=slept.append) as atto:
        for _ in range(12):
            atto.structured("x", {"type": "string"})
        with pytest.raises(BudgetExceeded) as raised:
            atto.structured("x", {"type": "string"})
        status = atto.rate_limit
    error = raised.value
    assert (error.status, error.code) == (429, "budget_exceeded")
    assert (error.limit, error.remaining, error.window_s, error.cost) == (100, 4, 3600, 8)
    assert error.window.name == "1h" and error.window.limit == 100
    assert 3500 < error.retry_after_s <= 3600
    assert error.attempts == 1 and slept == []
    assert status.window("1h").remaining == 4 and status.remaining == 4
    assert error.credit is not None and error.credit.remaining == 0  # no grant: no credit
    assert usage_of(served, user).windows[0].used == 96


def test_invalid_request_is_typed_with_details_and_free(served: Served, user: str) -> None:
    """A body the server refuses raises InvalidRequest (422) with its details, once."""
    with AttoClient(served.url, user=user) as atto, pytest.raises(InvalidRequest) as raised:
        atto.salary("nurse", country="GB")  # country codes are lower case
    assert raised.value.status == 422 and raised.value.code == "invalid_request"
    assert raised.value.details["details"] and raised.value.attempts == 1
    assert usage_of(served, user).windows[0].used == 0


def test_payload_too_large_is_typed(served: Served, user: str) -> None:
    """An embeddings batch above the body limit raises PayloadTooLarge with limit_bytes."""
    with AttoClient(served.url, user=user) as atto, pytest.raises(PayloadTooLarge) as raised:
        atto.embeddings(["x" * 20_000] * 64)  # 1.3 MB: above the template's 1 MiB cap
    assert raised.value.status == 413 and raised.value.details["limit_bytes"] > 0
    assert usage_of(served, user).windows[0].used == 0


def test_idempotency_key_reused_for_another_request_is_its_own_error(served: Served,
                                                                    user: str) -> None:
    """The caller's own key replays its first answer; used for another body it raises
    IdempotencyKeyReused (422, not retried, not an IdempotencyConflict); either way the
    user is charged once."""
    with AttoClient(served.url, user=user) as atto:
        first = atto.embeddings(["hello"], idempotency_key="app-key-1")
        again = atto.embeddings(["hello"], idempotency_key="app-key-1")
        with pytest.raises(IdempotencyKeyReused) as raised:
            atto.embeddings(["another text"], idempotency_key="app-key-1")
    assert again == first and again.info.replayed is True
    assert raised.value.status == 422 and raised.value.request_id == "app-key-1"
    assert raised.value.attempts == 1 and not isinstance(raised.value, IdempotencyConflict)
    ledger = usage_of(served, user)
    assert ledger.charged("app-key-1") == 1 and len(ledger.events) == 1


def test_the_clients_quoted_key_and_a_bare_one_are_one_key(served: Served,
                                                          user: str) -> None:
    """The client sends the IETF draft's form (an sf-string); a caller sending the same key
    bare (as curl in the README) gets the client's answer replayed: charged once, and the
    request id shown is the key unquoted."""
    with AttoClient(served.url, user=user) as atto:
        first = atto.embeddings(["hello"], idempotency_key="app-key-2")
    body = json.dumps({"input": ["hello"]}, separators=(",", ":")).encode()
    bare = httpx.post(served.url + "/v1/embeddings", content=body,
                      headers={"Idempotency-Key": "app-key-2", "X-Atto-User": user,
                               "Content-Type": "application/json"})
    assert bare.status_code == 200 and bare.headers["idempotent-replayed"] == "true"
    assert bare.headers["x-request-id"] == first.info.request_id == "app-key-2"
    assert bare.json()["data"][0]["embedding"] == list(first.vectors[0])
    assert usage_of(served, user).charged("app-key-2") == 1


def test_unauthorized_refreshes_the_token_once_then_raises(served: Served) -> None:
    """Without a user the server answers 401: the token provider is asked once more with
    force_refresh, the call repeated once, and the second 401 raised as Unauthorized."""
    asked: list[bool] = []

    def token(force_refresh: bool = False) -> str:
        asked.append(force_refresh)
        return f"token-{len(asked)}"

    with AttoClient(served.url, token_provider=token) as atto, \
            pytest.raises(Unauthorized) as raised:
        atto.usage()
    assert asked == [False, True]
    assert raised.value.status == 401 and raised.value.attempts == 2


def test_dropped_answer_is_retried_with_the_same_key_and_charged_once(
        served: Served, emulator: EmulatorProcess, user: str) -> None:
    """Through a proxy that drops the first answer, the client retries with the same
    Idempotency-Key and gets the same answer, replayed: one charge, one provider call."""
    emulator.reset()
    host, port = served.url.removeprefix("http://").split(":")
    slept: list[float] = []
    with DroppingProxy((host, int(port)), drop=1) as proxy, \
            AttoClient(proxy.url, user=user, sleep=slept.append) as atto:
        result = atto.structured("Summarise: senior Python engineer, Berlin", SCHEMA)
    first, second = proxy.exchanges
    assert first.dropped and not second.dropped
    key, again = (key_of(x.header("Idempotency-Key") or "") for x in (first, second))
    assert key and again == key == result.info.request_id
    assert first.request_body == second.request_body
    assert result.info.attempts == 2 and result.info.replayed is True and len(slept) == 1
    assert json.loads(first.response_body)["data"] == result.data  # the same answer
    ledger = usage_of(served, user)
    assert ledger.charged(key) == 8 and ledger.windows[0].used == 8 and len(ledger.events) == 1
    assert emulator.family_stats("llm")["arrivals"] == 1


def test_async_client_retries_a_dropped_answer_once_charged(served: Served,
                                                            user: str) -> None:
    """The async client too retries a dropped answer under the same key: charged once."""
    host, port = served.url.removeprefix("http://").split(":")
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def run() -> SalaryResult:
        async with AsyncAttoClient(proxy.url, user=user, sleep=sleep) as atto:
            return await atto.salary("python developer", location="London")

    with DroppingProxy((host, int(port)), drop=1) as proxy:
        result = asyncio.run(run())
    assert result.info.attempts == 2 and result.info.replayed and len(slept) == 1
    assert key_of(proxy.exchanges[0].header("Idempotency-Key") or "") == result.info.request_id
    assert usage_of(served, user).charged(result.info.request_id) == 2


def test_without_retries_a_dropped_answer_raises_and_the_key_replays_later(
        served: Served, user: str) -> None:
    """With NO_RETRY a dropped answer raises TransportError; calling again with the same
    key returns the stored answer without a second charge."""
    from atto_cloud_client import TransportError

    host, port = served.url.removeprefix("http://").split(":")
    with DroppingProxy((host, int(port)), drop=1) as proxy, \
            AttoClient(proxy.url, user=user, retry=NO_RETRY) as atto:
        with pytest.raises(TransportError):
            atto.embeddings(["hello"], idempotency_key="after-a-drop")
        again = atto.embeddings(["hello"], idempotency_key="after-a-drop")
    assert again.info.replayed is True
    assert usage_of(served, user).charged("after-a-drop") == 1


def test_total_time_bounds_the_retries(served: Served, user: str) -> None:
    """A policy whose total time cannot fit a backoff gives up after one dropped answer."""
    from atto_cloud_client import TransportError

    host, port = served.url.removeprefix("http://").split(":")
    policy = RetryPolicy(total_s=0.01, base_delay_s=1.0)
    with DroppingProxy((host, int(port)), drop=5) as proxy, \
            AttoClient(proxy.url, user=user, retry=policy, sleep=lambda s: None) as atto, \
            pytest.raises(TransportError) as raised:
        atto.usage()
    assert raised.value.attempts == 1 and len(proxy.exchanges) == 1
