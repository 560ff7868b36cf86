"""Adzuna-style jobs and salary API (family ``salary``), mounted under ``/adzuna``.

- ``GET /adzuna/v1/api/jobs/{country}/search/{page}``: job adverts and their mean salary;
- ``GET /adzuna/v1/api/jobs/{country}/histogram``: salary distribution, 10k buckets;
- ``GET /adzuna/v1/api/jobs/{country}/history``: mean advertised salary per month.

Every answer is a function of the query (``what``, ``where``, country, page): the same
query gives the same numbers. ``app_id`` and ``app_key`` are required (401 AUTH_FAIL).
A ``what`` containing the word ``nojobs`` has no adverts, for empty-state tests.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, date, datetime, timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .dialects import ApiFault
from .text import CITIES, COMPANIES, SKILLS, TITLES, pick, rng_for, slugify, stable_int, titlecase

COUNTRIES = {
    "gb": ("GBP", 1.0, "UK"), "us": ("USD", 1.3, "US"), "at": ("EUR", 1.05, "Österreich"),
    "au": ("AUD", 1.8, "Australia"), "be": ("EUR", 1.05, "België"), "br": ("BRL", 2.2, "Brasil"),
    "ca": ("CAD", 1.6, "Canada"), "ch": ("CHF", 1.6, "Schweiz"), "de": ("EUR", 1.1, "Deutschland"),
    "es": ("EUR", 0.75, "España"), "fr": ("EUR", 0.95, "France"), "in": ("INR", 25.0, "India"),
    "it": ("EUR", 0.8, "Italia"), "mx": ("MXN", 9.0, "México"), "nl": ("EUR", 1.1, "Nederland"),
    "nz": ("NZD", 1.7, "New Zealand"), "pl": ("PLN", 2.4, "Polska"),
    "sg": ("SGD", 1.5, "Singapore"), "za": ("ZAR", 9.0, "South Africa"),
}
_ROLE_FACTORS = {
    "intern": 0.45, "graduate": 0.7, "junior": 0.75, "assistant": 0.7, "senior": 1.35,
    "lead": 1.45, "principal": 1.7, "staff": 1.6, "head": 1.8, "director": 1.9, "manager": 1.3,
    "engineer": 1.25, "developer": 1.15, "scientist": 1.3, "architect": 1.55, "data": 1.1,
    "machine": 1.2, "learning": 1.1, "python": 1.1, "rust": 1.2, "golang": 1.15, "nurse": 0.85,
    "teacher": 0.8, "driver": 0.65, "cleaner": 0.55, "chef": 0.7, "accountant": 1.0,
}
_PLACE_FACTORS = {"london": 1.25, "new york": 1.35, "san francisco": 1.5, "manchester": 0.95,
                  "edinburgh": 0.97, "remote": 1.0}
_CATEGORY_WORDS = (
    (("IT Jobs", "it-jobs"), {"developer", "software", "python", "data", "devops", "it",
                              "programmer", "cloud", "web", "frontend", "backend", "sre"}),
    (("Healthcare & Nursing Jobs", "healthcare-nursing-jobs"), {"nurse", "nursing", "care",
                                                                "health", "doctor"}),
    (("Teaching Jobs", "teaching-jobs"), {"teacher", "teaching", "tutor", "lecturer"}),
    (("Accounting & Finance Jobs", "accounting-finance-jobs"), {"accountant", "finance",
                                                                "accounting", "analyst"}),
    (("Engineering Jobs", "engineering-jobs"), {"engineer", "engineering", "mechanical"}),
)


def _category(what: str) -> tuple[str, str]:
    words = set(re.findall(r"[a-z]+", what.lower()))
    for category, keys in _CATEGORY_WORDS:
        if words & keys:
            return category
    return ("Other/General Jobs", "other-general-jobs")


async def adzuna_auth(request: Request) -> ApiFault | None:
    """401 AUTH_FAIL unless both ``app_id`` and ``app_key`` are given."""
    q = request.query_params
    if not q.get("app_id") or not q.get("app_key"):
        return ApiFault(401, "Authorisation failed", kind="auth",
                        details={"exception": "AUTH_FAIL"})
    return None


def _country(request: Request) -> str:
    country = str(request.path_params["country"]).lower()
    if country not in COUNTRIES:
        raise ApiFault(400, f"Unsupported country '{country}'",
                       details={"exception": "UNSUPPORTED_COUNTRY"})
    return country


def _query(request: Request) -> tuple[str, str]:
    q = request.query_params
    what = " ".join(filter(None, [q.get("what"), q.get("what_and"), q.get("what_phrase"),
                                  q.get("title_only")])).strip()
    where = (q.get("where") or q.get("location1") or q.get("location0") or "").strip()
    return what, where


def mean_salary(country: str, what: str, where: str) -> int:
    """The mean advertised annual salary for a query, rounded to 100."""
    rng = rng_for("salary", country, what.lower(), where.lower())
    base = 36000.0 * rng.uniform(0.92, 1.08)
    for word in re.findall(r"[a-z]+", what.lower()):
        base *= _ROLE_FACTORS.get(word, 1.0)
    place = where.lower()
    factor = next((f for name, f in _PLACE_FACTORS.items() if name in place), None)
    base *= factor if factor is not None else (rng.uniform(0.85, 1.05) if place else 1.0)
    base *= COUNTRIES[country][1]
    return int(round(min(base, 400000 * COUNTRIES[country][1]) / 100.0) * 100)


def advert_count(country: str, what: str, where: str) -> int:
    if "nojobs" in what.lower().split():
        return 0
    return 40 + stable_int("count", country, what.lower(), where.lower()) % 4000


async def histogram(request: Request) -> Response:
    """``GET .../histogram``: ``{"histogram": {"20000": "n", ...}}``, counts as strings, as
    Adzuna's documented example writes them (developer.adzuna.com/docs/histogram)."""
    country = _country(request)
    what, where = _query(request)
    total = advert_count(country, what, where)
    hist: dict[str, str] = {}
    if total:
        mean = mean_salary(country, what, where)
        width = 10000 * max(1, round(COUNTRIES[country][1]))
        sigma = 0.28
        mu = math.log(mean) - sigma * sigma / 2
        lo = max(width, (int(mean * 0.35) // width) * width)
        hi = int(mean * 2.2)
        weights = {}
        for start in range(lo, hi + 1, width):
            mid = start + width / 2
            weights[start] = math.exp(-((math.log(mid) - mu) ** 2) / (2 * sigma * sigma))
        scale = sum(weights.values()) or 1.0
        for start, w in weights.items():
            count = int(round(total * w / scale))
            if count:
                hist[str(start)] = str(count)
    return JSONResponse({"__CLASS__": "Adzuna::API::Response::SalaryHistogram",
                         "histogram": hist})


async def history(request: Request) -> Response:
    """``GET .../history``: ``{"month": {"2026-01": mean, ...}}`` for ``months`` months."""
    country = _country(request)
    what, where = _query(request)
    what = what or request.query_params.get("category", "")
    try:
        months = int(request.query_params.get("months", "12"))
    except ValueError as exc:
        raise ApiFault(400, "months must be an integer") from exc
    if not 1 <= months <= 120:
        raise ApiFault(400, "months must be between 1 and 120")
    out: dict[str, int] = {}
    if advert_count(country, what, where):
        mean = mean_salary(country, what, where)
        today = datetime.now(UTC).date().replace(day=1)
        trend = rng_for("trend", country, what, where).uniform(-0.04, 0.08)
        for back in range(months, 0, -1):
            month = _months_before(today, back)
            key = f"{month.year:04d}-{month.month:02d}"
            noise = rng_for("month", country, what, where, key).uniform(-0.02, 0.02)
            out[key] = int(round(mean * (1 - trend * back / 12 + noise)))
    return JSONResponse({"__CLASS__": "Adzuna::API::Response::HistoricalSalary", "month": out})


def _months_before(first: date, n: int) -> date:
    index = first.year * 12 + first.month - 1 - n
    return date(index // 12, index % 12 + 1, 1)


async def search(request: Request) -> Response:
    """``GET .../search/{page}``: ``{"count", "mean", "results": [...]}``."""
    country = _country(request)
    what, where = _query(request)
    try:
        page = int(request.path_params["page"])
        per_page = int(request.query_params.get("results_per_page", "10"))
    except ValueError as exc:
        raise ApiFault(400, "page and results_per_page must be integers") from exc
    if page < 1 or not 1 <= per_page <= 50:
        raise ApiFault(400, "page must be >= 1 and results_per_page within 1..50")
    total = advert_count(country, what, where)
    mean = mean_salary(country, what, where) if total else 0
    base = str(request.base_url).rstrip("/")
    first = (page - 1) * per_page
    results = [_advert(country, what, where, i, mean, base)
               for i in range(first, min(first + per_page, total))]
    return JSONResponse({"__CLASS__": "Adzuna::API::Response::JobSearchResults",
                         "count": total, "mean": mean, "results": results})


def _advert(country: str, what: str, where: str, i: int, mean: int, base: str) -> dict[str, Any]:
    rng = rng_for("advert", country, what.lower(), where.lower(), i)
    role = titlecase(what) if what else pick(TITLES, "title", country, i)
    prefix = rng.choice(("", "", "Senior ", "Junior ", "Lead "))
    suffix = rng.choice(("", "", " - Remote", " (Hybrid)", " - Contract"))
    title = f"{prefix}{role}{suffix}".strip()
    city, _nation, area2 = CITIES[rng.randrange(len(CITIES))]
    if where:
        known = next((c for c in CITIES if c[0].lower() == where.lower()), None)
        city, area2 = (known[0], known[2]) if known else (titlecase(where), titlecase(where))
    company = COMPANIES[rng.randrange(len(COMPANIES))]
    spread = rng.uniform(0.08, 0.2)
    centre = mean * rng.uniform(0.85, 1.15)
    salary_min = int(round(centre * (1 - spread) / 500) * 500)
    salary_max = int(round(centre * (1 + spread) / 500) * 500)
    created = datetime.now(UTC).replace(microsecond=0, second=0, minute=0) - \
        timedelta(hours=6 * i + rng.randrange(6))
    skills = rng.sample(SKILLS, 3)
    ident = str(4_000_000_000 + stable_int("id", country, what, where, i) % 900_000_000)
    slug = slugify(f"{title} {company} {city}")
    contract = "contract" if "Contract" in title else "permanent"
    category = _category(what)
    return {
        "__CLASS__": "Adzuna::API::Response::Job",
        "id": ident,
        "adref": f"eyJhbGciOiJIUzI1NiJ9.{ident}",
        "title": title,
        "description": (f"{company} is hiring a {title} in {city}. You will work with "
                        f"{', '.join(skills)} on a {rng.choice(('small', 'growing', 'large'))} "
                        "team…"),
        "created": created.isoformat().replace("+00:00", "Z"),
        "redirect_url": f"{base}/pages/job/{slug}-{ident}",
        "company": {"__CLASS__": "Adzuna::API::Response::Company", "display_name": company},
        "location": {"__CLASS__": "Adzuna::API::Response::Location",
                     "display_name": f"{city}, {area2}",
                     "area": [COUNTRIES[country][2], area2, city]},
        "category": {"__CLASS__": "Adzuna::API::Response::Category",
                     "label": category[0], "tag": category[1]},
        "salary_min": salary_min,
        "salary_max": salary_max,
        "salary_is_predicted": "1" if rng.random() < 0.3 else "0",
        "contract_time": "part_time" if rng.random() < 0.1 else "full_time",
        "contract_type": contract,
        "latitude": round(51.0 + rng.uniform(-2, 4), 5),
        "longitude": round(-1.0 + rng.uniform(-3, 2), 5),
    }
