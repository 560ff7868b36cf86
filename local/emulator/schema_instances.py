"""Deterministic instances of a JSON Schema, for structured-output answers.

``generate_instance(schema, seed=..., hint=...)`` returns a value that is valid for the
schema in every case the emulator is expected to meet (and a best effort otherwise):

- ``type`` (one type or a list), ``nullable`` (OpenAPI), ``enum``, ``const``;
- objects: ``properties``, ``required``, ``additionalProperties``, ``patternProperties``,
  ``minProperties``/``maxProperties``, ``propertyNames``, ``dependentRequired``;
- arrays: ``items`` (schema or tuple), ``prefixItems``, ``additionalItems``,
  ``minItems``/``maxItems``, ``uniqueItems``, ``contains``/``minContains``;
- numbers: ``minimum``/``maximum``, ``exclusiveMinimum``/``exclusiveMaximum`` (draft 4
  booleans and later numbers), ``multipleOf``;
- strings: ``minLength``/``maxLength``, ``pattern`` (see ``regex_strings``), ``format``
  (date, date-time, time, email, uri, uuid, hostname, ipv4, ipv6, duration, ...);
- ``$ref`` to any JSON pointer in the document (``#/$defs/..``, ``#/definitions/..``,
  ``#``), recursion bounded by depth; ``allOf`` merged; ``anyOf``/``oneOf`` one branch;
  ``if``/``then``/``else``.

Values are plausible where that is cheap: property names choose the kind of text or
number (``email``, ``company``, ``salary_min``, ``skills``...), and words of the prompt
(``hint``) flavour free text. Facts the prompt states (``facts.read_facts``: a listing's
title, company, place, salary and skills; numbered sources; market figures) come back in
the fields named for them, and summaries and narratives are sentences built from them
(citing sources as ``[n]``); the first half of the attempts use them, the rest do not,
so a schema the facts do not fit still gets a valid answer. Each candidate is checked
with ``jsonschema`` (formats included); a candidate that fails is retried with another
variant of the choices.
"""

from __future__ import annotations

import base64
import json
import math
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from fractions import Fraction
from typing import Any

from .facts import (
    Facts,
    brief_sentences,
    listing_summary,
    market_sentences,
    read_facts,
    source_fact,
)
from .regex_strings import string_for_pattern
from .text import (
    CITIES,
    COMPANIES,
    FIRST_NAMES,
    LAST_NAMES,
    SKILLS,
    TITLES,
    WORDS,
    digest,
    keywords,
    rng_for,
    stable_int,
    titlecase,
)

__all__ = ["generate_instance", "is_valid"]

_ANY: dict[str, Any] = {}
_NEVER: dict[str, Any] = {"not": {}}
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_BASE_DATE = date(2026, 1, 5)
_TITLE_WORDS = frozenset((
    "developer", "engineer", "manager", "scientist", "analyst", "designer", "architect",
    "consultant", "nurse", "teacher", "accountant", "administrator", "specialist",
    "director", "officer", "assistant", "technician", "recruiter", "programmer", "tester",
    "lead",
))
_HINT_COMPANY = re.compile(r"\bat ([A-Z][\w&.-]*(?: [A-Z][\w&.-]*){0,2})")
_HINT_PLACE = re.compile(r"\bin ([A-Z][a-z]+(?: [A-Z][a-z]+)?)")


def is_valid(instance: Any, schema: Any) -> bool:
    """Whether ``instance`` is valid for ``schema`` (its draft, formats checked)."""
    from jsonschema.validators import validator_for

    cls = validator_for(schema)
    return bool(cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(instance))


def generate_instance(schema: Any, *, seed: object = 0, hint: str = "",
                      attempts: int = 16, max_depth: int = 6) -> Any:
    """A value valid for ``schema``, the same for the same arguments.

    Args:
        schema: a JSON Schema (dict or boolean), any draft from 4 to 2020-12.
        seed: anything hashable to text; varies the choices.
        hint: free text (the prompt) whose words flavour generated strings.
        attempts: variants tried until one validates.
        max_depth: nesting depth after which only required content is generated.

    Returns:
        The first valid variant, or the last one tried if none validated (a schema that
        cannot be satisfied, or one beyond this generator).
    """
    from jsonschema.validators import validator_for

    cls = validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    words = keywords(hint)
    facts = read_facts(hint)
    candidate: Any = None
    for attempt in range(attempts):
        gen = _Generator(schema, seed=seed, attempt=attempt, words=words, max_depth=max_depth,
                         hint=hint, facts=facts if attempt < attempts // 2 else None)
        try:
            candidate = gen.value(schema, _Ctx())
        except (RecursionError, _Unsatisfiable, ValueError, TypeError, KeyError):
            continue
        try:
            if validator.is_valid(candidate):
                return candidate
        except Exception:  # noqa: BLE001 - a pattern Python cannot compile, etc.
            return candidate
    return candidate


class _Unsatisfiable(Exception):
    pass


@dataclass(frozen=True)
class _Ctx:
    """Where a value sits: its path (seeds), the nearest property name and the depth."""

    path: tuple[object, ...] = ()
    name: str = ""
    depth: int = 0
    index: int = 0
    item: bool = False

    def child(self, key: object, *, name: str | None = None, index: int | None = None) -> _Ctx:
        return _Ctx(self.path + (key,), self.name if name is None else name,
                    self.depth + 1, index or 0, index is not None)

    @property
    def slot(self) -> tuple[object, ...]:
        """The path shared by all items of one array (so items can differ by index)."""
        return self.path[:-1] if self.item else self.path


class _Generator:
    def __init__(self, root: Any, *, seed: object, attempt: int, words: list[str],
                 max_depth: int, hint: str = "", facts: Facts | None = None) -> None:
        self.root = root
        self.facts = facts if facts is not None and facts.known else None
        self.hint = hint
        self.seed = seed
        self.attempt = attempt
        self.words = words
        self.max_depth = max_depth
        self.nodes = 0

    # -- schema plumbing -------------------------------------------------------------

    def rng(self, ctx: _Ctx, *salt: object):  # type: ignore[no-untyped-def]
        return rng_for(self.seed, self.attempt, ctx.path, *salt)

    def deep(self, ctx: _Ctx) -> bool:
        return ctx.depth >= self.max_depth or self.nodes > 4000

    def resolve_ref(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return _ANY  # remote references are out of reach offline
        node = self.root
        pointer = ref[1:]
        if pointer in ("", "/"):
            return node
        for raw in pointer.lstrip("/").split("/"):
            part = raw.replace("~1", "/").replace("~0", "~")
            part = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), part)
            if isinstance(node, list):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return _ANY
        return node

    def flatten(self, schema: Any, depth: int = 0) -> dict[str, Any]:
        """The schema as one dict: booleans mapped, ``$ref`` inlined, ``allOf`` merged."""
        if depth > 40:
            raise _Unsatisfiable("reference chain too deep")
        if schema is True or schema is None:
            return {}
        if schema is False:
            return dict(_NEVER)
        if not isinstance(schema, dict):
            raise TypeError("schema must be an object or a boolean")
        out = dict(schema)
        for key in ("$ref", "$dynamicRef", "$recursiveRef"):
            if key in out:
                ref = out.pop(key)
                target = self.resolve_ref(ref if key == "$ref" else "#")
                out = _merge(self.flatten(target, depth + 1), out)
        if "allOf" in out:
            parts = out.pop("allOf")
            for part in parts:
                out = _merge(out, self.flatten(part, depth + 1))
        if "$ref" in out or "allOf" in out:
            return self.flatten(out, depth + 1)
        return out

    # -- values ----------------------------------------------------------------------

    def value(self, schema: Any, ctx: _Ctx) -> Any:
        self.nodes += 1
        s = self.flatten(schema)
        if self.facts is not None:
            stated = self.stated(s, ctx, self.facts)
            if stated is not _UNSTATED:
                return stated
        if "not" in s and s["not"] in ({}, True) and len(s) == 1:
            raise _Unsatisfiable("false schema")
        for _ in range(20):  # a chosen branch may itself hold anyOf/oneOf
            if "anyOf" in s or "oneOf" in s:
                key = "anyOf" if "anyOf" in s else "oneOf"
                branches = s.pop(key)
                branch = self.choose_branch(branches, ctx, key)
                s = _merge(s, self.flatten(branch))
            elif "if" in s:
                cond, then, other = s.pop("if"), s.pop("then", None), s.pop("else", None)
                if self.attempt % 2 == 0 and then is not None:
                    s = _merge(_merge(s, self.flatten(cond)), self.flatten(then))
                elif other is not None:
                    s = _merge(s, self.flatten(other))
            else:
                break
        if "const" in s:
            return s["const"]
        if "enum" in s:
            return self.choose_enum(s["enum"], ctx)
        kind = self.choose_type(s, ctx)
        if kind == "null":
            return None
        if kind == "boolean":
            return self.boolean(ctx)
        if kind in ("integer", "number"):
            return self.number(s, ctx, integer=kind == "integer")
        if kind == "string":
            return self.string(s, ctx)
        if kind == "array":
            return self.array(s, ctx)
        return self.object(s, ctx)

    # facts the prompt states ------------------------------------------------------------

    def stated(self, s: dict[str, Any], ctx: _Ctx, facts: Facts) -> Any:
        """What the prompt states for this field, or ``_UNSTATED``.

        A listing field the listing says nothing about is null where the schema allows it.
        """
        name = re.sub(r"[^a-z]+", "_", ctx.name.lower()).strip("_")
        names = [re.sub(r"[^a-z]+", "_", p.lower()) for p in ctx.path if isinstance(p, str)]
        nullable = _allows_null(s)
        value: Any = _UNSTATED
        item = next((p for p in reversed(ctx.path) if isinstance(p, int)), 0)
        if facts.sources:
            source = facts.sources[item % len(facts.sources)]
            if name in ("summary", "description", "overview", "brief", "description_summary"):
                value = " ".join(brief_sentences(facts))
            elif name == "sentences":
                value = brief_sentences(facts)
            elif name in ("fact", "text", "claim") and len(names) > 1:
                value = source_fact(source)
            elif name in ("source", "source_number", "citation", "ref") and \
                    _fits_type(source.number, s):
                value = source.number
            elif name in ("source_url", "url"):
                value = source.url
            elif name in ("source_title",):
                value = source.title
        elif facts.figures:
            sentences = market_sentences(facts.figures)
            if name == "sentences":
                value = sentences
            elif name in ("narrative", "summary", "description", "overview"):
                value = " ".join(sentences)
        elif facts.listing:
            salary = facts.salary
            in_salary = any(n in ("salary", "pay", "compensation") for n in names[:-1])
            if in_salary and name in ("min", "minimum", "low", "from", "lower"):
                value = salary.low if salary else None
            elif in_salary and name in ("max", "maximum", "high", "to", "upper"):
                value = salary.high if salary else None
            elif name in ("currency", "salary_currency"):
                value = salary.currency if salary else None
            elif name in ("period", "salary_period", "per", "interval", "unit") and in_salary:
                value = salary.period if salary else None
            elif name in ("salary", "compensation", "pay") and salary is None:
                value = None
            elif name in ("title", "job_title", "role", "position"):
                value = facts.title
            elif name in ("company", "employer", "company_name", "organisation",
                          "organization", "hiring_organization"):
                value = facts.company
            elif name in ("location", "city", "place", "job_location"):
                value = facts.location
            elif name in ("employment_type", "employment", "contract_type", "job_type"):
                value = facts.employment_type
            elif name in ("remote", "is_remote", "remote_work"):
                value = facts.remote
            elif name in ("skills", "technologies", "required_skills", "tech_stack"):
                value = list(facts.skills)
            elif name in ("description_summary", "summary", "description", "overview"):
                value = listing_summary(facts)
        if value is _UNSTATED:
            return _UNSTATED
        if value is None:
            return None if nullable else _UNSTATED
        if isinstance(value, str):
            limit = s.get("maxLength")
            if isinstance(limit, int) and len(value) > limit:
                value = value[:limit].rsplit(" ", 1)[0] if " " in value[:limit] \
                    else value[:limit]
        if "enum" in s and value not in s["enum"]:
            return None if nullable and None in s["enum"] else _UNSTATED
        return value if _fits_type(value, s) else _UNSTATED

    def choose_branch(self, branches: list[Any], ctx: _Ctx, key: str) -> Any:
        if not branches:
            raise _Unsatisfiable(f"empty {key}")
        flat = [self.flatten(b) for b in branches]
        order = list(range(len(branches)))
        if self.deep(ctx):
            # Prefer leaves so recursive schemas terminate.
            order.sort(key=lambda i: _weight(flat[i]))
        else:
            # Prefer real values to null; rotate with the attempt for retries.
            order.sort(key=lambda i: _is_null(flat[i]))
        non_null = [i for i in order if not _is_null(flat[i])] or order
        pick = non_null[self.attempt % len(non_null)] if not self.deep(ctx) else order[0]
        return branches[pick]

    def choose_enum(self, values: list[Any], ctx: _Ctx) -> Any:
        if not values:
            raise _Unsatisfiable("empty enum")
        real = [v for v in values if v is not None] or values
        base = stable_int(self.seed, ctx.slot) + ctx.index + self.attempt
        return real[base % len(real)]

    def choose_type(self, s: dict[str, Any], ctx: _Ctx) -> str:
        declared = s.get("type")
        if isinstance(declared, str):
            types = [declared]
        elif isinstance(declared, list) and declared:
            types = [t for t in declared if t in _TYPES] or ["string"]
        else:
            types = [_infer_type(s)]
        if s.get("nullable") is True and "null" not in types:
            types.append("null")
        real = [t for t in types if t != "null"]
        if not real:
            return "null"
        if self.deep(ctx) and "null" in types:
            return "null"
        return real[self.attempt % len(real)]

    def boolean(self, ctx: _Ctx) -> bool:
        name = ctx.name.lower()
        if name.startswith(("is_", "has_", "can_", "remote", "visa")):
            return stable_int(self.seed, ctx.path, self.attempt) % 3 != 0
        return stable_int(self.seed, ctx.path, self.attempt) % 2 == 0

    # numbers -------------------------------------------------------------------------

    def number(self, s: dict[str, Any], ctx: _Ctx, *, integer: bool) -> int | float:
        lo, lo_ex, hi, hi_ex = _bounds(s)
        step = s.get("multipleOf")
        target = self.preferred_number(ctx, integer=integer)
        if integer:
            return _pick_integer(target, lo, lo_ex, hi, hi_ex, step)
        return _pick_number(target, lo, lo_ex, hi, hi_ex, step, self.attempt)

    def preferred_number(self, ctx: _Ctx, *, integer: bool) -> float:
        name = re.sub(r"[^a-z]", "_", ctx.name.lower())
        rng = self.rng(ctx, "num")
        if any(w in name for w in ("salary", "pay", "compensation", "wage", "income")):
            base = 55000 + rng.randrange(-50, 51) * 100
            if "min" in name or "low" in name or "from" in name:
                base -= 10000
            if "max" in name or "high" in name or "to" in name.split("_"):
                base += 10000
            return float(base)
        if any(w in name for w in ("price", "cost", "amount", "budget", "fee")):
            return float(rng.randrange(10, 500)) if integer else rng.randrange(1000, 50000) / 100
        if "year" in name and not name.endswith("years") and "experience" not in name:
            return 2026.0
        if "experience" in name or name.endswith("years"):
            return float(rng.randint(1, 10))
        if name.endswith("month") or name == "month":
            return float(rng.randint(1, 12))
        if name.endswith("day") or name == "day":
            return float(rng.randint(1, 28))
        if name.endswith("age") or name == "age":
            return float(rng.randint(22, 60))
        if any(w in name for w in ("percent", "pct")):
            return float(rng.randint(5, 95))
        if any(w in name for w in ("score", "confidence", "probability", "ratio", "similarity",
                                   "weight", "relevance")):
            return float(rng.randint(50, 99)) if integer else rng.randint(50, 99) / 100
        if any(w in name for w in ("rating", "stars")):
            return float(rng.randint(3, 5))
        if "lat" in name.split("_") or name.startswith("lat"):
            return 51.5072
        if name.startswith(("lon", "lng")):
            return -0.1276
        if any(w in name for w in ("count", "total", "number", "num", "quantity", "size",
                                   "length", "limit", "rank", "index", "page")):
            return float(rng.randint(1, 9))
        return float(rng.randint(1, 100)) if integer else rng.randint(100, 10000) / 100

    # strings -------------------------------------------------------------------------

    def string(self, s: dict[str, Any], ctx: _Ctx) -> str:
        min_len = int(s.get("minLength", 0) or 0)
        max_len = s.get("maxLength")
        max_len = int(max_len) if isinstance(max_len, (int, float)) else None
        fmt = s.get("format")
        text: str | None = None
        if isinstance(fmt, str):
            text = self.formatted(fmt, ctx)
        if text is None and isinstance(s.get("pattern"), str):
            text = string_for_pattern(s["pattern"], (self.seed, self.attempt, ctx.path),
                                      min_length=min_len, max_length=max_len)
            if text is not None:
                return text
        if text is None:
            text = self.plain_text(ctx)
        if len(text) < min_len:
            filler = " ".join(WORDS)
            while len(text) < min_len:
                text = f"{text} {filler}"
        if max_len is not None and len(text) > max_len:
            text = text[:max_len].rstrip() if max_len >= min_len else text[:max_len]
            if len(text) < min_len:
                text = text.ljust(min_len, "x")
        return text

    def formatted(self, fmt: str, ctx: _Ctx) -> str | None:
        n = stable_int(self.seed, self.attempt, ctx.path, fmt)
        day = _BASE_DATE + timedelta(days=n % 180)
        moment = datetime(day.year, day.month, day.day, 9 + n % 9, (n >> 8) % 60, 0,
                          tzinfo=UTC)
        first, last = FIRST_NAMES[n % len(FIRST_NAMES)], LAST_NAMES[(n >> 4) % len(LAST_NAMES)]
        values = {
            "date": day.isoformat(),
            "date-time": moment.isoformat().replace("+00:00", "Z"),
            "time": moment.strftime("%H:%M:%S") + "Z",
            "email": f"{first}.{last}@example.com".lower(),
            "idn-email": f"{first}.{last}@example.com".lower(),
            "uri": f"https://example.com/{_slug(ctx.name) or 'item'}/{n % 10000}",
            "url": f"https://example.com/{_slug(ctx.name) or 'item'}/{n % 10000}",
            "iri": f"https://example.com/{_slug(ctx.name) or 'item'}/{n % 10000}",
            "uri-reference": f"/{_slug(ctx.name) or 'item'}/{n % 10000}",
            "iri-reference": f"/{_slug(ctx.name) or 'item'}/{n % 10000}",
            "uri-template": "https://example.com/items/{id}",
            "uuid": str(uuid.UUID(bytes=digest(self.seed, self.attempt, ctx.path)[:16],
                                  version=4)),
            "hostname": f"api{n % 10}.example.com",
            "idn-hostname": f"api{n % 10}.example.com",
            "ipv4": f"192.0.2.{n % 254 + 1}",
            "ipv6": f"2001:db8::{n % 65535:x}",
            "duration": f"P{n % 30 + 1}D",
            "regex": "^[a-z]+$",
            "json-pointer": f"/{_slug(ctx.name) or 'item'}/0",
            "relative-json-pointer": "0",
            "byte": base64.b64encode(digest(n)[:12]).decode(),
            "binary": "data",
            "password": "correct-horse-battery-staple",
        }
        return values.get(fmt)

    def plain_text(self, ctx: _Ctx) -> str:
        name = ctx.name.lower()
        parts = set(re.split(r"[^a-z]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", ctx.name).lower()))
        rng = self.rng(ctx, "text")
        i = stable_int(self.seed, self.attempt, ctx.slot) + ctx.index
        words = self.words
        if "email" in name:
            return f"{FIRST_NAMES[i % 8]}.{LAST_NAMES[(i >> 3) % 8]}@example.com".lower()
        if parts & {"url", "link", "website", "href", "homepage", "uri"}:
            return f"https://example.com/{_slug(ctx.name)}/{i % 10000}"
        if "phone" in name:
            return f"+44 20 7946 {i % 10000:04d}"
        if parts & {"company", "employer", "organization", "organisation", "org", "companies",
                    "employers", "competitors", "competitor", "hiring"}:
            found = _HINT_COMPANY.search(self.hint)
            if found and ctx.index == 0 and "competitor" not in name:
                return found.group(1)
            return COMPANIES[i % len(COMPANIES)]
        if parts & {"first"} and "name" in parts:
            return FIRST_NAMES[i % len(FIRST_NAMES)]
        if parts & {"last", "surname", "family"}:
            return LAST_NAMES[i % len(LAST_NAMES)]
        if parts & {"title", "role", "position", "job", "occupation", "roles", "titles",
                    "jobs", "positions"}:
            return self.job_title(i)
        if parts & {"location", "city", "where", "address", "town", "locations", "cities",
                    "region", "area"}:
            found = _HINT_PLACE.search(self.hint)
            if found and ctx.index == 0:
                return found.group(1)
            return CITIES[i % len(CITIES)][0]
        if "country" in parts:
            return "United Kingdom"
        if "currency" in parts:
            return "GBP"
        if parts & {"skill", "skills", "technologies", "technology", "tools", "tool",
                    "keywords", "keyword", "tags", "tag", "stack", "requirements"}:
            known = [sk for sk in SKILLS if sk.lower() in words]
            pool = known + [sk for sk in SKILLS if sk not in known]
            return pool[ctx.index % len(pool)] if known else pool[i % len(pool)]
        if parts & {"name", "author", "person", "contact", "recruiter", "manager", "names"}:
            return f"{FIRST_NAMES[i % 8]} {LAST_NAMES[(i >> 3) % 8]}"
        if parts & {"id", "identifier", "key", "ref", "slug", "code"}:
            return f"{_slug(ctx.name) or 'id'}-{i % 100000:05d}"
        if parts & {"date", "posted", "created", "updated", "deadline"}:
            return (_BASE_DATE + timedelta(days=i % 180)).isoformat()
        if parts & {"language", "lang", "locale"}:
            return "en"
        if parts & {"status", "state", "level", "type", "kind", "category", "seniority",
                    "sentiment", "label", "mode", "priority", "grade", "tier"}:
            return ("senior", "mid", "junior", "lead", "active", "open")[i % 6]
        if parts & {"description", "summary", "text", "content", "reason", "reasoning",
                    "explanation", "answer", "notes", "note", "body", "message", "details",
                    "overview", "comment", "feedback", "advice", "rationale", "analysis",
                    "responsibilities", "benefits", "highlights", "pros", "cons", "risks",
                    "strengths", "weaknesses", "suggestions", "recommendation",
                    "recommendations", "insights", "evidence", "bullets", "points"}:
            topic = " ".join(words[:4]) if words else "the request"
            filler = [rng.choice(WORDS) for _ in range(5)]
            return f"Regarding {topic}: " + " ".join(filler) + "."
        if words:
            picked = [words[(i + k) % len(words)] for k in range(min(3, len(words)))]
            return titlecase(" ".join(picked))
        label = " ".join(p for p in re.split(r"[^a-zA-Z]+", ctx.name) if p) or "value"
        return f"{label} {i % 100}"

    def job_title(self, i: int) -> str:
        for j, word in enumerate(self.words):
            if word in _TITLE_WORDS:
                return titlecase(" ".join(self.words[max(0, j - 2):j + 1]))
        return TITLES[i % len(TITLES)]

    # arrays --------------------------------------------------------------------------

    def array(self, s: dict[str, Any], ctx: _Ctx) -> list[Any]:
        items = s.get("items", _ANY)
        prefix: list[Any] = []
        rest: Any = items
        if isinstance(s.get("prefixItems"), list):
            prefix = list(s["prefixItems"])
        elif isinstance(items, list):
            prefix = list(items)
            rest = s.get("additionalItems", _ANY)
        lo = int(s.get("minItems", 0) or 0)
        hi = s.get("maxItems")
        hi = int(hi) if isinstance(hi, (int, float)) else None
        if self.deep(ctx):
            n = lo
        elif self.facts is not None and self.facts.sources and ctx.name in (
                "key_facts", "facts", "citations", "claims"):
            n = max(lo, len(self.facts.sources))  # one item per numbered source
        else:
            n = max(lo, len(prefix), 3 if ctx.depth <= 1 else 2 if ctx.depth <= 3 else 1)
        if rest is False:
            n = max(lo, min(n, len(prefix)))
        if hi is not None:
            n = min(n, hi)
        contains = s.get("contains")
        need_contains = 0
        if contains is not None:
            need_contains = int(s.get("minContains", 1))
            n = max(n, need_contains)
            if hi is not None:
                n = min(n, hi)
        unique = bool(s.get("uniqueItems"))
        out: list[Any] = []
        seen: set[str] = set()
        for i in range(n):
            base = prefix[i] if i < len(prefix) else rest
            if i < need_contains:
                base = {"allOf": [base, contains]}
            value = None
            for retry in range(12 if unique else 1):
                child = ctx.child(i, index=i + retry * n)
                value = self.value(base, child)
                if not unique or _canon(value) not in seen:
                    break
            else:
                if len(out) >= lo:
                    break  # no further distinct value: stop at what is valid
            seen.add(_canon(value))
            out.append(value)
        return out

    # objects -------------------------------------------------------------------------

    def object(self, s: dict[str, Any], ctx: _Ctx) -> dict[str, Any]:
        props: dict[str, Any] = s.get("properties") or {}
        required = [r for r in (s.get("required") or []) if isinstance(r, str)]
        pattern_props: dict[str, Any] = s.get("patternProperties") or {}
        additional = s.get("additionalProperties", True)
        lo = int(s.get("minProperties", 0) or 0)
        hi = s.get("maxProperties")
        hi = int(hi) if isinstance(hi, (int, float)) else None
        keys = list(dict.fromkeys(required))
        if not self.deep(ctx):
            optional = [k for k in props if k not in keys]
            room = None if hi is None else max(0, hi - len(keys))
            keys += optional if room is None else optional[:room]
        deps: dict[str, Any] = dict(s.get("dependentRequired") or {})
        for k, v in (s.get("dependencies") or {}).items():
            if isinstance(v, list):
                deps[k] = v
        changed = True
        while changed:
            changed = False
            for k in list(keys):
                for dep in deps.get(k, []):
                    if dep not in keys:
                        keys.append(dep)
                        changed = True
        out: dict[str, Any] = {}
        for key in keys:
            out[key] = self.value(self.property_schema(key, props, pattern_props, additional),
                                  ctx.child(key, name=key))
        extra = 0
        names_schema = s.get("propertyNames")
        while len(out) < lo and extra < lo + 20:
            new_key = self.extra_key(extra, ctx, pattern_props, additional, names_schema, out)
            extra += 1
            if new_key is None:
                break
            out[new_key] = self.value(
                self.property_schema(new_key, props, pattern_props, additional),
                ctx.child(new_key, name=new_key))
        return out

    @staticmethod
    def property_schema(key: str, props: dict[str, Any], pattern_props: dict[str, Any],
                        additional: Any) -> Any:
        parts = [props[key]] if key in props else []
        parts += [sub for pat, sub in pattern_props.items() if _search(pat, key)]
        if not parts:
            return additional if isinstance(additional, (dict, bool)) else _ANY
        return parts[0] if len(parts) == 1 else {"allOf": parts}

    def extra_key(self, n: int, ctx: _Ctx, pattern_props: dict[str, Any], additional: Any,
                  names_schema: Any, taken: dict[str, Any]) -> str | None:
        for attempt in range(10):
            key: str | None = None
            if pattern_props:
                pattern = list(pattern_props)[n % len(pattern_props)]
                key = string_for_pattern(pattern, (self.seed, ctx.path, n, attempt),
                                         min_length=1)
            elif additional is not False:
                if isinstance(names_schema, dict) and names_schema:
                    key = self.value(names_schema, ctx.child(("name", n, attempt)))
                else:
                    key = f"extra_{n + 1 + attempt}"
            if key is None:
                return None
            if isinstance(key, str) and key not in taken:
                return key
        return None


# -- helpers ---------------------------------------------------------------------------

_UNSTATED = object()
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),)}


def _allows_null(s: dict[str, Any]) -> bool:
    """Whether the (flattened) schema admits null: by type, nullable, enum or a branch."""
    declared = s.get("type")
    if declared == "null" or (isinstance(declared, list) and "null" in declared):
        return True
    if s.get("nullable") is True or ("enum" in s and None in s["enum"]):
        return True
    return any(isinstance(b, dict) and _is_null(b)
               for key in ("anyOf", "oneOf") for b in s.get(key) or [])


def _fits_type(value: Any, s: dict[str, Any]) -> bool:
    """Whether ``value`` has one of the schema's declared types (any, when none is)."""
    declared = s.get("type")
    if declared is None:
        return True
    types = [declared] if isinstance(declared, str) else list(declared)
    for t in types:
        kinds = _JSON_TYPES.get(t, ())
        if isinstance(value, bool) and t not in ("boolean",):
            continue
        if t == "integer" and isinstance(value, float) and not value.is_integer():
            continue
        if isinstance(value, kinds):
            return True
    return False

def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        return False


def _is_null(s: dict[str, Any]) -> bool:
    return s.get("type") == "null" or s.get("const", 0) is None or s.get("enum") == [None]


def _weight(s: dict[str, Any]) -> int:
    """How much a branch tends to nest: leaves first when depth runs out."""
    if _is_null(s):
        return 0
    t = s.get("type")
    if t in ("string", "integer", "number", "boolean") or "enum" in s or "const" in s:
        return 1
    if t == "array" and not s.get("minItems"):
        return 2
    return 3 + len(s.get("required") or [])


def _infer_type(s: dict[str, Any]) -> str:
    if any(k in s for k in ("properties", "required", "additionalProperties",
                            "patternProperties", "minProperties", "maxProperties",
                            "propertyNames", "dependentRequired")):
        return "object"
    if any(k in s for k in ("items", "prefixItems", "minItems", "maxItems", "uniqueItems",
                            "contains", "additionalItems")):
        return "array"
    if any(k in s for k in ("minLength", "maxLength", "pattern", "format")):
        return "string"
    if any(k in s for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                            "multipleOf")):
        step = s.get("multipleOf")
        return "integer" if isinstance(step, int) else "number"
    return "string"


_MIN_KEYS = ("minimum", "minLength", "minItems", "minProperties", "minContains")
_MAX_KEYS = ("maximum", "maxLength", "maxItems", "maxProperties", "maxContains")


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Both schemas' constraints in one dict (an approximation of ``allOf``)."""
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
            continue
        mine = out[key]
        if key == "properties" and isinstance(mine, dict) and isinstance(value, dict):
            merged = dict(mine)
            for name, sub in value.items():
                merged[name] = {"allOf": [merged[name], sub]} if name in merged else sub
            out[key] = merged
        elif key == "required":
            out[key] = list(dict.fromkeys(list(mine) + list(value)))
        elif key == "type":
            out[key] = _intersect_types(mine, value)
        elif key == "enum":
            out[key] = [v for v in mine if v in value] or mine
        elif key in _MIN_KEYS and _is_num(mine) and _is_num(value):
            out[key] = max(mine, value)
        elif key in _MAX_KEYS and _is_num(mine) and _is_num(value):
            out[key] = min(mine, value)
        elif key == "exclusiveMinimum" and _is_num(mine) and _is_num(value):
            out[key] = max(mine, value)
        elif key == "exclusiveMaximum" and _is_num(mine) and _is_num(value):
            out[key] = min(mine, value)
        elif key == "additionalProperties":
            if mine is False or value is False:
                out[key] = False
            elif isinstance(mine, dict) and isinstance(value, dict):
                out[key] = {"allOf": [mine, value]}
            elif mine is True:
                out[key] = value
        elif key in ("items", "contains", "propertyNames", "additionalItems") and \
                isinstance(mine, dict) and isinstance(value, dict):
            out[key] = {"allOf": [mine, value]}
        elif key in ("anyOf", "oneOf"):
            out.setdefault("allOf", [])
            out["allOf"] = list(out["allOf"]) + [{key: value}]
        elif key == "allOf":
            out[key] = list(mine) + list(value)
        elif key == "multipleOf" and _is_num(mine) and _is_num(value):
            out[key] = _lcm(mine, value)
        elif key in ("nullable",):
            out[key] = bool(mine) and bool(value)
        # Any other conflict: the first schema's value stands; validation decides.
    return out


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _lcm(a: float, b: float) -> float:
    fa, fb = Fraction(str(a)), Fraction(str(b))
    num = math.lcm(fa.numerator, fb.numerator)
    den = math.gcd(fa.denominator, fb.denominator)
    value = Fraction(num, den)
    return int(value) if value.denominator == 1 else float(value)


def _intersect_types(a: Any, b: Any) -> Any:
    sa = {a} if isinstance(a, str) else set(a)
    sb = {b} if isinstance(b, str) else set(b)
    both = sa & sb
    if "integer" in sa and "number" in sb or "number" in sa and "integer" in sb:
        both.add("integer")
    if not both:
        return a
    ordered = [t for t in _TYPES if t in both]
    return ordered[0] if len(ordered) == 1 else ordered


def _bounds(s: dict[str, Any]) -> tuple[float | None, bool, float | None, bool]:
    lo = s.get("minimum") if _is_num(s.get("minimum")) else None
    hi = s.get("maximum") if _is_num(s.get("maximum")) else None
    lo_ex = s.get("exclusiveMinimum") is True
    hi_ex = s.get("exclusiveMaximum") is True
    xmin, xmax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if _is_num(xmin) and (lo is None or xmin >= lo):
        lo, lo_ex = xmin, True
    if _is_num(xmax) and (hi is None or xmax <= hi):
        hi, hi_ex = xmax, True
    return lo, lo_ex, hi, hi_ex


def _pick_integer(target: float, lo: float | None, lo_ex: bool, hi: float | None,
                  hi_ex: bool, step: Any) -> int:
    low = -math.inf if lo is None else (math.floor(lo) + 1 if lo_ex else math.ceil(lo))
    high = math.inf if hi is None else (math.ceil(hi) - 1 if hi_ex else math.floor(hi))
    if low > high:
        raise _Unsatisfiable("empty integer range")
    unit = 1
    if _is_num(step) and step > 0:
        frac = Fraction(str(step))
        unit = frac.numerator  # the smallest integer multiple of step
    value = round(target / unit) * unit
    if value < low:
        value = math.ceil(low / unit) * unit
    if value > high:
        value = math.floor(high / unit) * unit
    if value < low:
        raise _Unsatisfiable("no multiple in range")
    return int(value)


def _pick_number(target: float, lo: float | None, lo_ex: bool, hi: float | None, hi_ex: bool,
                 step: Any, attempt: int) -> int | float:
    def inside(v: float) -> bool:
        if lo is not None and (v < lo or (lo_ex and v == lo)):
            return False
        return not (hi is not None and (v > hi or (hi_ex and v == hi)))

    if _is_num(step) and step > 0:
        k0 = round(target / step)
        if lo is not None and k0 * step < lo:
            k0 = math.ceil(lo / step)
        if hi is not None and k0 * step > hi:
            k0 = math.floor(hi / step)
        for delta in _spiral(200):
            k = k0 + delta + attempt
            v = _tidy(k * step, step)
            if inside(v) and _multiple_ok(v, step):
                return v
        raise _Unsatisfiable("no multiple in range")
    value = target
    if not inside(value):
        if lo is not None and hi is not None:
            value = (lo + hi) / 2
        elif lo is not None:
            value = lo + 1
        elif hi is not None:
            value = hi - 1
    if not inside(value):
        raise _Unsatisfiable("empty number range")
    rounded = round(value, 2)
    value = rounded if inside(rounded) else value
    return int(value) if float(value).is_integer() and abs(value) < 2**53 else value


def _spiral(n: int) -> list[int]:
    out = [0]
    for i in range(1, n):
        out += [i, -i]
    return out


def _tidy(value: float, step: Any) -> int | float:
    if isinstance(step, int):
        return int(value)
    text = repr(float(step))
    places = len(text.split(".")[1]) if "." in text and "e" not in text else 12
    rounded = round(value, places)
    return int(rounded) if float(rounded).is_integer() else rounded


def _multiple_ok(value: float, step: Any) -> bool:
    if isinstance(step, float):
        q = value / step
        try:
            return int(q) == q
        except OverflowError:
            return (Fraction(value) / Fraction(step)).denominator == 1
    return bool(value % step == 0)
