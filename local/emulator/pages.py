"""Web pages for job-listing extraction (family ``pages``), under ``/pages``.

- ``/pages/job/{slug}``: a job posting page (title, company, location, salary, skills)
  with a schema.org ``JobPosting`` JSON-LD script (``?jsonld=0`` leaves it out);
- ``/pages/article/{slug}``: a plain article page (search results link here);
- ``/pages/redirect?to=URL&status=302`` and ``/pages/redirect/{n}`` (a chain of n hops);
- ``/pages/big?mb=6`` (``&chunked=1``: streamed without Content-Length);
- ``/pages/slow?ms=5000``: answers after sleeping;
- ``/pages/status/{code}``: answers with that status.
"""

from __future__ import annotations

import html
import json
from collections.abc import AsyncIterator
from datetime import date, timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from .dialects import ApiFault
from .gate import sleep_while_connected
from .salary import mean_salary
from .text import (
    CITIES,
    COMPANIES,
    SKILLS,
    TITLES,
    WORDS,
    pick,
    rng_for,
    sentence,
    slugify,
    stable_int,
    titlecase,
)

_TITLE_WORDS = {"developer", "engineer", "manager", "scientist", "analyst", "designer",
                "architect", "consultant", "nurse", "teacher", "accountant", "administrator",
                "specialist", "director", "officer", "assistant", "technician", "recruiter",
                "lead", "programmer", "tester"}
_MAX_SLOW_MS = 120_000
_MAX_BIG_MB = 64
_PNG_1X1 = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082")


def job_posting(slug: str) -> dict[str, Any]:
    """The facts of the job page at ``slug`` (what the page and its JSON-LD show)."""
    words = [w for w in slug.lower().split("-") if w and not w.isdigit()]
    rng = rng_for("job", slug)
    title_words: list[str] = []
    for j, w in enumerate(words):
        if w in _TITLE_WORDS:
            title_words = words[max(0, j - 3):j + 1]
            break
    title = titlecase(" ".join(title_words)) if title_words else pick(TITLES, "t", slug)
    company = next((c for c in COMPANIES if slugify(c) in slug.lower()),
                   COMPANIES[rng.randrange(len(COMPANIES))])
    city, _country, region = next((c for c in CITIES if c[0].lower() in words),
                                  CITIES[rng.randrange(len(CITIES))])
    mean = mean_salary("gb", title, city)
    salary_min = int(round(mean * 0.88 / 1000) * 1000)
    salary_max = int(round(mean * 1.12 / 1000) * 1000)
    named = [s for s in SKILLS if s.lower() in words]
    skills = named + [s for s in rng.sample(SKILLS, 6) if s not in named][:5 - len(named)]
    posted = date(2026, 1, 5) + timedelta(days=stable_int("posted", slug) % 150)
    kind = rng.choice(("FULL_TIME", "FULL_TIME", "CONTRACTOR", "PART_TIME"))
    remote = rng.random() < 0.3
    return {
        "slug": slug, "title": title, "company": company, "city": city, "region": region,
        "country": "GB", "salary_min": salary_min, "salary_max": salary_max,
        "currency": "GBP", "skills": skills, "date_posted": posted.isoformat(),
        "valid_through": (posted + timedelta(days=45)).isoformat(),
        "employment_type": kind, "remote": remote,
        "description": _description(title, company, city, skills, kind, remote,
                                    salary_min, salary_max, rng.choice(_WORK)),
    }


_WORK = ("the services behind its customer apps", "its data platform", "its internal tools",
         "the APIs its partners use", "its billing systems")
_KINDS = {"FULL_TIME": "a full-time, permanent role", "CONTRACTOR": "a contract role",
          "PART_TIME": "a part-time role"}


def _description(title: str, company: str, city: str, skills: list[str], kind: str,
                 remote: bool, low: int, high: int, work: str) -> list[str]:
    """The job page's description: plain sentences that agree with its facts."""
    where = "fully remote within the UK" if remote else f"based in the {city} office"
    return [
        f"{company} is looking for a {title} to join its team in {city}.",
        f"You will build and run {work} with {', '.join(skills[:2])} and {skills[2]}, "
        "and share code reviews with the team.",
        f"This is {_KINDS.get(kind, 'a permanent role')}, {where}, paying GBP {low:,} to "
        f"{high:,} a year.",
    ]


def _jsonld(job: dict[str, Any], url: str) -> dict[str, Any]:
    data: dict[str, Any] = {
        "@context": "https://schema.org/",
        "@type": "JobPosting",
        "title": job["title"],
        "description": "<p>" + "</p><p>".join(job["description"]) + "</p>",
        "identifier": {"@type": "PropertyValue", "name": job["company"], "value": job["slug"]},
        "datePosted": job["date_posted"],
        "validThrough": job["valid_through"] + "T23:59",
        "employmentType": job["employment_type"],
        "hiringOrganization": {"@type": "Organization", "name": job["company"],
                               "sameAs": f"https://www.{slugify(job['company'])}.example"},
        "jobLocation": {"@type": "Place", "address": {
            "@type": "PostalAddress", "addressLocality": job["city"],
            "addressRegion": job["region"], "addressCountry": job["country"]}},
        "baseSalary": {"@type": "MonetaryAmount", "currency": job["currency"], "value": {
            "@type": "QuantitativeValue", "minValue": job["salary_min"],
            "maxValue": job["salary_max"], "unitText": "YEAR"}},
        "skills": ", ".join(job["skills"]),
        "url": url,
    }
    if job["remote"]:
        data["jobLocationType"] = "TELECOMMUTE"
    return data


async def job_page(request: Request) -> Response:
    """``GET /pages/job/{slug}``."""
    slug = request.path_params["slug"]
    job = job_posting(slug)
    e = html.escape
    ld = ""
    if request.query_params.get("jsonld", "1") not in ("0", "false", "no"):
        payload = json.dumps(_jsonld(job, str(request.url)), indent=2).replace("</", "<\\/")
        ld = f'<script type="application/ld+json">\n{payload}\n</script>'
    salary = f"£{job['salary_min']:,} - £{job['salary_max']:,} a year"
    skills = "\n".join(f"        <li>{e(s)}</li>" for s in job["skills"])
    paragraphs = "\n".join(f"      <p>{e(p)}</p>" for p in job["description"])
    body = f"""<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>{e(job['title'])} - {e(job['company'])} - {e(job['city'])}</title>
  <meta name="description" content="{e(job['title'])} at {e(job['company'])}, {e(job['city'])}">
  <meta property="og:title" content="{e(job['title'])}">
  {ld}
</head>
<body>
  <header><nav><a href="/">Jobs</a> &rsaquo; <a href="#">{e(job['city'])}</a></nav></header>
  <main>
    <article class="job-posting">
      <h1 class="job-title">{e(job['title'])}</h1>
      <div class="company" data-field="company">{e(job['company'])}</div>
      <div class="location" data-field="location">{e(job['city'])}, {e(job['region'])}</div>
      <div class="salary" data-field="salary">{e(salary)}</div>
      <div class="posted">Posted {e(job['date_posted'])}</div>
      <section class="description">
{paragraphs}
      </section>
      <section class="skills"><h2>Key skills</h2>
      <ul>
{skills}
      </ul>
      </section>
      <a class="apply" href="/pages/job/{e(slug)}/apply">Apply now</a>
    </article>
  </main>
  <footer><p>&copy; 2026 {e(job['company'])}. Cookie settings. Privacy.</p></footer>
</body>
</html>
"""
    return HTMLResponse(body)


async def article_page(request: Request) -> Response:
    """``GET /pages/article/{slug}``."""
    from .search import article_subject, subject_facts

    slug = request.path_params["slug"]
    if "--" in slug:  # a search result's page: it states the facts its snippet quoted
        subject, kind = article_subject(slug)
        title = f"{subject}: {kind}"
        facts = subject_facts(subject)
        texts = [" ".join(facts[k:k + 2]) for k in range(0, len(facts), 2)]
    else:
        words = [w for w in slug.split("-") if w and not w.isdigit()]
        title = titlecase(" ".join(words[:6])) or "Article"
        texts = [sentence(slug, k, words=words, length=40) for k in range(4)]
    paragraphs = "\n".join(f"<p>{html.escape(text)}</p>" for text in texts)
    return HTMLResponse(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title></head>
<body><article><h1>{html.escape(title)}</h1>
{paragraphs}
</article></body></html>
""")


async def redirect(request: Request) -> Response:
    """``GET /pages/redirect?to=URL&status=302``."""
    target = request.query_params.get("to", "/pages/job/redirected-software-engineer")
    status = _int_param(request, "status", 302)
    if status not in (301, 302, 303, 307, 308):
        raise ApiFault(400, "status must be one of 301, 302, 303, 307, 308")
    return RedirectResponse(target, status_code=status)


async def redirect_chain(request: Request) -> Response:
    """``GET /pages/redirect/{n}``: n more hops, then a job page."""
    n = int(request.path_params["n"])
    if n <= 0:
        return RedirectResponse("/pages/job/redirected-software-engineer", status_code=302)
    return RedirectResponse(f"/pages/redirect/{n - 1}", status_code=302)


async def big(request: Request) -> Response:
    """``GET /pages/big?mb=6&chunked=0``: an HTML body of ``mb`` MiB."""
    mb = _float_param(request, "mb", 6.0)
    if not 0 < mb <= _MAX_BIG_MB:
        raise ApiFault(400, f"mb must be within (0, {_MAX_BIG_MB}]")
    size = int(mb * 1024 * 1024)
    head = b"<!doctype html><html><head><title>Big page</title></head><body>\n"
    tail = b"\n</body></html>\n"
    filler_line = ("<p>" + " ".join(WORDS) + "</p>\n").encode()
    chunk = filler_line * (65536 // len(filler_line))

    async def stream() -> AsyncIterator[bytes]:
        remaining = size - len(head) - len(tail)
        yield head
        while remaining > 0:
            piece = chunk[:remaining]
            remaining -= len(piece)
            yield piece
        yield tail

    headers = {} if _flag(request, "chunked") else {"Content-Length": str(size)}
    return StreamingResponse(stream(), media_type="text/html; charset=utf-8", headers=headers)


async def slow(request: Request) -> Response:
    """``GET /pages/slow?ms=5000``: sleeps, then a small page."""
    ms = _float_param(request, "ms", 5000.0)
    if not 0 <= ms <= _MAX_SLOW_MS:
        raise ApiFault(400, f"ms must be within [0, {_MAX_SLOW_MS}]")
    await sleep_while_connected(request, ms / 1000)
    return HTMLResponse(f"<!doctype html><html><body><p>Slow page after {ms:g} ms</p>"
                        "</body></html>")


async def status_page(request: Request) -> Response:
    """``GET /pages/status/{code}``."""
    code = int(request.path_params["code"])
    if not 200 <= code <= 599:
        raise ApiFault(400, "code must be within 200..599")
    if code >= 400:
        raise ApiFault(code, f"Requested status {code}")
    return HTMLResponse(f"<!doctype html><html><body><p>Status {code}</p></body></html>",
                        status_code=code)


async def image(request: Request) -> Response:
    """``GET /pages/image/{name}``: a 1x1 PNG."""
    return Response(_PNG_1X1, media_type="image/png")


def _int_param(request: Request, name: str, default: int) -> int:
    try:
        return int(request.query_params.get(name, default))
    except ValueError as exc:
        raise ApiFault(400, f"{name} must be an integer") from exc


def _float_param(request: Request, name: str, default: float) -> float:
    try:
        return float(request.query_params.get(name, default))
    except ValueError as exc:
        raise ApiFault(400, f"{name} must be a number") from exc


def _flag(request: Request, name: str) -> bool:
    return request.query_params.get(name, "0").lower() in ("1", "true", "yes")


