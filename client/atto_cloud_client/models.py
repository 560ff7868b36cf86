"""Typed results of every route: small frozen dataclasses, built from the JSON answers.

Each top-level result has an ``info`` field (not compared, not shown in ``repr``) with the
answer's metadata: its parsed ``RateLimit`` headers, whether it was replayed, the
``Idempotency-Key`` it carried and how many attempts it took.

Fields the server may add later (credit balances, a plan name) are optional here and read
when present, so this client keeps working before and after the server learns them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .ratelimit import RateLimitStatus

JSON = dict[str, Any]


@dataclass(frozen=True)
class ResponseInfo:
    """What the client learned from an answer besides its body.

    Attributes:
        status: the HTTP status.
        request_id: the ``Idempotency-Key`` the call carried (reused across its retries).
        replayed: True when the server answered from its idempotency store
            (``Idempotent-Replayed: true``): no provider was called, nothing charged again.
        attempts: how many attempts the call made (1 without retries).
        rate_limit: the parsed ``RateLimit-Policy``/``RateLimit`` headers, if any.
        retry_after_s: the ``Retry-After`` header in seconds, if any.
    """

    status: int
    request_id: str | None
    replayed: bool
    attempts: int
    rate_limit: RateLimitStatus | None
    retry_after_s: float | None


# --- credit -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreditGrant:
    """One grant of extra tokens.

    Attributes:
        reference: the grant's idempotent reference (e.g. an invoice id), if given.
        kind: ``paid`` or ``promo``, if given.
        remaining: tokens left in the grant.
        tokens: tokens it gave at first, if given.
        expires_at: its expiry as the server wrote it (RFC 3339 text or Unix time), or None.
    """

    reference: str | None
    kind: str | None
    remaining: int | None
    tokens: int | None
    expires_at: str | float | None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CreditGrant:
        expires = obj.get("expires_at")
        return cls(reference=_str(obj.get("reference")), kind=_str(obj.get("kind")),
                   remaining=_int(obj.get("remaining", obj.get("balance"))),
                   tokens=_int(obj.get("tokens", obj.get("amount"))),
                   expires_at=expires if isinstance(expires, str | int | float)
                   and not isinstance(expires, bool) else None)


@dataclass(frozen=True)
class EndedGrant:
    """A grant that expired or was voided in the last 30 days (``Usage.ended_grants``).

    Attributes:
        reference: the grant's reference.
        kind: ``paid`` or ``promo``.
        tokens: tokens it gave at first.
        ended: ``expired`` or ``voided``.
        ended_at: when it ended, Unix time (None when the server sent no instant).
        forfeited: tokens unused when it ended: lost, never drawn.
    """

    reference: str | None
    kind: str | None
    tokens: int | None
    ended: str | None
    ended_at: float | None
    forfeited: int | None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> EndedGrant:
        return cls(reference=_str(obj.get("reference")), kind=_str(obj.get("kind")),
                   tokens=_int(obj.get("tokens")), ended=_str(obj.get("ended")),
                   ended_at=_instant(obj.get("ended_at")), forfeited=_int(obj.get("forfeited")))


@dataclass(frozen=True)
class SupportRefund:
    """A charge support refunded in the last 30 days (``Usage.refunded``).

    Attributes:
        request_id: the refunded charge's id, as its ``X-Request-Id`` showed it.
        tokens: tokens given back (None while the refund is in progress).
        refunded_at: when support refunded it, Unix time.
    """

    request_id: str
    tokens: int | None
    refunded_at: float | None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SupportRefund:
        return cls(request_id=str(obj.get("request_id", "")), tokens=_int(obj.get("tokens")),
                   refunded_at=_instant(obj.get("refunded_at")))


@dataclass(frozen=True)
class CreditBalance:
    """Credit beyond the plan's quota, when the server reports it.

    Attributes:
        remaining: tokens of credit left (the server's figure, else the grants' sum).
        grants: the live grants, as listed.
    """

    remaining: int | None
    grants: tuple[CreditGrant, ...]

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CreditBalance | None:
        """Read ``credit`` (a number or an object) and ``grants`` from a body; None if absent.

        Args:
            obj: a usage answer or a 429's error object.

        Returns:
            The balance, or None when the body carries neither field.
        """
        credit, grants_json = obj.get("credit"), obj.get("grants")
        if isinstance(credit, Mapping):
            grants_json = credit.get("grants", grants_json)
            credit = credit.get("remaining", credit.get("balance", credit.get("tokens")))
        if credit is None and not isinstance(grants_json, list):
            return None
        grants = tuple(CreditGrant.from_json(g) for g in grants_json or []
                       if isinstance(g, Mapping))
        remaining = _int(credit)
        if remaining is None and grants and all(g.remaining is not None for g in grants):
            remaining = sum(g.remaining or 0 for g in grants)
        return cls(remaining=remaining, grants=grants)


# --- structured, embeddings -----------------------------------------------------------------


@dataclass(frozen=True)
class TokenUsage:
    """Tokens the model provider counted (not budget tokens)."""

    prompt_tokens: int
    completion_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class StructuredResult:
    """``POST /v1/structured``: a JSON value valid for the caller's schema.

    ``strict``: the answer came in the provider's strict mode; ``strict_rejected``: the
    provider's reason when it refused the schema in strict mode and the answer was asked
    without it (None otherwise).
    """

    data: Any
    model: str
    usage: TokenUsage
    strict: bool = False
    strict_rejected: str | None = None
    info: ResponseInfo | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_json(cls, obj: JSON, info: ResponseInfo | None = None) -> StructuredResult:
        usage = obj["usage"]
        return cls(data=obj["data"], model=obj["model"], info=info,
                   usage=TokenUsage(int(usage["prompt_tokens"]),
                                    int(usage["completion_tokens"])),
                   strict=bool(obj.get("strict", False)),
                   strict_rejected=obj.get("strict_rejected"))


@dataclass(frozen=True)
class Embedding:
    """One vector; ``index`` is the position of its text in the input."""

    index: int
    embedding: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class EmbeddingsResult:
    """``POST /v1/embeddings``: one vector per text, in input order."""

    data: tuple[Embedding, ...]
    model: str
    usage: TokenUsage
    info: ResponseInfo | None = field(default=None, compare=False, repr=False)

    @property
    def vectors(self) -> list[tuple[float, ...]]:
        """The vectors alone, in input order."""
        return [e.embedding for e in sorted(self.data, key=lambda e: e.index)]

    @classmethod
    def from_json(cls, obj: JSON, info: ResponseInfo | None = None) -> EmbeddingsResult:
        return cls(data=tuple(Embedding(int(e["index"]), tuple(float(x) for x in e["embedding"]))
                              for e in obj["data"]),
                   model=obj["model"], usage=TokenUsage(int(obj["usage"]["prompt_tokens"])),
                   info=info)


# --- company research ---------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A web page a brief is based on."""

    title: str
    url: str


@dataclass(frozen=True)
class KeyFact:
    """A fact of a company brief and the source it came from."""

    fact: str
    source_url: str


@dataclass(frozen=True, kw_only=True)
class CompanyResearch:
    """``POST /v1/company-research``: a sourced company brief.

    Attributes:
        summary: the brief; ``[n]`` cites the n-th entry of ``sources``.
        model: the model that wrote it; None when no source was found.
    """

    company: str
    summary: str
    key_facts: tuple[KeyFact, ...]
    sources: tuple[Source, ...]
    model: str | None
    info: ResponseInfo | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_json(cls, obj: JSON, info: ResponseInfo | None = None) -> CompanyResearch:
        return cls(company=obj["company"], summary=obj["summary"],
                   key_facts=tuple(KeyFact(f["fact"], f["source_url"])
                                   for f in obj["key_facts"]),
                   sources=tuple(Source(s["title"], s["url"]) for s in obj["sources"]),
                   model=obj.get("model"), info=info)


# --- salary -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SalaryBand:
    """A histogram band; ``max`` is None for the open-ended last band."""

    min: float
    max: float | None
    count: int


@dataclass(frozen=True)
class SalaryPercentiles:
    """Interpolated from the histogram; None without data."""

    p25: float | None
    median: float | None
    p75: float | None


@dataclass(frozen=True)
class DataSource:
    """Where figures came from; ``used_for`` says which (market context only)."""

    name: str
    url: str | None
    used_for: str | None = None


@dataclass(frozen=True, kw_only=True)
class SalaryResult:
    """``GET /v1/salary``: the advertised salary distribution for a title and place."""

    title: str
    location: str | None
    country: str
    currency: str
    histogram: tuple[SalaryBand, ...]
    percentiles: SalaryPercentiles
    mean: float | None
    sample_count: int
    open_positions: int
    source: DataSource
    info: ResponseInfo | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_json(cls, obj: JSON, info: ResponseInfo | None = None) -> SalaryResult:
        p = obj["percentiles"]
        return cls(
            title=obj["title"], location=obj.get("location"), country=obj["country"],
            currency=obj["currency"],
            histogram=tuple(SalaryBand(float(b["min"]), _float(b.get("max")), int(b["count"]))
                            for b in obj["histogram"]),
            percentiles=SalaryPercentiles(_float(p.get("p25")), _float(p.get("median")),
                                          _float(p.get("p75"))),
            mean=_float(obj.get("mean")), sample_count=int(obj["sample_count"]),
            open_positions=int(obj["open_positions"]),
            source=DataSource(obj["source"]["name"], obj["source"].get("url")), info=info)


# --- job extraction -----------------------------------------------------------------------


@dataclass(frozen=True)
class JobSalary:
    """A listing's salary: amounts per ``period`` (hour, day, week, month, year)."""

    min: float | None
    max: float | None
    currency: str | None
    period: str | None


@dataclass(frozen=True, kw_only=True)
class JobListing:
    """``POST /v1/job-extraction``: a structured job listing.

    Attributes:
        employment_type: full_time, part_time, contract, temporary, internship, volunteer,
            other, or None.
        structured_data: True when the page's JSON-LD JobPosting supplied facts.
    """

    title: str
    company: str | None
    location: str | None
    salary: JobSalary | None
    employment_type: str | None
    remote: bool | None
    skills: tuple[str, ...]
    description_summary: str
    source_url: str | None
    structured_data: bool
    model: str
    info: ResponseInfo | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_json(cls, obj: JSON, info: ResponseInfo | None = None) -> JobListing:
        s = obj.get("salary")
        salary = (JobSalary(_float(s.get("min")), _float(s.get("max")), s.get("currency"),
                            s.get("period")) if isinstance(s, Mapping) else None)
        return cls(title=obj["title"], company=obj.get("company"), location=obj.get("location"),
                   salary=salary, employment_type=obj.get("employment_type"),
                   remote=obj.get("remote"), skills=tuple(obj["skills"]),
                   description_summary=obj["description_summary"],
                   source_url=obj.get("source_url"),
                   structured_data=bool(obj["structured_data"]), model=obj["model"], info=info)


# --- market context -----------------------------------------------------------------------


@dataclass(frozen=True)
class Demand:
    """Open positions now, their mean salary, and the trend's change in percent."""

    open_positions: int
    mean_salary: float | None
    salary_change_pct: float | None


@dataclass(frozen=True)
class MonthlyMean:
    """The mean advertised salary of one month (``YYYY-MM``)."""

    month: str
    mean: float


@dataclass(frozen=True, kw_only=True)
class MarketContext:
    """``POST /v1/market-context``: demand, a 12-month salary trend and a short narrative."""

    role: str
    location: str | None
    country: str
    currency: str
    demand: Demand
    salary_trend: tuple[MonthlyMean, ...]
    narrative: str
    sources: tuple[DataSource, ...]
    info: ResponseInfo | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_json(cls, obj: JSON, info: ResponseInfo | None = None) -> MarketContext:
        d = obj["demand"]
        return cls(
            role=obj["role"], location=obj.get("location"), country=obj["country"],
            currency=obj["currency"],
            demand=Demand(int(d["open_positions"]), _float(d.get("mean_salary")),
                          _float(d.get("salary_change_pct"))),
            salary_trend=tuple(MonthlyMean(m["month"], float(m["mean"]))
                               for m in obj["salary_trend"]),
            narrative=obj["narrative"],
            sources=tuple(DataSource(s["name"], s.get("url"), s.get("used_for"))
                          for s in obj["sources"]),
            info=info)


# --- usage --------------------------------------------------------------------------------


@dataclass(frozen=True)
class UsageWindow:
    """One window of the plan: ``resets_at`` is when its oldest charge leaves it, as Unix
    time (the server's RFC 3339 string, read), None when the window holds no charge."""

    limit: int
    used: int
    remaining: int
    window_s: int
    resets_at: float | None


@dataclass(frozen=True)
class SpendEvent:
    """One charge.

    Attributes:
        request_id: the ``Idempotency-Key`` (or request id) it is tied to.
        at: when the charge was made, as Unix time (the server's RFC 3339 string, read).
        from_grants: tokens of it drawn from credit grants, when the server reports it.
        draws: (grant reference, tokens) for each grant it drew from, in draw order.
    """

    request_id: str
    cost: int
    route: str
    at: float
    from_grants: int | None = None
    draws: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_json(cls, e: Mapping[str, Any]) -> SpendEvent:
        draws = tuple((str(d["reference"]), int(d["tokens"])) for d in e.get("draws") or []
                      if isinstance(d, Mapping) and "reference" in d and "tokens" in d)
        from_grants = _int(e.get("from_grants"))
        if from_grants is None and "draws" in e:
            from_grants = sum(n for _, n in draws)
        at = _instant(e["at"])
        if at is None:
            raise ValueError(f"a spend event's at is not an instant: {e['at']!r}")
        return cls(e["request_id"], int(e["cost"]), e["route"], at, from_grants, draws)


@dataclass(frozen=True, kw_only=True)
class Usage:
    """``GET /v1/usage``: the caller's windows, recent charges and the price list.

    ``prices`` maps a route to its tokens, or to the rule of a route priced by the size of
    its request (e.g. ``"1 per started 8,000 characters of input"``).

    Attributes:
        plan: the plan's name, when the server reports it.
        credit: the credit balance and grants, when the server reports them.
        ended_grants: grants that expired or were voided in the last 30 days, most recent
            first, with what each forfeited.
        refunded: charges support refunded in the last 30 days, most recent first (they
            leave ``events``).
    """

    user_id: str
    windows: tuple[UsageWindow, ...]
    events: tuple[SpendEvent, ...]
    prices: dict[str, int | str]
    plan: str | None = None
    credit: CreditBalance | None = None
    ended_grants: tuple[EndedGrant, ...] = ()
    refunded: tuple[SupportRefund, ...] = ()
    info: ResponseInfo | None = field(default=None, compare=False, repr=False)

    def charged(self, request_id: str) -> int:
        """Tokens charged to ``request_id`` among the listed events (0 if none)."""
        return sum(e.cost for e in self.events if e.request_id == request_id)

    @classmethod
    def from_json(cls, obj: JSON, info: ResponseInfo | None = None) -> Usage:
        plan = obj.get("plan")
        if isinstance(plan, Mapping):
            plan = plan.get("name")
        return cls(
            user_id=obj["user_id"],
            windows=tuple(UsageWindow(int(w["limit"]), int(w["used"]), int(w["remaining"]),
                                      int(w["window_s"]), _instant(w.get("resets_at")))
                          for w in obj["windows"]),
            events=tuple(SpendEvent.from_json(e) for e in obj["events"]),
            prices={str(k): v if isinstance(v, int) else str(v)
                    for k, v in obj["prices"].items()},
            plan=plan if isinstance(plan, str) else None,
            credit=CreditBalance.from_json(obj),
            ended_grants=tuple(EndedGrant.from_json(g) for g in _objects(obj.get("ended_grants"))),
            refunded=tuple(SupportRefund.from_json(r) for r in _objects(obj.get("refunded"))),
            info=info)


@dataclass(frozen=True)
class UsageHistoryRecord:
    """One charge's usage record, as ``GET /v1/usage/history`` shows it.

    Attributes:
        request_id: the request's id (its ``X-Request-Id``).
        route: the route charged ("" while the record is partial).
        plan: the plan it was charged under.
        cost: tokens reserved.
        kept: tokens kept now (after settles and refunds).
        refunded: tokens given back.
        credit: (grant reference, tokens) drawn from credit grants.
        state: ``charged``, ``settled``, ``refunded`` or ``support-refunded``.
        at: when it was charged, Unix time.
        changed_at: when it was last settled or refunded, Unix time (None: never).
    """

    request_id: str
    route: str
    plan: str
    cost: int
    kept: int
    refunded: int
    credit: tuple[tuple[str, int], ...]
    state: str
    at: float
    changed_at: float | None = None

    @classmethod
    def from_json(cls, r: Mapping[str, Any]) -> UsageHistoryRecord:
        at = _instant(r["at"])
        if at is None:
            raise ValueError(f"a usage record's at is not an instant: {r['at']!r}")
        return cls(request_id=str(r["request_id"]), route=str(r.get("route", "")),
                   plan=str(r.get("plan", "")), cost=int(r["cost"]), kept=int(r["kept"]),
                   refunded=int(r.get("refunded", int(r["cost"]) - int(r["kept"]))),
                   credit=tuple((str(c["reference"]), int(c["tokens"]))
                                for c in r.get("credit") or []),
                   state=str(r["state"]), at=at, changed_at=_instant(r.get("changed_at")))


@dataclass(frozen=True)
class UsageDay:
    """One UTC day of a statement (every day of its span, a day without charges with
    zeros): charges made (refunded ones included), tokens reserved, kept, given back and
    drawn from credit, and ``refunds``: the charges given back whole (failed requests,
    support refunds)."""

    day: str
    charges: int
    reserved: int
    kept: int
    refunded: int
    credit: int
    refunds: int = 0


@dataclass(frozen=True, kw_only=True)
class UsageTotals:
    """A statement's summary of its whole span: what was charged, given back and kept.

    Attributes:
        charges: charges made, refunded ones included.
        reserved: tokens they reserved.
        refunds: charges given back whole: failed requests (refunded automatically) and
            support refunds; ``charges - refunds`` stand.
        refunded: tokens given back, by refunds and settles (``reserved - kept``).
        kept: tokens kept now.
        credit: tokens drawn from credit grants.
    """

    charges: int
    reserved: int
    refunds: int
    refunded: int
    kept: int
    credit: int

    @classmethod
    def from_json(cls, t: Mapping[str, Any]) -> UsageTotals:
        return cls(charges=int(t["charges"]), reserved=int(t["reserved"]),
                   refunds=int(t["refunds"]), refunded=int(t["refunded"]),
                   kept=int(t["kept"]), credit=int(t["credit"]))


@dataclass(frozen=True, kw_only=True)
class UsageHistory:
    """``GET /v1/usage/history``: one page of the caller's statement, newest first.

    Attributes:
        since: the span's start, Unix time (inclusive).
        until: the span's end, Unix time (exclusive).
        records: this page's records.
        days: the totals of every UTC day of the span, newest first (first page only;
            None on the others).
        summary: the totals of the whole span (first page only; None on the others).
        cursor: pass it to get the next page (it carries the span); None on the last.
    """

    user_id: str
    since: float
    until: float
    records: tuple[UsageHistoryRecord, ...]
    days: tuple[UsageDay, ...] | None
    cursor: str | None
    summary: UsageTotals | None = None
    info: ResponseInfo | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_json(cls, obj: JSON, info: ResponseInfo | None = None) -> UsageHistory:
        days = obj.get("days")
        return cls(
            user_id=str(obj["user_id"]), since=_instant(obj["from"]) or 0.0,
            until=_instant(obj["to"]) or 0.0,
            records=tuple(UsageHistoryRecord.from_json(r) for r in obj["records"]),
            days=None if days is None else tuple(
                UsageDay(str(d["day"]), int(d["charges"]), int(d["reserved"]), int(d["kept"]),
                         int(d["refunded"]), int(d["credit"]), int(d.get("refunds", 0)))
                for d in days),
            summary=None if obj.get("summary") is None
            else UsageTotals.from_json(obj["summary"]),
            cursor=obj.get("cursor"), info=info)


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _instant(value: Any) -> float | None:
    """An instant of a body as Unix time: the server writes RFC 3339 UTC strings
    (``2026-12-02T16:51:27.123Z``); a number (an older server's Unix time) is taken as is.
    Anything else is None."""
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return None
        return moment.timestamp() if moment.tzinfo is not None else None
    return _float(value)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _objects(value: Any) -> list[Mapping[str, Any]]:
    """The objects of a list in a body (anything else in it, or no list: none)."""
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []
