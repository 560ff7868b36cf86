"""Reading an upstream's Retry-After: delta seconds or an HTTP date, nothing else."""

from __future__ import annotations

import email.utils
import time

import httpx
import pytest

from atto_providers.base import duration_s, retry_after_s


def answer(value: str | None) -> httpx.Response:
    return httpx.Response(429, headers={} if value is None else {"Retry-After": value})


@pytest.mark.parametrize(("value", "expected"), [
    ("120", 120.0), ("1.5", 1.5), ("0", 0.0), (" 7 ", 7.0), ("1e9", 1e9),
    ("inf", None), ("-inf", None), ("nan", None), ("-3", None), ("soon", None), ("", None),
    (None, None), ("Wed, 21 Oct 2015 07:28:00 GMT", None)])
def test_retry_after_values(value: str | None, expected: float | None) -> None:
    """Finite seconds >= 0 are read as they are; anything unusable (or a past date) is None."""
    assert retry_after_s(answer(value)) == expected


def test_retry_after_http_date_in_the_future() -> None:
    """An HTTP date is read as the seconds until it."""
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    seconds = retry_after_s(answer(when))
    assert seconds is not None and 28 <= seconds <= 30


@pytest.mark.parametrize(("headers", "expected"), [
    ({"retry-after-ms": "105"}, 0.105),
    ({"retry-after-ms": "105", "retry-after": "1"}, 0.105),       # the finer one wins
    ({"retry-after-ms": "nan", "retry-after": "2"}, 2.0),          # unusable: the next one
    ({"x-ratelimit-reset-requests": "6m0s"}, 360.0),
    ({"x-ratelimit-reset-tokens": "105ms"}, 0.105),
    ({"x-ratelimit-reset-requests": "1h2m3.5s"}, 3723.5),
    ({"x-ratelimit-reset-requests": "6m0s", "x-ratelimit-reset-tokens": "20ms"}, 0.02),
    ({"x-ratelimit-reset-requests": "6m0s", "x-ratelimit-reset-tokens": "20ms",
      "x-ratelimit-remaining-requests": "0", "x-ratelimit-remaining-tokens": "900"}, 360.0),
    ({"x-ratelimit-reset-requests": "soon"}, None),
    ({"x-ratelimit-reset-requests": "5 s"}, None)])
def test_retry_after_ms_and_reset_headers(headers: dict[str, str],
                                          expected: float | None) -> None:
    """retry-after-ms, then Retry-After, then the reset of the spent limit (or the sooner)."""
    seconds = retry_after_s(httpx.Response(429, headers=headers))
    assert seconds == pytest.approx(expected) if expected is not None else seconds is None


@pytest.mark.parametrize(("text", "expected"), [
    ("0s", 0.0), ("1s", 1.0), ("1.5s", 1.5), ("105ms", 0.105), ("6m0s", 360.0),
    ("2h", 7200.0), ("10us", 1e-5), ("", None), ("6m0", None), ("-1s", None), ("1d", None)])
def test_go_durations(text: str, expected: float | None) -> None:
    """Go durations as OpenAI writes them; anything else is None."""
    assert duration_s(text) == (pytest.approx(expected) if expected is not None else None)
