"""Reading an upstream's Retry-After: delta seconds or an HTTP date, nothing else."""

from __future__ import annotations

import email.utils
import time

import httpx
import pytest

from atto_providers.base import retry_after_s


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
