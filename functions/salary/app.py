"""GET /v1/salary: the advertised salary distribution for a job title and place (2 tokens)."""

from __future__ import annotations

import usage_limits.coldstart  # noqa: F401  (first: no GC while loading; see its docstring)

# isort: split
from typing import Annotated

from fastapi import Depends, Query
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.json_schema import SkipJsonSchema

from atto_providers.salary import (
    COUNTRIES,
    DEFAULT_COUNTRY,
    MAX_QUERY_TEXT,
    QUERY_TEXT_PATTERN,
    Country,
    salary_client,
)
from usage_limits.web import METERED_RESPONSES, create_app, lambda_handler, require_tokens

app = create_app("Atto Cloud: salary")

QueryText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUERY_TEXT,
                                             pattern=QUERY_TEXT_PATTERN)]


class SalaryQuery(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    title: QueryText = Field(description="Job title or keywords, e.g. `data engineer`.")
    location: QueryText | SkipJsonSchema[None] = Field(
        default=None, description="Town, city or region; the whole country if omitted.")
    country: Country = Field(default=DEFAULT_COUNTRY,
                             description="Adzuna country code (ISO 3166-1 alpha-2, lower case).")


class SalaryBand(BaseModel):
    min: float = Field(description="Lower bound of the band.")
    max: float | None = Field(description="Upper bound (the next band's lower bound); null "
                                          "for the open-ended last band.")
    count: int = Field(ge=0, description="Vacancies advertising a salary in the band.")


class SalaryPercentiles(BaseModel):
    """Interpolated from the histogram; null when no vacancy advertises a salary."""

    p25: float | None
    median: float | None
    p75: float | None


class DataSource(BaseModel):
    name: str
    url: str


class SalaryOut(BaseModel):
    title: str
    location: str | None
    country: Country
    currency: str = Field(description="ISO 4217 code of every amount.")
    histogram: list[SalaryBand] = Field(description="Salary bands, lowest first.")
    percentiles: SalaryPercentiles
    mean: float | None = Field(description="Mean advertised salary; null without data.")
    sample_count: int = Field(ge=0, description="Vacancies in the histogram (those that "
                                                "advertise a salary).")
    open_positions: int = Field(ge=0, description="Vacancies matching the search, with or "
                                                  "without a salary.")
    source: DataSource


@app.get("/v1/salary", dependencies=[Depends(require_tokens(cost=2))],
         responses=METERED_RESPONSES)
async def salary(query: Annotated[SalaryQuery, Query()]) -> SalaryOut:
    """Histogram, percentiles and mean of advertised salaries for ``title`` in ``location``."""
    title = query.title.strip()
    location = query.location.strip() if query.location else None
    dist = await salary_client().distribution(query.country, title, location)
    currency, site = COUNTRIES[query.country]
    return SalaryOut(
        title=title, location=location, country=query.country, currency=currency,
        histogram=[SalaryBand(min=b.min, max=b.max, count=b.count) for b in dist.buckets],
        percentiles=SalaryPercentiles(p25=dist.percentiles.p25, median=dist.percentiles.median,
                                      p75=dist.percentiles.p75),
        mean=dist.mean, sample_count=dist.sample_count,
        open_positions=dist.demand.open_positions,
        source=DataSource(name="Adzuna", url=site),
    )


handler = lambda_handler(app)
