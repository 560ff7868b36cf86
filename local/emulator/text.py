"""Deterministic building blocks for plausible fake data.

Everything here is a pure function of its arguments: the same query gives the same
answer in every process and on every run (``hashlib``, never the salted ``hash()``).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

COMPANIES = (
    "Northwind Analytics", "Bluefin Robotics", "Acme Logistics", "Brightpath Health",
    "Cobalt Fintech", "Larkspur Energy", "Meridian Software", "Oakridge Retail",
    "Pinecrest Labs", "Quillon Media", "Redwood Mobility", "Saltmarsh Foods",
    "Tidewater Insurance", "Umbra Security", "Vantage Cloud", "Willowbank Education",
)
CITIES = (
    ("London", "UK", "London"), ("Manchester", "UK", "North West England"),
    ("Bristol", "UK", "South West England"), ("Leeds", "UK", "Yorkshire"),
    ("Edinburgh", "UK", "Scotland"), ("Cambridge", "UK", "East of England"),
    ("Birmingham", "UK", "West Midlands"), ("Glasgow", "UK", "Scotland"),
)
SKILLS = (
    "Python", "SQL", "AWS", "Docker", "Kubernetes", "TypeScript", "React", "Terraform",
    "PostgreSQL", "Redis", "FastAPI", "Go", "Rust", "Java", "Spark", "Airflow",
    "Machine Learning", "Communication", "Stakeholder management", "CI/CD",
)
TITLES = (
    "Software Engineer", "Data Engineer", "Backend Developer", "Product Manager",
    "Data Scientist", "DevOps Engineer", "Frontend Developer", "QA Engineer",
    "Machine Learning Engineer", "Site Reliability Engineer",
)
FIRST_NAMES = ("Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken")
LAST_NAMES = ("Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Allen", "Thompson")
WORDS = (
    "reliable", "scalable", "team", "product", "customers", "growth", "platform", "data",
    "remote", "hybrid", "mentoring", "delivery", "quality", "impact", "ownership", "learning",
)
STOPWORDS = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "has", "have", "in",
    "is", "it", "its", "of", "on", "or", "that", "the", "this", "to", "was", "were", "will",
    "with", "you", "your", "json", "schema", "return", "answer", "given", "valid", "value",
    "single", "do", "not", "add", "commentary", "please", "following", "extract",
))


def digest(*parts: object) -> bytes:
    """A SHA-256 digest of the parts' ``repr`` joined with a separator."""
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()


def stable_int(*parts: object) -> int:
    """A non-negative 64-bit integer that depends only on the parts."""
    return int.from_bytes(digest(*parts)[:8], "big")


def rng_for(*parts: object) -> random.Random:
    """A ``random.Random`` seeded only by the parts."""
    return random.Random(stable_int(*parts))


def pick(seq: Sequence[T], *parts: object) -> T:
    """One element of ``seq`` chosen by the parts."""
    return seq[stable_int(*parts) % len(seq)]


def keywords(text: str, limit: int = 8) -> list[str]:
    """The first distinct content words of ``text`` (no stopwords), lower case."""
    seen: list[str] = []
    for word in re.findall(r"[A-Za-z][A-Za-z+#.-]{2,}", text):
        w = word.lower().strip(".-")
        if w not in STOPWORDS and w not in seen:
            seen.append(w)
            if len(seen) >= limit:
                break
    return seen


def slugify(text: str, max_len: int = 60) -> str:
    """A URL slug of ``text``: lower case words joined by hyphens."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:max_len].rstrip("-") or "item"


def titlecase(text: str) -> str:
    """Words of ``text`` capitalised, acronyms such as 'AWS' kept."""
    return " ".join(w if w.isupper() else w[:1].upper() + w[1:] for w in text.split())


def estimate_tokens(text: str) -> int:
    """A rough token count (about four characters a token), at least 1 for non-empty text."""
    return math.ceil(len(text) / 4) if text else 0


def sentence(*parts: object, words: Sequence[str] = (), length: int = 12) -> str:
    """A deterministic sentence mixing ``words`` (if any) with neutral filler."""
    rng = rng_for("sentence", *parts)
    pool = list(words) + list(WORDS)
    out = [rng.choice(pool) for _ in range(length)]
    return (" ".join(out)).capitalize() + "."
