"""The README's example requests, through the real handlers and the offline emulator, give
answers that repeat the facts of the request: the title, place, salary and currency pasted,
the numbered sources given, the market figures fetched."""

from __future__ import annotations

import importlib
import re
import uuid
from typing import TYPE_CHECKING, Any

import pytest

from local.emulator import EmulatorProcess
from local.lambda_events import Result, http_event, invoke
from local.redis_servers import RedisServer

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment


@pytest.fixture
def env(lambda_env: StartEnvironment, redis_server: RedisServer,
        emulator: EmulatorProcess) -> EmulatorProcess:
    """Local mode as under make serve: every provider is the emulator, a roomy plan."""
    emulator.reset()
    lambda_env({
        "REDIS_URL": redis_server.url, "ATTO_BUDGET": "1000/1h", "ATTO_ENV": "local",
        "PAGES_ALLOW_PRIVATE_HOSTS": "127.0.0.1",
        "LLM_BASE_URL": emulator.openai_base_url, "LLM_API_KEY": "k",
        "SEARCH_BASE_URL": emulator.tavily_base_url, "SEARCH_API_KEY": "k",
        "SALARY_BASE_URL": emulator.adzuna_base_url, "SALARY_APP_ID": "a",
        "SALARY_APP_KEY": "k", "LLM_RATE": "1000/s", "SEARCH_RATE": "1000/s",
        "SALARY_RATE": "1000/s", "PAGES_RATE": "1000/s",
    }, unset=("LLM_SECRET_ARN", "SEARCH_SECRET_ARN", "SALARY_SECRET_ARN",
              "ATTO_MAX_BODY_BYTES"))
    return emulator


def call(function: str, method: str, path: str, *, body: Any = None,
         query: dict[str, str] | None = None) -> Result:
    handler = importlib.import_module(f"functions.{function}.app").handler
    res = invoke(handler, http_event(method, path, body=body, query=query,
                                     user=uuid.uuid4().hex))
    assert res.status == 200, res.body
    return res


def test_quick_start_summary_names_the_role(env: EmulatorProcess) -> None:
    """The quick start's structured call answers the role it was asked to summarise."""
    res = call("structured", "POST", "/v1/structured", body={
        "prompt": "Summarise: senior Python engineer, Berlin",
        "schema": {"type": "object", "properties": {"title": {"type": "string"}},
                   "required": ["title"]}})
    assert res.body["data"] == {"title": "Senior Python Engineer"}


def test_pasted_listing_comes_back_with_its_own_facts(env: EmulatorProcess) -> None:
    """Pasted 'Data Engineer ... EUR 70,000 - 85,000 a year' is read back as stated."""
    res = call("job_extraction", "POST", "/v1/job-extraction", body={
        "html": "<h1>Data Engineer</h1><p>Acme Ltd, Berlin (hybrid). EUR 70,000 - 85,000 a "
                "year. Python, SQL.</p>"})
    listing = res.body
    assert listing["title"] == "Data Engineer"
    assert listing["company"] == "Acme Ltd"
    assert listing["location"] == "Berlin"
    assert listing["salary"] == {"min": 70000.0, "max": 85000.0, "currency": "EUR",
                                 "period": "year"}
    assert listing["skills"] == ["Python", "SQL"]
    assert listing["remote"] is True
    assert listing["employment_type"] is None  # the listing does not say
    summary = listing["description_summary"]
    for fact in ("Data Engineer", "Acme Ltd", "Berlin", "hybrid", "EUR 70,000", "85,000",
                 "Python", "SQL"):
        assert fact in summary, (fact, summary)


def test_fetched_job_page_summary_repeats_the_page(env: EmulatorProcess) -> None:
    """The README's job page gives a summary naming its title, employer and salary, and its
    remote policy as the page states it."""
    from local.emulator.pages import job_posting

    slug = "senior-python-developer-london"
    res = call("job_extraction", "POST", "/v1/job-extraction", body={"url": env.job_page_url(slug)})
    listing = res.body
    assert listing["remote"] is job_posting(slug)["remote"]
    assert listing["title"] == "Senior Python Developer" and listing["structured_data"]
    salary = listing["salary"]
    summary = listing["description_summary"]
    assert listing["title"] in summary and listing["company"] in summary
    assert f"{salary['currency']} {salary['min']:,.0f}" in summary
    assert all(skill in summary for skill in listing["skills"][:3])


def test_company_brief_cites_its_numbered_sources(env: EmulatorProcess) -> None:
    """The company brief's sentences cite the sources by [n], and its facts come from them."""
    res = call("company_research", "POST", "/v1/company-research",
               body={"company": "Acme Logistics", "website": "https://acme.example"})
    brief = res.body
    sources = [s["url"] for s in brief["sources"]]
    cited = [int(n) for n in re.findall(r"\[(\d+)\]", brief["summary"])]
    assert len(set(cited)) >= 3 and all(1 <= n <= len(sources) for n in cited)
    sentences = re.split(r"(?<=\])\. ?", brief["summary"])
    assert all("Acme Logistics" in s for s in sentences if s)
    assert brief["key_facts"] and all("Acme Logistics" in f["fact"] and f["source_url"]
                                      in sources for f in brief["key_facts"])
    founded = re.search(r"founded in (\d{4})", brief["summary"])
    assert founded and all(founded.group(1) in f["fact"] for f in brief["key_facts"]
                           if "founded" in f["fact"])


def test_a_cited_source_page_states_the_fact_cited(env: EmulatorProcess) -> None:
    """Opening a source of the brief shows the very fact the brief cites it for."""
    import html

    import httpx

    res = call("company_research", "POST", "/v1/company-research",
               body={"company": "Acme Logistics"})
    for fact in res.body["key_facts"][:3]:
        page = html.unescape(httpx.get(fact["source_url"], timeout=10).text)
        assert fact["fact"] in page, (fact, page[:400])


def test_market_narrative_is_written_from_its_figures(env: EmulatorProcess) -> None:
    """The market narrative states the open positions, mean salary and trend it was given."""
    res = call("market_context", "POST", "/v1/market-context",
               body={"role": "data engineer", "location": "Berlin", "country": "de"})
    market = res.body
    narrative = market["narrative"]
    demand, trend = market["demand"], market["salary_trend"]
    assert f"{demand['open_positions']:,} open data engineer positions in Berlin" in narrative
    assert f"{market['currency']} {round(demand['mean_salary'], -2):,.0f}" in narrative
    assert trend[0]["month"] in narrative and trend[-1]["month"] in narrative
    change = demand["salary_change_pct"]
    assert f"{'up' if change > 0 else 'down'} {abs(change):g}%" in narrative
    assert 2 <= len(re.findall(r"[.!?](?: |$)", narrative)) <= 4


def test_salary_example_is_for_the_place_asked(env: EmulatorProcess) -> None:
    """The README's salary query answers in pounds for London, percentiles in order."""
    res = call("salary", "GET", "/v1/salary",
               query={"title": "python developer", "location": "London", "country": "gb"})
    dist = res.body
    assert (dist["title"], dist["location"], dist["currency"]) == (
        "python developer", "London", "GBP")
    p = dist["percentiles"]
    assert 10_000 < p["p25"] < p["median"] < p["p75"] < 200_000
