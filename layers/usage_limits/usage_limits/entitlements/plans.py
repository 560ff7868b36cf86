"""Named plans and how a user's plan is chosen.

A plan is a named set of sliding windows, written as ``ATTO_BUDGET`` always was::

    ATTO_PLANS="free=100/1h,1000/30d;pro=400/1h,20000/30d"   ATTO_DEFAULT_PLAN=free

With ``ATTO_PLANS`` unset, ``ATTO_BUDGET`` is the one plan, named ``default``. A plan may
also say how large a share of a saturated provider its users get, against other users
(``usage_limits.throttle``: fair queuing), with a ``weight=N`` item (default 1)::

    ATTO_PLANS="free=100/1h,1000/30d;pro=400/1h,20000/30d,weight=2"

A user's plan is, in this order: an operator's override, the JWT claim named by
``ATTO_PLAN_CLAIM``, the default. A claim that names no plan falls back to the default (and
is logged by the caller): a token minted for a plan this deployment does not define must
never turn into a server error. ``cognito:groups``-style claims hold several names; the
first that names a plan wins.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from ..exceptions import InvalidArgument

#: The name of the one plan ``ATTO_BUDGET`` defines when ``ATTO_PLANS`` is unset.
SINGLE_PLAN_NAME = "default"
#: Where a user's plan came from.
PlanSource = Literal["override", "claim", "default"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_WINDOW = re.compile(r"\s*(\d+)\s*/\s*(\d*)\s*([smhd])\s*")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

Windows = tuple[tuple[int, int], ...]


def parse_windows(text: str, *, setting: str = "ATTO_BUDGET") -> Windows:
    """Parse ``"100/1h,1000/30d"`` into ``((100, 3600), (1000, 2592000))`` (limit, seconds).

    Args:
        text: comma-separated ``LIMIT/[N]UNIT`` items (units s, m, h, d).
        setting: the variable named in error messages.

    Returns:
        The windows as (limit in tokens, length in seconds), shortest first.

    Raises:
        InvalidArgument: an item is malformed or not positive, or two windows have the
            same length.
    """
    windows = []
    for part in text.split(","):
        match = _WINDOW.fullmatch(part)
        if not match:
            raise InvalidArgument(
                f"{setting}: {part.strip()!r} is not LIMIT/[N]UNIT (units s, m, h, d), "
                "e.g. 100/1h,1000/30d")
        limit, count, unit = int(match[1]), int(match[2] or 1), match[3]
        if limit <= 0 or count <= 0:
            raise InvalidArgument(f"{setting}: {part.strip()!r} must be positive")
        windows.append((limit, count * _UNITS[unit]))
    if len({seconds for _, seconds in windows}) != len(windows):
        raise InvalidArgument(f"{setting}: two windows have the same length in {text!r}")
    return tuple(sorted(windows, key=lambda w: w[1]))


def _weight(text: str, setting: str) -> tuple[float, str]:
    """A plan's ``weight=N`` item (default 1) and its other items, the windows."""
    weight, rest = 1.0, []
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            rest.append(part)
            continue
        if name.strip() != "weight":
            raise InvalidArgument(f"{setting}: {part.strip()!r} is not weight=N")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise InvalidArgument(f"{setting}: {part.strip()!r}: the weight must be a number > 0")
    return weight, ",".join(rest)


@dataclass(frozen=True)
class Plan:
    """One named plan.

    Attributes:
        name: the plan's name (letters, digits, ``_.-``; at most 64 characters).
        windows: (limit in tokens, length in seconds), shortest first. The longest window
            is the plan's included quota.
        weight: the share of a saturated provider's slots a user of the plan gets against
            a user of weight 1 (> 0; ``ProviderThrottle``'s ``weight``).
    """

    name: str
    windows: Windows
    weight: float = 1.0

    @property
    def longest_s(self) -> int:
        """The length of the plan's longest window (its quota period), seconds."""
        return max(seconds for _, seconds in self.windows)


#: Claim values whose resolution a ``Plans`` keeps (a deployment sees a handful).
MAX_KEPT_CLAIMS = 256


@dataclass(frozen=True)
class ResolvedPlan:
    """A user's plan for one request, and where it came from.

    Attributes:
        plan: the plan.
        source: ``override`` (an operator's), ``claim`` (the JWT claim) or ``default``.
        unknown_claim: a claim value that named no plan (then ``source`` is ``default``).
    """

    plan: Plan
    source: PlanSource
    unknown_claim: str | None = None


@dataclass(frozen=True)
class Plans:
    """Every plan of a deployment and its default.

    Attributes:
        by_name: the plans by name, in the order they were written.
        default: the name of the plan of a user with no override and no usable claim.

    Raises:
        InvalidArgument: there is no plan, or the default names none of them.
    """

    by_name: Mapping[str, Plan]
    default: str

    def __post_init__(self) -> None:
        if not self.by_name:
            raise InvalidArgument("ATTO_PLANS defines no plan")
        if self.default not in self.by_name:
            raise InvalidArgument(f"ATTO_DEFAULT_PLAN: {self.default!r} is not one of the "
                                  f"plans ({', '.join(self.by_name)})")

    @classmethod
    def single(cls, windows: Windows) -> Plans:
        """The one plan ``default`` with these windows (``ATTO_BUDGET`` alone)."""
        return cls({SINGLE_PLAN_NAME: Plan(SINGLE_PLAN_NAME, windows)}, SINGLE_PLAN_NAME)

    @classmethod
    def parse(cls, text: str, default: str | None = None) -> Plans:
        """Parse ``"free=100/1h,1000/30d;pro=400/1h,20000/30d"``.

        Args:
            text: ``NAME=WINDOWS`` items separated by ``;``.
            default: the default plan's name; None means the first plan written.

        Returns:
            The plans.

        Raises:
            InvalidArgument: an item is malformed, a name repeats, or the default is unknown.
        """
        plans: dict[str, Plan] = {}
        for item in text.split(";"):
            if not item.strip():
                continue
            name, sep, windows = item.partition("=")
            name = name.strip()
            if not sep or not _NAME.fullmatch(name):
                raise InvalidArgument(f"ATTO_PLANS: {item.strip()!r} is not NAME=WINDOWS "
                                      "(e.g. free=100/1h,1000/30d; names of letters, digits, "
                                      "_ . -)")
            if name in plans:
                raise InvalidArgument(f"ATTO_PLANS: the plan {name!r} is defined twice")
            setting = f"ATTO_PLANS ({name})"
            weight, windows = _weight(windows, setting)
            plans[name] = Plan(name, parse_windows(windows, setting=setting), weight)
        if not plans:
            raise InvalidArgument("ATTO_PLANS defines no plan")
        return cls(plans, default or next(iter(plans)))

    @property
    def default_plan(self) -> Plan:
        """The default plan."""
        return self.by_name[self.default]

    @property
    def longest_s(self) -> int:
        """The longest window of any plan, seconds (how long a charge can matter)."""
        return max(plan.longest_s for plan in self.by_name.values())

    def get(self, name: str | None) -> Plan | None:
        """The plan called ``name``, or None."""
        return self.by_name.get(name) if isinstance(name, str) else None

    def resolve(self, *, override: str | None = None, claim: object = None) -> ResolvedPlan:
        """A user's plan: the override, else the first claim value naming a plan, else the
        default.

        Args:
            override: the operator's override (a plan name), if any. An override naming a
                plan that no longer exists is skipped.
            claim: the claim's value: a string (one name, or API Gateway's flattened list
                ``"[a b]"``, or ``"a,b"``), a list of names, or None.

        Returns:
            The plan and its source; ``unknown_claim`` set when a claim named no plan.
        """
        chosen = self.get(override)
        if chosen is not None:
            return ResolvedPlan(chosen, "override")
        # the same few claim values come with every request: each is worked out once
        if claim is not None and not isinstance(claim, str):
            return self._from_claim(claim)
        known = self._by_claim.get(claim)
        if known is None:
            known = self._from_claim(claim)
            if len(self._by_claim) < MAX_KEPT_CLAIMS:
                self._by_claim[claim] = known
        return known

    @cached_property
    def _by_claim(self) -> dict[str | None, ResolvedPlan]:
        """Resolutions already made without an override, by the claim's value."""
        return {}

    def _from_claim(self, claim: object) -> ResolvedPlan:
        """The plan a claim's value names, else the default."""
        names = claim_names(claim)
        for name in names:
            found = self.get(name)
            if found is not None:
                return ResolvedPlan(found, "claim")
        unknown = " ".join(names)[:128] if names else None
        return ResolvedPlan(self.default_plan, "default", unknown_claim=unknown)


def claim_names(claim: object) -> list[str]:
    """The plan names a claim's value holds, in order.

    API Gateway's JWT authorizer hands an array claim (``cognito:groups``) to the function
    as one string, ``"[admins pro]"``; a list (a test event, another authorizer), a plain
    name and a comma-separated string are read too.
    """
    if claim is None:
        return []
    if isinstance(claim, str):
        text = claim.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        return [part for part in re.split(r"[\s,]+", text) if part]
    if isinstance(claim, Iterable):
        return [str(item).strip() for item in claim if str(item).strip()]
    return [str(claim)]
