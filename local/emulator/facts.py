"""Facts a prompt states, so that emulated answers can repeat them.

``read_facts(prompt)`` finds, without any model, what a prompt says in plain sight:

- a job listing's title, company, place, salary (amounts, ISO currency, period), skills,
  employment type and remote policy, from the data the prompt carries (a ``<<<PAGE ...
  PAGE>>>`` block when there is one, else the whole prompt) and from a JSON object in it
  that declares them (a schema.org ``JobPosting`` digest);
- numbered sources (``[n] title`` / ``URL: ...`` / text), to be cited as ``[n]``;
- figures given as a JSON object (``open_positions``, ``mean_advertised_salary``,
  ``monthly_mean_salary_oldest_first``, ...), to be written out as sentences.

The writers (``listing_summary``, ``brief_sentences``, ``market_sentences``) turn those
facts into plain sentences. Everything is a pure function of the prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .text import SKILLS

_PAGE = re.compile(r"<<<PAGE\n(.*?)\nPAGE>>>", re.S)
_SOURCE = re.compile(r"^\[(\d{1,3})\] ([^\n]+)\nURL: (\S+)\n(.*?)(?=^\[\d{1,3}\] |\Z)", re.S | re.M)
_CURRENCY_SIGNS = {"€": "EUR", "£": "GBP", "$": "USD", "¥": "JPY", "₹": "INR"}
_CODES = ("EUR", "GBP", "USD", "CHF", "CAD", "AUD", "NZD", "SEK", "NOK", "DKK", "PLN", "INR",
          "JPY", "SGD", "ZAR", "BRL", "MXN")
_AMOUNT = r"(\d{1,3}(?:[,.\u00a0 ]\d{3})+|\d+(?:\.\d+)?)\s*([kK])?"
_MONEY = re.compile(
    rf"(?P<c1>{'|'.join(_CODES)}|[€£$¥₹])\s?{_AMOUNT}"
    rf"(?:\s*(?:-|–|—|to)\s*(?:{'|'.join(_CODES)}|[€£$¥₹])?\s?{_AMOUNT})?"
    rf"(?:\s?(?P<c2>{'|'.join(_CODES)}))?")
_MONEY_AFTER = re.compile(
    rf"{_AMOUNT}(?:\s*(?:-|–|—|to)\s*{_AMOUNT})?\s?(?P<c>{'|'.join(_CODES)}|[€£$])")
_PERIODS = (
    ("hour", r"an hour|per hour|/\s?h(?:ou)?r\b|hourly|p/h"),
    ("day", r"a day|per day|/\s?day|daily|day rate"),
    ("week", r"a week|per week|/\s?week|weekly"),
    ("month", r"a month|per month|/\s?month|monthly|p\.?m\.?\b"),
    ("year", r"a year|per year|/\s?year|/\s?yr|yearly|annual(?:ly)?|per annum|p\.?a\.?\b"),
)
_EMPLOYMENT = (
    ("full_time", r"full[- ]time|permanent"),
    ("part_time", r"part[- ]time"),
    ("contract", r"\bcontract(?:or)?\b|freelance"),
    ("temporary", r"\btemporary\b|fixed[- ]term"),
    ("internship", r"\bintern(?:ship)?\b"),
    ("volunteer", r"\bvolunteer"),
)
_COMPANY = re.compile(r"\b([A-Z][\w&'-]*(?: [A-Z][\w&'-]*){0,3} "
                      r"(?:Ltd|Limited|GmbH|AG|SE|Inc|LLC|plc|PLC|BV|B\.V\.|SA|S\.A\.|Oy|AB|"
                      r"Co|Corp|Group|Labs|Technologies))\b\.?")
_AT_COMPANY = re.compile(r"\bat ([A-Z][\w&'-]*(?: [A-Z][\w&'-]*){0,2})")
_LABEL = re.compile(r"^\s*(title|role|position|company|employer|location|place)\s*:\s*(.+)$",
                    re.I | re.M)
_PLACES = (
    "London", "Manchester", "Bristol", "Leeds", "Edinburgh", "Cambridge", "Birmingham",
    "Glasgow", "Oxford", "Dublin", "Berlin", "Munich", "Hamburg", "Frankfurt", "Cologne",
    "Paris", "Lyon", "Amsterdam", "Rotterdam", "Brussels", "Madrid", "Barcelona", "Lisbon",
    "Milan", "Rome", "Vienna", "Zurich", "Geneva", "Copenhagen", "Stockholm", "Oslo",
    "Helsinki", "Warsaw", "Prague", "New York", "San Francisco", "Seattle", "Boston",
    "Austin", "Chicago", "Toronto", "Vancouver", "Sydney", "Melbourne", "Singapore",
)
_TITLE_WORDS = re.compile(
    r"\b(developer|engineer|manager|scientist|analyst|designer|architect|consultant|nurse|"
    r"teacher|accountant|administrator|specialist|director|officer|assistant|technician|"
    r"recruiter|programmer|tester|lead|chef|writer)s?\b", re.I)


@dataclass(frozen=True)
class Salary:
    """A salary the prompt states: amounts, ISO 4217 code and what the amounts are per."""

    low: float | None
    high: float | None
    currency: str | None
    period: str | None


@dataclass(frozen=True)
class Source:
    """A numbered source given in the prompt."""

    number: int
    title: str
    url: str
    text: str


@dataclass(frozen=True)
class Facts:
    """What a prompt states (None or empty where it says nothing)."""

    title: str | None = None
    company: str | None = None
    location: str | None = None
    salary: Salary | None = None
    skills: tuple[str, ...] = ()
    employment_type: str | None = None
    remote: bool | None = None
    #: ``remote``, ``hybrid`` or ``on site``, when the listing says.
    work_mode: str | None = None
    sources: tuple[Source, ...] = ()
    figures: dict[str, Any] = field(default_factory=dict)
    #: True when the prompt carries data to extract from (a page, a JSON digest, a posting).
    listing: bool = False

    @property
    def known(self) -> bool:
        """Whether the prompt states anything these facts cover."""
        return self.listing or bool(self.sources) or bool(self.figures)


def read_facts(prompt: str) -> Facts:
    """The facts ``prompt`` states."""
    page = _PAGE.search(prompt)
    data = page.group(1) if page else prompt
    sources = tuple(Source(int(m.group(1)), m.group(2).strip(), m.group(3).strip(),
                           " ".join(m.group(4).split()))
                    for m in _SOURCE.finditer(prompt))
    objects = _json_objects(prompt)
    figures = next((o for o in objects if "open_positions" in o or
                    "mean_advertised_salary" in o), {})
    declared = next((o for o in objects if {"title", "company", "salary"} & o.keys()
                     and o is not figures), {})
    if sources or (figures and not page):
        return Facts(sources=sources, figures=figures)
    salary = _declared_salary(declared.get("salary")) or find_salary(data)
    labels = {k.lower(): v.strip() for k, v in _LABEL.findall(data)}
    title = (_str(declared.get("title")) or labels.get("title") or labels.get("role")
             or labels.get("position") or _title_line(data))
    company = (_str(declared.get("company")) or labels.get("company")
               or labels.get("employer") or _company(data))
    location = _str(declared.get("location")) or labels.get("location") or _place(data)
    skills = tuple(declared["skills"]) if isinstance(declared.get("skills"), list) \
        else find_skills(data)
    employment = _str(declared.get("employment_type")) or _employment(data)
    remote = declared["remote"] if isinstance(declared.get("remote"), bool) else _remote(data)
    mode = "hybrid" if re.search(r"\bhybrid\b", data, re.I) else (
        None if remote is None else "remote" if remote else "on site")
    listing = bool(page or declared or salary or (title and _TITLE_WORDS.search(title)))
    return Facts(title=title, company=company, location=location, salary=salary,
                 skills=skills, employment_type=employment, remote=remote, work_mode=mode,
                 listing=listing)


# -- finding ---------------------------------------------------------------------------

def _str(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def _json_objects(text: str) -> list[dict[str, Any]]:
    """The JSON objects written in ``text`` (outermost only, each read once)."""
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    start = text.find("{")
    while start >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            end = start + 1
        else:
            if isinstance(value, dict) and len(value) >= 2:
                out.append(value)
        start = text.find("{", end)
    return out


def _number(text: str, thousands: str | None) -> float:
    digits = re.sub(r"[,.\u00a0 ](?=\d{3}\b)", "", text)
    value = float(digits.replace(",", "."))
    return value * 1000 if thousands else value


def _period(text: str, amount: float | None) -> str | None:
    for name, pattern in _PERIODS:
        if re.search(pattern, text, re.I):
            return name
    if amount is None:
        return None
    return "year" if amount >= 10_000 else "hour" if amount < 300 else None


def find_salary(text: str) -> Salary | None:
    """The first salary stated in ``text`` (``EUR 70,000 - 85,000 a year``, ``£45k``...)."""
    match = _MONEY.search(text)
    if match:
        groups = match.groups()
        sign = match.group("c2") or match.group("c1")
        low = _number(groups[1], groups[2])
        high = _number(groups[3], groups[4] or groups[2]) if groups[3] else None
    else:
        match = _MONEY_AFTER.search(text)
        if not match:
            return None
        groups = match.groups()
        sign = match.group("c")
        low = _number(groups[0], groups[1] or groups[3])
        high = _number(groups[2], groups[3]) if groups[2] else None
    currency = _CURRENCY_SIGNS.get(sign, sign)
    if high is not None and high < low:
        low, high = high, low
    after = text[match.end():match.end() + 40]
    return Salary(low, high, currency, _period(after, high or low))


def _declared_salary(value: Any) -> Salary | None:
    if not isinstance(value, dict):
        return None
    low, high = value.get("min"), value.get("max")
    return Salary(float(low) if isinstance(low, int | float) else None,
                  float(high) if isinstance(high, int | float) else None,
                  _str(value.get("currency")), _str(value.get("period")))


def find_skills(text: str) -> tuple[str, ...]:
    """Known skills named in ``text``, in the order they appear."""
    found = []
    for skill in SKILLS:
        m = re.search(rf"(?<![\w+#]){re.escape(skill)}(?![\w+#])", text, re.I)
        if m:
            found.append((m.start(), skill))
    return tuple(skill for _, skill in sorted(found))


def _title_line(text: str) -> str | None:
    for line in text.splitlines():
        line = line.strip(" #*-\t")
        if not line:
            continue
        head = re.split(r"[,.;:(|]| - | – | at ", line)[0].strip()
        if _TITLE_WORDS.search(head) and len(head.split()) <= 8:
            return head
        return None
    return None


def _company(text: str) -> str | None:
    m = _COMPANY.search(text) or _AT_COMPANY.search(text)
    return m.group(1).strip() if m else None


def _place(text: str) -> str | None:
    hits = [(m.start(), place) for place in _PLACES
            if (m := re.search(rf"\b{re.escape(place)}\b", text))]
    return min(hits)[1] if hits else None


def _employment(text: str) -> str | None:
    for name, pattern in _EMPLOYMENT:
        if re.search(pattern, text, re.I):
            return name
    return None


def _remote(text: str) -> bool | None:
    if re.search(r"\bno remote|on[- ]site only|office[- ]based|in the office every day|"
                 r"based in (?:the|our) [\w ]{1,30}office", text, re.I):
        return False
    if re.search(r"\bremote\b|\bhybrid\b|work from home|\bwfh\b", text, re.I):
        return True
    if re.search(r"\bon[- ]?site\b", text, re.I):
        return False
    return None


# -- writing ---------------------------------------------------------------------------

def money(amount: float, currency: str | None) -> str:
    """``EUR 70,000`` (whole amounts without decimals)."""
    figure = f"{amount:,.0f}" if float(amount).is_integer() or amount >= 1000 \
        else f"{amount:,.2f}"
    return f"{currency} {figure}" if currency else figure


def _salary_phrase(salary: Salary) -> str | None:
    amounts = [a for a in (salary.low, salary.high) if a is not None]
    if not amounts:
        return None
    text = " to ".join(money(a, salary.currency if i == 0 else None)
                       for i, a in enumerate(amounts))
    return f"{text} a {salary.period}" if salary.period else text


def _listing_of(items: tuple[str, ...]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def listing_summary(facts: Facts) -> str:
    """Two or three sentences on a job listing, from what the listing states."""
    role = facts.title or "The role"
    where = []
    if facts.company:
        where.append(f"at {facts.company}")
    if facts.location:
        where.append(f"in {facts.location}")
    first = " ".join([role, *where]).strip()
    details = [d for d in ((facts.employment_type or "").replace("_", "-"), facts.work_mode)
               if d]
    if details:
        first += f" ({', '.join(details)})"
    sentences = [f"{first}."]
    pay = _salary_phrase(facts.salary) if facts.salary else None
    if pay:
        sentences.append(f"The listing offers {pay}.")
    if facts.skills:
        sentences.append(f"It asks for {_listing_of(facts.skills[:6])}.")
    return " ".join(sentences)


def _first_sentence(text: str, limit: int = 220) -> str:
    text = re.sub(r"^.{0,80}? — ", "", text.strip())
    m = re.match(r"(.+?[.!?])(?:\s|$)", text)
    out = (m.group(1) if m else text).strip()
    if len(out) > limit:
        out = out[:limit].rsplit(" ", 1)[0].rstrip(",;:") + "."
    return out if out.endswith((".", "!", "?")) else out + "."


def source_fact(source: Source, limit: int = 160) -> str:
    """One short fact from a source: its first sentence, without the closing stop."""
    return _first_sentence(source.text or source.title, limit).rstrip(".")


def brief_sentences(facts: Facts, *, most: int = 4) -> list[str]:
    """Sentences drawn from the numbered sources, each citing the source it came from."""
    out = []
    for source in facts.sources[:most]:
        sentence = _first_sentence(source.text or source.title)
        out.append(f"{sentence[:-1]} [{source.number}].")
    return out


def market_sentences(figures: dict[str, Any]) -> list[str]:
    """Plain sentences built from a job market's figures (only those given)."""
    role = _str(figures.get("role")) or "this role"
    place = _str(figures.get("place"))
    where = f" in {place}" if place else ""
    currency = _str(figures.get("currency"))
    out = []
    count = figures.get("open_positions")
    if isinstance(count, int):
        if count:
            out.append(f"There are {count:,} open {role} positions{where} right now.")
        else:
            out.append(f"There are no open {role} positions{where} right now.")
    mean = figures.get("mean_advertised_salary")
    if isinstance(mean, int | float):
        out.append(f"Their mean advertised salary is {money(round(mean, -2), currency)}.")
    else:
        out.append("None of them advertises a salary, so there is no mean to report.")
    trend = [p for p in figures.get("monthly_mean_salary_oldest_first") or []
             if isinstance(p, list) and len(p) == 2 and isinstance(p[1], int | float)]
    change = figures.get("salary_change_pct_over_period")
    if len(trend) >= 2:
        (first_month, first), (last_month, last) = trend[0], trend[-1]
        move = ""
        if isinstance(change, int | float):
            move = (f", {'up' if change > 0 else 'down'} {abs(change):g}%" if change
                    else ", unchanged")
        out.append(f"From {first_month} to {last_month} the monthly mean moved from "
                   f"{money(round(first), currency)} to {money(round(last), currency)}{move}.")
    else:
        out.append("There is not enough salary history to show a trend.")
    return out
