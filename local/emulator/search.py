"""Web search (family ``search``): Tavily-style ``POST /tavily/search`` and Brave-style
``GET /brave/res/v1/web/search``.

Results are a function of the query. Their URLs point at the emulator's own pages
(``/pages/job/...`` for job-like queries, ``/pages/article/...`` otherwise) so that a
pipeline that searches and then fetches works offline end to end. Snippets are plain
sentences about the query's subject (``Acme Logistics company overview`` is about Acme
Logistics): when it was founded, where it is based, its size, products, funding and news,
each fact the same in every result that states it.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .dialects import ApiFault
from .gate import request_json
from .text import (
    CITIES,
    COMPANIES,
    SKILLS,
    digest,
    keywords,
    pick,
    rng_for,
    slugify,
    titlecase,
)

_SITES = ("glassdoor-like", "company-blog", "news-daily", "tech-weekly", "careers-hub",
          "wiki-like", "forum-like", "reviews-site")
_JOB_WORDS = {"job", "jobs", "hiring", "vacancy", "vacancies", "role", "roles", "career",
              "careers", "developer", "engineer", "position", "salary", "opening"}


async def tavily_auth(request: Request) -> ApiFault | None:
    """401 unless ``Authorization: Bearer <key>`` or a body ``api_key``."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return None
    try:
        body = await request_json(request)
    except ApiFault:
        body = None
    if isinstance(body, dict) and isinstance(body.get("api_key"), str) and body["api_key"]:
        return None
    return ApiFault(401, "Unauthorized: missing or invalid API key.", kind="auth")


async def brave_auth(request: Request) -> ApiFault | None:
    """Brave answers a missing or empty ``X-Subscription-Token`` with 422."""
    if request.headers.get("x-subscription-token", "").strip():
        return None
    return ApiFault(422, "The provided subscription token is invalid.", kind="auth",
                    details={"code": "SUBSCRIPTION_TOKEN_INVALID",
                             "meta": {"component": "authentication"}})


_GENERIC = {"company", "overview", "news", "review", "reviews", "about", "profile", "info",
            "information", "history", "funding", "careers", "culture", "ltd", "inc"}
_PRODUCTS = ("route-planning software", "warehouse automation", "payment services",
             "analytics tools", "delivery fleets", "cloud hosting", "patient-record systems",
             "energy-trading platforms")
_CUSTOMERS = ("retailers", "hospitals", "small businesses", "banks", "manufacturers",
              "public bodies")
_INVESTORS = ("Northgate Ventures", "Harbour Capital", "Summit Partners", "Fieldstone Fund")


ARTICLE_KINDS = ("overview", "profile", "news", "analysis")


def article_slug(subject: str, kind: str, site: str, i: int) -> str:
    """The slug of a result's article page: ``<subject>--<kind>--<site>-<i>``."""
    return f"{slugify(subject)}--{kind}--{site}-{i}"


def article_subject(slug: str) -> tuple[str, str]:
    """The subject (title case) and kind of an article page's slug."""
    subject, _, rest = slug.partition("--")
    kind = rest.partition("--")[0]
    return titlecase(subject.replace("-", " ")), kind if kind in ARTICLE_KINDS else "overview"


def subject_of(query: str) -> str:
    """What a query is about: its words without domains and generic trailing words."""
    words = [w for w in query.split() if "." not in w.strip(".")]
    while words and words[-1].lower() in _GENERIC:
        words.pop()
    return " ".join(words) or query.strip()


def subject_facts(subject: str) -> list[str]:
    """Sentences about ``subject``, the same for the same subject in every result."""
    rng = rng_for("subject", subject.lower())
    city = rng.choice(CITIES)[0]
    founded = rng.randint(1995, 2019)
    staff = rng.randrange(80, 4000, 10)
    offices = rng.randint(2, 9)
    product, customers = rng.choice(_PRODUCTS), rng.choice(_CUSTOMERS)
    raised, series = rng.randint(8, 120), rng.choice("ABC")
    investor = rng.choice(_INVESTORS)
    funded = rng.randint(max(founded + 1, 2018), 2026)
    skills = rng.sample(SKILLS[:12], 2)
    return [
        f"{subject} was founded in {founded} and is headquartered in {city}.",
        f"{subject} builds {product} for {customers}.",
        f"{subject} employs about {staff:,} people across {offices} offices.",
        f"In {funded}, {subject} raised GBP {raised} million in a Series {series} round led "
        f"by {investor}.",
        f"{subject} is hiring engineers with {skills[0]} and {skills[1]} experience in "
        f"{city}.",
        f"Customers of {subject} praise its support and its reliable service.",
    ]


def results_for(query: str, count: int, base: str, *, offset: int = 0) -> list[dict[str, Any]]:
    """``count`` deterministic results for ``query`` (title, url, snippet, score)."""
    words = keywords(query, 6)
    topic = titlecase(" ".join(words[:4])) if words else "Search"
    jobby = bool(_JOB_WORDS & set(query.lower().split()))
    out = []
    for i in range(offset, offset + count):
        rng = rng_for("result", query.lower(), i)
        site = pick(_SITES, "site", query.lower(), i)
        company = pick(COMPANIES, "company", query.lower(), i)
        if jobby:
            title = f"{topic} at {company} | {site}"
            url = f"{base}/pages/job/{slugify(f'{topic} {company}')}-{i + 1}"
        else:
            subject, kind = subject_of(query), rng.choice(ARTICLE_KINDS)
            title = f"{subject}: {kind} | {site}"
            url = f"{base}/pages/article/{article_slug(subject, kind, site, i)}"
        if jobby:
            city = pick(CITIES, "city", query.lower(), i)[0]
            snippet = (f"{company} is hiring: {topic} in {city}. Apply with experience in "
                       f"{pick(SKILLS, 'skill', query.lower(), i)}.")
        else:
            facts = subject_facts(subject_of(query))
            snippet = " ".join(facts[(i + k) % len(facts)] for k in range(2))
        out.append({"title": title, "url": url, "content": snippet,
                    "score": round(0.98 - 0.07 * i - rng.uniform(0, 0.02), 5),
                    "published_date": f"2026-0{1 + i % 9}-{10 + i % 18:02d}"})
    return out


async def tavily_search(request: Request) -> Response:
    """``POST /tavily/search``."""
    body = await request_json(request)
    if not isinstance(body, dict):
        raise ApiFault(400, "Invalid request body.")
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        raise ApiFault(400, "Query is missing.")
    max_results = body.get("max_results", 5)
    if not isinstance(max_results, int) or not 0 <= max_results <= 20:
        raise ApiFault(400, "max_results must be an integer between 0 and 20.")
    depth = body.get("search_depth", "basic")
    if depth not in ("basic", "advanced", "fast", "ultra-fast"):
        raise ApiFault(400, "Invalid search depth. Must be 'basic', 'advanced', 'fast' or "
                            "'ultra-fast'.")
    base = str(request.base_url).rstrip("/")
    results = results_for(query, max_results, base)
    include_raw = body.get("include_raw_content")
    topic = body.get("topic", "general")
    for r in results:
        r["raw_content"] = (r["content"] + " " + " ".join(subject_facts(subject_of(query)))) \
            if include_raw else None
        if topic != "news":
            r.pop("published_date")
    answer = None
    if body.get("include_answer"):
        facts = subject_facts(subject_of(query))
        answer = f"Based on {len(results)} sources: {facts[0]} {facts[2]}"
    images = [f"{base}/pages/image/{i}.png" for i in range(3)] if body.get("include_images") \
        else []
    return JSONResponse({
        "query": query,
        "follow_up_questions": None,
        "answer": answer,
        "images": images,
        "results": results,
        "response_time": 1.37 if depth == "advanced" else 0.42,
        "request_id": digest("tavily", query).hex()[:8] + "-emu",
    })


async def brave_search(request: Request) -> Response:
    """``GET /brave/res/v1/web/search?q=``."""
    q = request.query_params
    query = q.get("q", "")
    if not query.strip():
        raise ApiFault(422, "Unable to validate request parameter(s).",
                       details={"code": "VALIDATION", "meta": {"errors": [
                           {"loc": ["query", "q"], "msg": "field required",
                            "type": "value_error.missing"}]}})
    try:
        count = int(q.get("count", "20"))
        offset = int(q.get("offset", "0"))
    except ValueError as exc:
        raise ApiFault(422, "count and offset must be integers",
                       details={"code": "VALIDATION"}) from exc
    if not 1 <= count <= 20 or not 0 <= offset <= 9:
        raise ApiFault(422, "count must be within 1..20 and offset within 0..9",
                       details={"code": "VALIDATION"})
    base = str(request.base_url).rstrip("/")
    raw = results_for(query, count, base, offset=offset * count)
    results = [{"type": "search_result", "title": r["title"], "url": r["url"],
                "description": r["content"], "is_source_local": False,
                "is_source_both": False, "language": "en", "family_friendly": True,
                "age": f"{1 + i} days ago",
                "profile": {"name": r["title"].split(" | ")[-1], "url": r["url"]}}
               for i, r in enumerate(raw)]
    return JSONResponse({
        "type": "search",
        "query": {"original": query, "more_results_available": offset < 9},
        "mixed": {"type": "mixed", "main": [{"type": "web", "index": i, "all": False}
                                            for i in range(len(results))]},
        "web": {"type": "search", "results": results, "family_friendly": True},
    }, headers={"X-Request-Time": str(int(time.time()))})
