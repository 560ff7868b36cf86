"""The salary client's parsing, statistics and credential handling, without network."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, get_args

import httpx
import pytest

from atto_providers.salary import (
    COUNTRIES,
    Bucket,
    Country,
    SalaryClient,
    both,
    histogram_mean,
    parse_histogram,
    parse_history,
    parse_search,
    percentile,
    percentiles,
)
from usage_limits.web.errors import ProviderError


def test_country_type_matches_the_country_table() -> None:
    """The request models' country codes are exactly the ones with a currency and site."""
    assert set(get_args(Country)) == set(COUNTRIES)


def test_histogram_is_sorted_and_bands_end_where_the_next_begins() -> None:
    """Unordered keys and string counts become ascending bands; the last is open-ended."""
    buckets = parse_histogram({"histogram": {"30000": "5", "10000": 1, "20000": "4"}})
    assert buckets == [Bucket(10000, 20000, 1), Bucket(20000, 30000, 4), Bucket(30000, None, 5)]


@pytest.mark.parametrize("body", [{"histogram": {}}, {"histogram": None}, {"histogram": []}])
def test_empty_histogram_is_no_data(body: dict[str, Any]) -> None:
    """A query no salaried ad matches gives an empty histogram, not an error."""
    assert parse_histogram(body) == []


@pytest.mark.parametrize("body", [None, [], {}, {"histogram": "x"},
                                  {"histogram": {"abc": 1}}, {"histogram": {"1000": -1}},
                                  {"histogram": {"1000": 1.5}}, {"histogram": {"1000": True}},
                                  {"histogram": {"nan": 1}}])
def test_malformed_histogram_is_a_provider_error(body: Any) -> None:
    """Anything that is not a histogram of whole counts is the provider's fault (502)."""
    with pytest.raises(ProviderError):
        parse_histogram(body)


def test_percentiles_interpolate_within_bands() -> None:
    """With 100 vacancies in four equal bands, quartiles land on exact band positions."""
    buckets = parse_histogram({"histogram": {"10000": 25, "20000": 25, "30000": 25,
                                             "40000": 25}})
    assert percentile(buckets, 0.25) == 20000
    assert percentile(buckets, 0.5) == 30000
    assert percentile(buckets, 0.75) == 40000
    assert percentile(buckets, 0.1) == 14000
    assert percentile(buckets, 1.0) == 50000  # the open band is as wide as the one before


def test_percentiles_skip_empty_bands_and_stay_ordered() -> None:
    """Zero-count bands never hold a percentile, and p25 <= median <= p75."""
    buckets = parse_histogram({"histogram": {"10000": 0, "20000": 10, "30000": 0,
                                             "40000": 30}})
    p = percentiles(buckets)
    assert p.p25 is not None and p.median is not None and p.p75 is not None
    assert 20000 <= p.p25 <= p.median <= p.p75 <= 50000
    assert p.median >= 40000  # half of 40 vacancies lies beyond the first 10


def test_percentiles_of_nothing_are_none() -> None:
    """No vacancies, no percentiles and no mean."""
    assert percentiles([]) == percentiles([Bucket(10000, None, 0)])
    assert percentiles([]).median is None
    assert histogram_mean([]) is None


def test_single_band_has_width_zero() -> None:
    """A lone open-ended band puts every percentile at its lower bound."""
    assert percentiles([Bucket(30000, None, 7)]).p75 == 30000


def test_percentile_rejects_q_outside_unit_interval() -> None:
    """q must lie within [0, 1]."""
    with pytest.raises(ValueError):
        percentile([Bucket(1, None, 1)], 1.5)


def test_histogram_mean_uses_band_midpoints() -> None:
    """The histogram's mean weights each band's midpoint by its count."""
    assert histogram_mean([Bucket(10000, 20000, 1), Bucket(20000, None, 1)]) == 20000


def test_search_totals_parse_count_and_mean() -> None:
    """count and mean come through; a mean of 0 means no salary data."""
    assert parse_search({"count": 120, "mean": 45123.4}).mean_salary == 45123.4
    empty = parse_search({"count": 0, "mean": 0})
    assert empty.open_positions == 0 and empty.mean_salary is None


@pytest.mark.parametrize("body", [{}, {"count": -1}, {"count": "x"}, {"count": 1.5}, [],
                                  {"count": 3, "mean": "abc"}])
def test_malformed_search_is_a_provider_error(body: Any) -> None:
    """A search body without a usable count is the provider's fault."""
    with pytest.raises(ProviderError):
        parse_search(body)


def test_history_is_sorted_by_month() -> None:
    """Months come back oldest first whatever the key order."""
    points = parse_history({"month": {"2025-03": 3, "2024-12": 1, "2025-01": "2"}})
    assert [(p.month, p.mean) for p in points] == [("2024-12", 1), ("2025-01", 2),
                                                    ("2025-03", 3)]
    assert parse_history({"month": {}}) == []


@pytest.mark.parametrize("body", [{}, {"month": "x"}, {"month": {"2025-13": 1}},
                                  {"month": {"March": 1}}, {"month": {"2025-01": -5}}])
def test_malformed_history_is_a_provider_error(body: Any) -> None:
    """A history that is not month -> mean is the provider's fault."""
    with pytest.raises(ProviderError):
        parse_history(body)


async def test_missing_credentials_fail_before_any_call() -> None:
    """Without app_id and app_key the client raises provider_error and calls nothing."""
    client = SalaryClient(env={"SALARY_BASE_URL": "http://127.0.0.1:9"})
    with pytest.raises(ProviderError) as info:
        await client.search_totals("gb", "nurse")
    assert "not configured" in info.value.message


def test_credentials_are_masked_in_httpx_logs(caplog: pytest.LogCaptureFixture) -> None:
    """The httpx request log line never shows app_id or app_key."""
    url = httpx.URL("https://api.adzuna.com/v1/api/jobs/gb/histogram",
                    params={"app_id": "id-123", "app_key": "secret-456", "what": "nurse"})
    with caplog.at_level(logging.INFO, logger="httpx"):
        logging.getLogger("httpx").info('HTTP Request: %s %s "%s %d %s"', "GET", url,
                                        "HTTP/1.1", 200, "OK")
    text = caplog.text
    assert "secret-456" not in text and "id-123" not in text
    assert "app_key=***" in text and "what=nurse" in text


async def test_both_cancels_the_other_call_and_raises_the_original() -> None:
    """When one call fails the other is cancelled and the caller sees the original error."""
    cancelled = asyncio.Event()

    async def slow() -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1

    async def fails() -> int:
        raise ProviderError("boom", provider="salary")

    with pytest.raises(ProviderError):
        await both(slow(), fails())
    assert cancelled.is_set()
    assert await both(asyncio.sleep(0, "a"), asyncio.sleep(0, "b")) == ("a", "b")
