"""The IETF ``RateLimit-Policy`` and ``RateLimit`` headers, parsed into data.

Atto Cloud sends one item per window of the user's plan, in token units (``atto-qu``)::

    RateLimit-Policy: "1h";q=100;w=3600;atto-qu="tokens", "30d";q=1000;w=2592000;atto-qu="tokens"
    RateLimit: "1h";r=92;t=3512, "30d";r=1476;t=2591912;atto-credit=484

``q`` is the window's quota, ``w`` its length in seconds, ``r`` what is left and ``t`` the
seconds until the oldest charge in that window leaves it. Credit pays beyond the quota (the
longest window), so that window's ``r`` counts the live credit too, and ``atto-credit``
gives the credit alone (only with entitlements on). The parser reads the structured
field lists of RFC 8941 (quoted or bare item names, integer, decimal, string or boolean
parameters) and skips what it cannot read rather than failing a call over a header.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

POLICY_HEADER = "RateLimit-Policy"
STATUS_HEADER = "RateLimit"
#: The vendor parameter of the quota's ``RateLimit`` item: the live credit, tokens.
CREDIT_PARAM = "atto-credit"

_ITEM = re.compile(r'\s*(?:"((?:[^"\\]|\\.)*)"|([A-Za-z*][A-Za-z0-9_.:%*/-]*))')
_PARAM = re.compile(
    r'\s*;\s*([a-z*][a-z0-9_.*-]*)(?:=(?:"((?:[^"\\]|\\.)*)"|(\?[01])|(-?[0-9.]+)|'
    r'([A-Za-z*][A-Za-z0-9_.:%*/-]*)))?')

ParamValue = int | float | str | bool


@dataclass(frozen=True)
class RateLimitWindow:
    """One window of the user's budget, as the last answer reported it.

    Attributes:
        name: the window's label (``"1h"``, ``"30d"``).
        limit: tokens allowed in the window (``q``), if the policy header gave it.
        window_s: the window's length in seconds (``w``), if given.
        remaining: tokens the window still admits (``r``), credit included for the quota,
            if the status header gave it.
        reset_s: seconds until the oldest charge leaves the window (``t``), if given.
        credit: the live credit counted in ``remaining`` (``atto-credit``): on the quota's
            window only, with entitlements on; else None.
    """

    name: str
    limit: int | None
    window_s: int | None
    remaining: int | None
    reset_s: int | None
    credit: int | None = None

    @property
    def quota_remaining(self) -> int | None:
        """Tokens left of the window's own quota (``remaining`` less the credit)."""
        if self.remaining is None:
            return None
        return max(0, self.remaining - (self.credit or 0))

    @property
    def used(self) -> int | None:
        """Tokens of the quota spent in the window, when ``limit`` and ``remaining`` are
        known."""
        left = self.quota_remaining
        if self.limit is None or left is None:
            return None
        return max(0, self.limit - left)

    @property
    def fraction_left(self) -> float | None:
        """``quota_remaining / limit`` (0.0 to 1.0) for a budget bar, when both are known."""
        left = self.quota_remaining
        if not self.limit or left is None:
            return None
        return max(0.0, min(1.0, left / self.limit))


@dataclass(frozen=True)
class RateLimitStatus:
    """Every window of the last answer's ``RateLimit-Policy`` and ``RateLimit`` headers.

    Attributes:
        windows: the windows in the order the server listed them (shortest first).
    """

    windows: tuple[RateLimitWindow, ...]

    def window(self, name: str) -> RateLimitWindow | None:
        """The window labelled ``name``, or None."""
        return next((w for w in self.windows if w.name == name), None)

    @property
    def remaining(self) -> int | None:
        """What the next call may spend, credit included: the least ``remaining`` of every
        window (the quota's counts the credit, which pays beyond it)."""
        known = [w.remaining for w in self.windows if w.remaining is not None]
        return min(known) if known else None

    @property
    def credit(self) -> int | None:
        """The live credit the answer reported (``atto-credit``), or None."""
        return next((w.credit for w in self.windows if w.credit is not None), None)

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> RateLimitStatus | None:
        """Parse the two headers of an answer; None when it has neither.

        Args:
            headers: the answer's headers (case-insensitive mapping, e.g. ``httpx.Headers``).

        Returns:
            The windows, joined by name across the two headers; None without headers.
        """
        policy = _get(headers, POLICY_HEADER)
        status = _get(headers, STATUS_HEADER)
        if policy is None and status is None:
            return None
        policies = dict(parse_list(policy or ""))
        statuses = dict(parse_list(status or ""))
        names = list(policies) + [n for n in statuses if n not in policies]
        windows = []
        for name in names:
            p, s = policies.get(name, {}), statuses.get(name, {})
            windows.append(RateLimitWindow(
                name=name, limit=_as_int(p.get("q")), window_s=_as_int(p.get("w")),
                remaining=_as_int(s.get("r")), reset_s=_as_int(s.get("t")),
                credit=_as_int(s.get(CREDIT_PARAM))))
        return cls(windows=tuple(windows))


def parse_list(value: str) -> list[tuple[str, dict[str, ParamValue]]]:
    """An RFC 8941 list of items with parameters: ``[(name, {param: value}), ...]``.

    An item that cannot be read is skipped (up to the next comma).

    Args:
        value: the header's value.

    Returns:
        The items in order.
    """
    items: list[tuple[str, dict[str, ParamValue]]] = []
    pos = 0
    while pos < len(value):
        match = _ITEM.match(value, pos)
        if not match:
            pos = _next_member(value, pos)
            continue
        name = _unescape(match.group(1)) if match.group(1) is not None else match.group(2)
        pos = match.end()
        params: dict[str, ParamValue] = {}
        while (param := _PARAM.match(value, pos)) is not None:
            key, quoted, boolean, number, token = param.groups()
            params[key] = (_unescape(quoted) if quoted is not None
                           else boolean == "?1" if boolean is not None
                           else _number(number) if number is not None
                           else token if token is not None else True)
            pos = param.end()
        rest = value[pos:].lstrip()
        if rest and not rest.startswith(","):
            pos = _next_member(value, pos)
            continue
        items.append((name, params))
        pos = _next_member(value, pos)
    return items


def _next_member(value: str, pos: int) -> int:
    comma = value.find(",", pos)
    return len(value) if comma < 0 else comma + 1


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def _number(text: str) -> int | float | str:
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


def _as_int(value: ParamValue | None) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _get(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        value = headers.get(name.lower())
    return value
