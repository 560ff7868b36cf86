"""Usage thresholds: the shares of a window's limit whose crossing is reported once.

The reservation script detects a crossing itself (``lua/_budget_thresholds.lua``): it
knows each window's total before and after the charge, so a charge that crosses nothing
costs no extra round trip. A threshold is reported once, and again only after usage fell
below it by more than ``margin`` percentage points (or the user's keys expired).

Environment: ``ATTO_USAGE_THRESHOLDS`` (percents, comma-separated, default ``80,100``;
``none`` for no reports) and ``ATTO_USAGE_THRESHOLD_MARGIN`` (percentage points, default 5).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from .exceptions import InvalidArgument

ATTO_USAGE_THRESHOLDS = "ATTO_USAGE_THRESHOLDS"
ATTO_USAGE_THRESHOLD_MARGIN = "ATTO_USAGE_THRESHOLD_MARGIN"
DEFAULT_THRESHOLDS = (80, 100)
DEFAULT_MARGIN = 5


@dataclass(frozen=True)
class Thresholds:
    """Which crossings of a window's limit are reported.

    Attributes:
        percents: the thresholds, in percent of a window's limit (integers 1..100,
            ascending, distinct); empty for none.
        margin: how far below a reported threshold usage must fall before it can be
            reported again, in percentage points (integer 0..99).

    Raises:
        InvalidArgument: a threshold or the margin is out of range.
    """

    percents: tuple[int, ...] = DEFAULT_THRESHOLDS
    margin: int = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        ok = all(isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 100
                 for p in self.percents)
        if not ok or list(self.percents) != sorted(set(self.percents)):
            raise InvalidArgument(f"{ATTO_USAGE_THRESHOLDS}: thresholds must be distinct "
                                  f"integers 1..100, ascending, not {self.percents!r}")
        if (isinstance(self.margin, bool) or not isinstance(self.margin, int)
                or not 0 <= self.margin <= 99):
            raise InvalidArgument(f"{ATTO_USAGE_THRESHOLD_MARGIN}: the margin must be an "
                                  f"integer 0..99, not {self.margin!r}")

    @property
    def spec(self) -> str:
        """The thresholds and margin in short, ``"80,100/5"`` ('' for none)."""
        if not self.percents:
            return ""
        return ",".join(str(p) for p in self.percents) + f"/{self.margin}"

    @property
    def script_arg(self) -> bytes:
        """What the reservation script reads: the margin, then the thresholds ascending, as
        little-endian doubles (b'' for none), so that it parses no text on every charge."""
        if not self.percents:
            return b""
        return struct.pack(f"<{1 + len(self.percents)}d", self.margin, *self.percents)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Thresholds:
        """Read the thresholds from ``env`` (default ``os.environ``).

        Raises:
            InvalidArgument: a value is malformed or out of range.
        """
        env = os.environ if env is None else env
        text = env.get(ATTO_USAGE_THRESHOLDS, "").strip()
        margin_text = env.get(ATTO_USAGE_THRESHOLD_MARGIN, "").strip()
        try:
            if text.lower() == "none":
                percents: tuple[int, ...] = ()
            elif text:
                percents = tuple(sorted(int(p) for p in text.split(",")))
            else:
                percents = DEFAULT_THRESHOLDS
            margin = int(margin_text) if margin_text else DEFAULT_MARGIN
        except ValueError:
            raise InvalidArgument(
                f"{ATTO_USAGE_THRESHOLDS}={text!r} or {ATTO_USAGE_THRESHOLD_MARGIN}="
                f"{margin_text!r} is not a list of integer percents and an integer") from None
        return cls(percents=percents, margin=margin)


@cache
def configured() -> Thresholds:
    """The execution environment's thresholds, read once from the environment."""
    return Thresholds.from_env()
