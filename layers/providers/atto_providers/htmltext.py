"""Readable text and JSON-LD from an HTML page, with the standard library's ``html.parser``.

``html_to_text(html)`` drops scripts, styles and other non-content elements, keeps the
page's title, its ``<link rel=canonical>`` and every ``<script type="application/ld+json">``
block (parsed), and turns the rest into plain text with one line per block element.
``job_postings(json_ld)`` finds the schema.org ``JobPosting`` objects among those blocks
(top level, lists and ``@graph``) and ``posting_fields(posting)`` maps one to the fields of
a job listing.

Nothing here does I/O; every output is capped so that a hostile page cannot make it large.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Any

#: Characters of text kept from a page (the LLM gets at most this).
DEFAULT_MAX_CHARS = 12_000
#: JSON-LD blocks kept per page, and characters of each block parsed.
MAX_JSON_LD_BLOCKS = 8
MAX_JSON_LD_CHARS = 100_000

_SKIP = frozenset({"script", "style", "noscript", "template", "svg", "math", "iframe",
                   "object", "canvas", "select", "button"})
_BLOCK = frozenset({"address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt",
                    "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3",
                    "h4", "h5", "h6", "header", "hr", "li", "main", "nav", "ol", "p", "pre",
                    "section", "table", "td", "th", "tr", "ul"})
_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
                   "param", "source", "track", "wbr"})
_SPACES = re.compile(r"[ \t\r\f\v\u00a0]+")
_BLANKS = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class HtmlText:
    """What a page says, as plain text.

    Attributes:
        text: the visible text, one line per block element, at most ``max_chars`` long.
        title: the ``<title>``, or None.
        canonical_url: the ``<link rel="canonical">`` href, or None.
        json_ld: every JSON-LD block that parsed, in page order.
        truncated: True when the text was cut at ``max_chars``.
    """

    text: str
    title: str | None = None
    canonical_url: str | None = None
    json_ld: tuple[Any, ...] = ()
    truncated: bool = False


class _Extractor(HTMLParser):
    def __init__(self, keep_chars: int) -> None:
        super().__init__(convert_charrefs=True)
        self.keep_chars = keep_chars  # raw text kept; the rest is parsed for JSON-LD only
        self.kept = 0
        self.parts: list[str] = []
        self.title: list[str] = []
        self.canonical: str | None = None
        self.json_ld: list[str] = []
        self._skip_depth = 0
        self._skip_tag: str | None = None
        self._in_title = False
        self._in_json_ld = False
        self._ld_buffer: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip_tag is not None:
            if tag == self._skip_tag:
                self._skip_depth += 1
            return
        values = {name: (value or "") for name, value in attrs}
        if tag == "script" and values.get("type", "").strip().lower() == "application/ld+json":
            self._in_json_ld, self._ld_buffer = True, []
            return
        if tag in _SKIP:
            self._skip_tag, self._skip_depth = tag, 1
            return
        if tag == "title":
            self._in_title = True
        elif tag == "link" and "canonical" in values.get("rel", "").lower().split():
            self.canonical = self.canonical or values.get("href") or None
        elif tag == "li":
            self.parts.append("\n- ")
        elif tag in _BLOCK:
            self.parts.append("\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in _VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if self._in_json_ld and tag == "script":
            self._in_json_ld = False
            if len(self.json_ld) < MAX_JSON_LD_BLOCKS:
                self.json_ld.append("".join(self._ld_buffer)[:MAX_JSON_LD_CHARS])
            return
        if self._skip_tag is not None:
            if tag == self._skip_tag:
                self._skip_depth -= 1
                if self._skip_depth <= 0:
                    self._skip_tag = None
            return
        if tag == "title":
            self._in_title = False
        elif tag in _BLOCK and tag != "li":  # the next <li> starts its own line
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._in_json_ld:
            if sum(map(len, self._ld_buffer)) < MAX_JSON_LD_CHARS:
                self._ld_buffer.append(data)
            return
        if self._skip_tag is not None:
            return
        if self._in_title:
            self.title.append(data)
            return
        if self.kept < self.keep_chars:
            self.kept += len(data)
            self.parts.append(data)


def html_to_text(html: str, *, max_chars: int = DEFAULT_MAX_CHARS) -> HtmlText:
    """The visible text, title, canonical URL and JSON-LD of ``html``.

    Args:
        html: the page's markup (any quality: the parser never raises on bad markup).
        max_chars: cap of the returned text.
    """
    parser = _Extractor(keep_chars=4 * max_chars + 1000)
    parser.feed(html)
    parser.close()
    text = normalise_text("".join(parser.parts))
    truncated = len(text) > max_chars
    if truncated:
        text = text[:max_chars].rsplit(" ", 1)[0]
    title = normalise_text("".join(parser.title)) or None
    blocks = []
    for raw in parser.json_ld:
        try:
            blocks.append(json.loads(raw))
        except (ValueError, RecursionError):  # malformed, or nested deeper than json can parse
            continue
    return HtmlText(text=text, title=title[:300] if title else None,
                    canonical_url=parser.canonical, json_ld=tuple(blocks), truncated=truncated)


def normalise_text(text: str) -> str:
    """Collapse runs of spaces, trim every line and keep at most one blank line in a row."""
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def job_postings(json_ld: tuple[Any, ...] | list[Any]) -> list[dict[str, Any]]:
    """The schema.org ``JobPosting`` objects in parsed JSON-LD blocks, in page order."""
    found: list[dict[str, Any]] = []

    def visit(node: Any, depth: int) -> None:
        if depth > 4 or len(found) >= 4:
            return
        if isinstance(node, list):
            for item in node[:50]:
                visit(item, depth + 1)
        elif isinstance(node, dict):
            kinds = node.get("@type")
            kinds = kinds if isinstance(kinds, list) else [kinds]
            if any(isinstance(k, str) and k.rsplit("/", 1)[-1] == "JobPosting" for k in kinds):
                found.append(node)
            elif "@graph" in node:
                visit(node["@graph"], depth + 1)

    visit(list(json_ld), 0)
    return found


_EMPLOYMENT = {"FULL_TIME": "full_time", "FULLTIME": "full_time", "PART_TIME": "part_time",
               "PARTTIME": "part_time", "CONTRACTOR": "contract", "CONTRACT": "contract",
               "TEMPORARY": "temporary", "INTERN": "internship", "INTERNSHIP": "internship",
               "VOLUNTEER": "volunteer", "PER_DIEM": "other", "OTHER": "other"}
_PERIODS = {"HOUR": "hour", "DAY": "day", "WEEK": "week", "MONTH": "month", "YEAR": "year"}


def posting_fields(posting: dict[str, Any]) -> dict[str, Any]:
    """The job-listing fields a ``JobPosting`` states; a field it does not state is absent.

    Keys: ``title``, ``company``, ``location``, ``salary`` (``min``, ``max``, ``currency``,
    ``period``), ``employment_type``, ``remote``, ``skills``, ``description`` (plain text)
    and ``url``.
    """
    out: dict[str, Any] = {}
    title = _text(posting.get("title")) or _text(posting.get("name"))
    if title:
        out["title"] = title
    org = posting.get("hiringOrganization")
    company = _text(org.get("name")) if isinstance(org, dict) else _text(org)
    if company:
        out["company"] = company
    location = _location(posting.get("jobLocation"))
    if location:
        out["location"] = location
    kinds = posting.get("employmentType")
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if isinstance(kind, str) and kind.strip().upper().replace("-", "_") in _EMPLOYMENT:
            out["employment_type"] = _EMPLOYMENT[kind.strip().upper().replace("-", "_")]
            break
    location_type = _text(posting.get("jobLocationType"))
    if location_type and location_type.upper() == "TELECOMMUTE":
        out["remote"] = True
    salary = _salary(posting.get("baseSalary"))
    if salary:
        out["salary"] = salary
    skills = posting.get("skills")
    if isinstance(skills, str):
        skills = [s for s in re.split(r"[,;\n]", skills)]
    if isinstance(skills, list):
        names = [t for t in (_text(s) for s in skills[:50]) if t]
        if names:
            out["skills"] = names
    description = _text(posting.get("description"))
    if description:
        out["description"] = html_to_text(description, max_chars=4000).text
    url = _text(posting.get("url"))
    if url:
        out["url"] = url
    return out


def _text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("name") or value.get("@value")
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return None
    return normalise_text(value.replace("\n", " "))[:500] or None


def _location(value: Any) -> str | None:
    places = value if isinstance(value, list) else [value]
    for place in places[:5]:
        address = place.get("address") if isinstance(place, dict) else place
        if isinstance(address, str):
            return _text(address)
        if isinstance(address, dict):
            parts = [_text(address.get(k)) for k in
                     ("addressLocality", "addressRegion", "addressCountry")]
            seen: list[str] = []
            for part in parts:
                if part and part not in seen:
                    seen.append(part)
            if seen:
                return ", ".join(seen)
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    number: float
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.replace(",", "").strip())
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _salary(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        amount = _number(value)
        return {"min": amount, "max": amount, "currency": None, "period": None} if amount else None
    currency = _text(value.get("currency"))
    quantity = value.get("value")
    unit: Any = None
    if isinstance(quantity, dict):
        low = _number(quantity.get("minValue"))
        high = _number(quantity.get("maxValue"))
        single = _number(quantity.get("value"))
        unit = quantity.get("unitText")
        if low is None and high is None:
            low = high = single
    else:
        low = high = _number(quantity)
    unit = unit or value.get("unitText")
    period = _PERIODS.get(unit.strip().upper()) if isinstance(unit, str) else None
    if low is None and high is None:
        return None
    if low is not None and high is not None and low > high:
        low, high = high, low
    if currency and not re.fullmatch(r"[A-Za-z]{3}", currency):
        currency = None
    return {"min": low, "max": high, "currency": currency.upper() if currency else None,
            "period": period}
