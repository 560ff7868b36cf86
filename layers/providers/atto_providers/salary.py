"""Jobs-market data from Adzuna: salary histograms, vacancy counts and salary history.

Endpoints used (GET, JSON, credentials as the ``app_id`` and ``app_key`` query parameters):

- ``/v1/api/jobs/{country}/histogram``: ``{"histogram": {"<lower bound>": <vacancies>}}``;
  each key is the lower end of a salary band, the last band is open-ended and the key
  order is not guaranteed (values may be numbers or numeric strings);
- ``/v1/api/jobs/{country}/search/1``: ``{"count": <matching ads>, "mean": <mean
  advertised salary>, "results": [...]}`` (one result per page is asked for: only the
  totals are used);
- ``/v1/api/jobs/{country}/history``: ``{"month": {"YYYY-MM": <mean salary>}}``.

Settings: ``SALARY_BASE_URL`` (default ``https://api.adzuna.com``); the credentials from
``SALARY_SECRET_ARN`` (a JSON secret ``{"app_id": ..., "app_key": ...}``) or, locally,
``SALARY_APP_ID`` and ``SALARY_APP_KEY``; the shared rate from ``SALARY_RATE``,
``SALARY_BURST`` and ``SALARY_CONCURRENCY``.

Limits: Adzuna's default API access allows 25 calls a minute (and 250 a day, 1,000 a week,
2,500 a month). The default rate is 23 a minute with a burst of 2, so no 60-second
interval ever holds more than 23 + 2 = 25 calls across every instance. The day, week and
month quotas are Adzuna's to enforce: when they run out Adzuna answers 429, which pauses
every instance (``ProviderClient.request``). Deployments with a commercial agreement raise
``SALARY_RATE``.

The credentials travel in the URL, so this module installs a filter on the ``httpx``
logger that masks ``app_id`` and ``app_key`` in its request log lines.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from usage_limits.web.errors import ProviderError

from .base import ProviderClient
from .secrets import provider_secret

A = TypeVar("A")
B = TypeVar("B")

DEFAULT_BASE_URL = "https://api.adzuna.com"
SALARY_BASE_URL = "SALARY_BASE_URL"
#: Months of salary history asked for by ``trend``.
DEFAULT_HISTORY_MONTHS = 12

#: Countries Adzuna serves, with the currency of their salaries and the site to credit.
COUNTRIES: dict[str, tuple[str, str]] = {
    "at": ("EUR", "https://www.adzuna.at"),
    "au": ("AUD", "https://www.adzuna.com.au"),
    "be": ("EUR", "https://www.adzuna.be"),
    "br": ("BRL", "https://www.adzuna.com.br"),
    "ca": ("CAD", "https://www.adzuna.ca"),
    "ch": ("CHF", "https://www.adzuna.ch"),
    "de": ("EUR", "https://www.adzuna.de"),
    "es": ("EUR", "https://www.adzuna.es"),
    "fr": ("EUR", "https://www.adzuna.fr"),
    "gb": ("GBP", "https://www.adzuna.co.uk"),
    "in": ("INR", "https://www.adzuna.in"),
    "it": ("EUR", "https://www.adzuna.it"),
    "mx": ("MXN", "https://www.adzuna.com.mx"),
    "nl": ("EUR", "https://www.adzuna.nl"),
    "nz": ("NZD", "https://www.adzuna.co.nz"),
    "pl": ("PLN", "https://www.adzuna.pl"),
    "sg": ("SGD", "https://www.adzuna.sg"),
    "us": ("USD", "https://www.adzuna.com"),
    "za": ("ZAR", "https://www.adzuna.co.za"),
}
#: The same codes as a type, for request models (a unit test keeps the two in step).
Country = Literal["at", "au", "be", "br", "ca", "ch", "de", "es", "fr", "gb", "in", "it", "mx",
                  "nl", "nz", "pl", "sg", "us", "za"]
DEFAULT_COUNTRY: Country = "gb"

#: Longest job title, role or location passed to the jobs API.
MAX_QUERY_TEXT = 100
#: Query text: no control characters and at least one character that is not a space.
QUERY_TEXT_PATTERN = r"^[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"


@dataclass(frozen=True)
class Bucket:
    """One salary band of a histogram.

    Attributes:
        min: the band's lower bound.
        max: the next band's lower bound, or None for the last (open-ended) band.
        count: vacancies advertising a salary in the band.
    """

    min: float
    max: float | None
    count: int


@dataclass(frozen=True)
class Percentiles:
    """Salary percentiles interpolated from a histogram (None without salary data)."""

    p25: float | None
    median: float | None
    p75: float | None


@dataclass(frozen=True)
class Demand:
    """Totals of a job search.

    Attributes:
        open_positions: ads matching the search.
        mean_salary: Adzuna's mean advertised salary of those ads, or None.
    """

    open_positions: int
    mean_salary: float | None


@dataclass(frozen=True)
class SalaryDistribution:
    """What ``SalaryClient.distribution`` returns.

    Attributes:
        buckets: the histogram, lowest band first.
        percentiles: p25, median and p75 interpolated from ``buckets``.
        sample_count: vacancies in the histogram (those that advertise a salary).
        demand: the search totals (open positions and mean advertised salary).
        mean: Adzuna's mean advertised salary, else the histogram's, else None.
    """

    buckets: tuple[Bucket, ...]
    percentiles: Percentiles
    sample_count: int
    demand: Demand
    mean: float | None


@dataclass(frozen=True)
class MonthlySalary:
    """Mean advertised salary of one month (``month`` is ``YYYY-MM``)."""

    month: str
    mean: float


class SalaryClient(ProviderClient):
    """Adzuna's jobs API: salary histograms, search totals and monthly salary history."""

    name = "salary"
    default_rate = "23/m"
    default_burst = 2

    def __init__(self, *, env: Mapping[str, str] | None = None, redis: Any = None) -> None:
        env = os.environ if env is None else env
        super().__init__(env.get(SALARY_BASE_URL) or DEFAULT_BASE_URL, env=env, redis=redis)

    def _params(self, what: str, where: str | None, **extra: Any) -> dict[str, Any]:
        secret = provider_secret(self.name, self.env)
        app_id, app_key = secret.get("app_id"), secret.get("app_key")
        if not app_id or not app_key:
            raise ProviderError("credentials for the salary provider are not configured",
                                provider=self.name)
        params: dict[str, Any] = {"app_id": app_id, "app_key": app_key, "what": what}
        if where:
            params["where"] = where
        params.update(extra)
        return params

    async def histogram(self, country: str, what: str, where: str | None = None) -> list[Bucket]:
        """The salary histogram of ads matching ``what`` (in ``where``), lowest band first.

        Raises:
            ProviderError: the provider failed or sent an unusable histogram.
            ProviderBusy: no provider slot within the deadline.
        """
        data = await self.request("GET", f"/v1/api/jobs/{_country(country)}/histogram",
                                  params=self._params(what, where))
        return parse_histogram(data)

    async def search_totals(self, country: str, what: str, where: str | None = None) -> Demand:
        """How many ads match ``what`` (in ``where``) and their mean advertised salary.

        Raises:
            ProviderError: the provider failed or sent unusable totals.
            ProviderBusy: no provider slot within the deadline.
        """
        data = await self.request("GET", f"/v1/api/jobs/{_country(country)}/search/1",
                                  params=self._params(what, where, results_per_page=1))
        return parse_search(data)

    async def history(self, country: str, what: str, where: str | None = None, *,
                      months: int = DEFAULT_HISTORY_MONTHS) -> list[MonthlySalary]:
        """Mean advertised salary per month, oldest first (at most ``months`` of them).

        Raises:
            ProviderError: the provider failed or sent an unusable history.
            ProviderBusy: no provider slot within the deadline.
        """
        data = await self.request("GET", f"/v1/api/jobs/{_country(country)}/history",
                                  params=self._params(what, where, months=months))
        return parse_history(data)[-months:]

    async def distribution(self, country: str, what: str,
                           where: str | None = None) -> SalaryDistribution:
        """Histogram and search totals, fetched at once, with percentiles computed.

        Raises:
            ProviderError, ProviderBusy: as ``histogram`` and ``search_totals``; the first
                failure cancels the other call.
        """
        buckets, demand = await both(self.histogram(country, what, where),
                                     self.search_totals(country, what, where))
        sample = sum(b.count for b in buckets)
        mean = demand.mean_salary if demand.mean_salary is not None else histogram_mean(buckets)
        return SalaryDistribution(tuple(buckets), percentiles(buckets), sample, demand, mean)

    async def demand_and_trend(self, country: str, what: str, where: str | None = None, *,
                               months: int = DEFAULT_HISTORY_MONTHS,
                               ) -> tuple[Demand, list[MonthlySalary]]:
        """Search totals and monthly salary history, fetched at once.

        Raises:
            ProviderError, ProviderBusy: as ``search_totals`` and ``history``; the first
                failure cancels the other call.
        """
        return await both(self.search_totals(country, what, where),
                          self.history(country, what, where, months=months))


# -- parsing and statistics (pure functions) --------------------------------------------

def _country(country: str) -> str:
    if country not in COUNTRIES:  # request models validate first; this guards the URL
        raise ValueError(f"unsupported country {country!r}")
    return country


def _number(value: Any) -> float:
    """A finite number from a JSON number or numeric string (``ValueError`` otherwise)."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError("not a finite number")
    return number


def _unusable(what: str) -> ProviderError:
    return ProviderError(f"the salary provider sent an unusable {what}", provider="salary")


def parse_histogram(data: Any) -> list[Bucket]:
    """Buckets from Adzuna's ``{"histogram": {"<lower bound>": <count>}}``, lowest first.

    Each band ends where the next begins; the last is open-ended (``max`` None). Bands
    are kept even when their count is 0, so the histogram's shape is what Adzuna sent.

    Raises:
        ProviderError: the body is not such a histogram.
    """
    if not isinstance(data, dict) or "histogram" not in data:
        raise _unusable("histogram")
    raw = data["histogram"]
    if raw in (None, [], {}):
        return []  # no ad with a salary matched
    if not isinstance(raw, dict):
        raise _unusable("histogram")
    try:
        bands = sorted((_number(k), _number(v)) for k, v in raw.items())
    except (TypeError, ValueError) as exc:
        raise _unusable("histogram") from exc
    if any(count < 0 or not count.is_integer() or low < 0 for low, count in bands):
        raise _unusable("histogram")
    return [Bucket(low, bands[i + 1][0] if i + 1 < len(bands) else None, int(count))
            for i, (low, count) in enumerate(bands)]


def parse_search(data: Any) -> Demand:
    """``Demand`` from a search body's ``count`` and ``mean``.

    Raises:
        ProviderError: ``count`` is missing or not a non-negative whole number.
    """
    if not isinstance(data, dict) or "count" not in data:
        raise _unusable("search result")
    try:
        count = _number(data["count"])
        mean = data.get("mean")
        mean_salary = None if mean is None else _number(mean)
    except (TypeError, ValueError) as exc:
        raise _unusable("search result") from exc
    if count < 0 or not count.is_integer():
        raise _unusable("search result")
    if mean_salary is not None and mean_salary <= 0:
        mean_salary = None  # Adzuna reports 0 when no matching ad has a salary
    return Demand(int(count), mean_salary)


_MONTH = re.compile(r"^(\d{4})-(\d{2})$")


def parse_history(data: Any) -> list[MonthlySalary]:
    """Monthly means from ``{"month": {"YYYY-MM": <mean>}}``, oldest first.

    Raises:
        ProviderError: the body is not such a history.
    """
    if not isinstance(data, dict) or "month" not in data:
        raise _unusable("salary history")
    raw = data["month"]
    if raw in (None, [], {}):
        return []
    if not isinstance(raw, dict):
        raise _unusable("salary history")
    points = []
    try:
        for month, value in raw.items():
            match = _MONTH.match(str(month))
            if not match or not 1 <= int(match[2]) <= 12:
                raise ValueError(f"not a month: {month!r}")
            mean = _number(value)
            if mean < 0:
                raise ValueError("negative salary")
            points.append(MonthlySalary(str(month), round(mean, 2)))
    except (TypeError, ValueError) as exc:
        raise _unusable("salary history") from exc
    return sorted(points, key=lambda p: p.month)


def _widths(buckets: Sequence[Bucket]) -> list[float]:
    """Each band's width; the open-ended last band is as wide as the one before it."""
    widths = [b.max - b.min for b in buckets if b.max is not None]
    if buckets:
        widths.append(widths[-1] if widths else 0.0)
    return widths


def percentile(buckets: Sequence[Bucket], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram, interpolated linearly within its band.

    Values are assumed spread evenly across each band; the open-ended last band is taken
    to be as wide as the band before it (a lone band has width 0). None when the
    histogram holds no vacancies.

    Raises:
        ValueError: ``q`` is outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], got {q!r}")
    total = sum(b.count for b in buckets)
    if total == 0:
        return None
    target = q * total
    below = 0
    for bucket, width in zip(buckets, _widths(buckets), strict=True):
        if bucket.count == 0:
            continue
        if below + bucket.count >= target:
            fraction = max(0.0, target - below) / bucket.count
            return round(bucket.min + fraction * width, 2)
        below += bucket.count
    raise AssertionError("unreachable: the target never exceeds the total")  # pragma: no cover


def percentiles(buckets: Sequence[Bucket]) -> Percentiles:
    """p25, median and p75 of a histogram (see ``percentile``)."""
    return Percentiles(percentile(buckets, 0.25), percentile(buckets, 0.5),
                       percentile(buckets, 0.75))


def histogram_mean(buckets: Sequence[Bucket]) -> float | None:
    """The mean of a histogram taking each band's midpoint, or None when it is empty."""
    total = sum(b.count for b in buckets)
    if total == 0:
        return None
    weighted = sum(b.count * (b.min + w / 2) for b, w in zip(buckets, _widths(buckets),
                                                            strict=True))
    return round(weighted / total, 2)


async def both(first: Awaitable[A], second: Awaitable[B]) -> tuple[A, B]:
    """Await two calls at once; the first failure cancels the other and is raised as is.

    Unlike ``asyncio.gather`` no call is left running after a failure (a Lambda must not
    keep spending on a request that has already failed), and unlike a bare ``TaskGroup``
    the caller gets the original exception, which the web layer maps to its status.
    """
    try:
        async with asyncio.TaskGroup() as group:
            a = group.create_task(_run(first))
            b = group.create_task(_run(second))
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return a.result(), b.result()


async def _run(awaitable: Awaitable[A]) -> A:
    return await awaitable


# -- keep credentials out of the logs ----------------------------------------------------

_CREDENTIAL = re.compile(r"((?:^|[?&])(?:app_id|app_key)=)[^&#\s\"']*")


class _MaskCredentials(logging.Filter):
    """Masks ``app_id``/``app_key`` values in the arguments of ``httpx`` log records."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(_mask(arg) for arg in record.args)
        if isinstance(record.msg, str) and "app_key=" in record.msg:
            record.msg = _CREDENTIAL.sub(r"\1***", record.msg)
        return True


def _mask(value: Any) -> Any:
    text = str(value) if type(value).__name__ == "URL" or isinstance(value, str) else None
    if text is not None and ("app_key=" in text or "app_id=" in text):
        return _CREDENTIAL.sub(r"\1***", text)
    return value


def _install_log_filter() -> None:
    logger = logging.getLogger("httpx")
    if not any(isinstance(f, _MaskCredentials) for f in logger.filters):
        logger.addFilter(_MaskCredentials())


_install_log_filter()

_client: SalaryClient | None = None


def salary_client() -> SalaryClient:
    """The process's salary client (settings read once)."""
    global _client
    if _client is None:
        _client = SalaryClient()
    return _client
