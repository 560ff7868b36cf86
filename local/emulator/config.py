"""Behaviour knobs: global defaults and one ``FamilyConfig`` per API family.

Families: ``llm`` (chat completions and embeddings), ``salary`` (Adzuna-style jobs and
salary data), ``search`` (Tavily- and Brave-style web search) and ``pages`` (job-listing
web pages). Configs are frozen; a change builds a new one (``updated``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

FAMILIES = ("llm", "salary", "search", "pages")

_UNITS = {"ms": 0.001, "s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0,
          "minute": 60.0, "h": 3600.0, "hour": 3600.0}
_RATE_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d*\.?\d*)\s*([a-z]*)\s*$")


class ConfigError(ValueError):
    """A knob with an unknown name or an invalid value."""


@dataclass(frozen=True)
class Rate:
    """At most ``limit`` units (requests or tokens) in any sliding window of ``window_s``."""

    limit: int
    window_s: float

    @classmethod
    def parse(cls, value: Any) -> Rate | None:
        """``"5/s"``, ``"300/m"``, ``"10/2s"``, ``"40000/min"``, a ``Rate``, a dict or ``None``.

        Raises:
            ConfigError: the text is not of that form, or the limit is not positive.
        """
        if value is None or value == "" or value == "none" or value == "unlimited":
            return None
        if isinstance(value, Rate):
            return value
        if isinstance(value, Mapping):
            return cls._checked(int(value["limit"]), float(value["window_s"]))
        match = _RATE_RE.match(str(value).lower())
        if not match or match.group(3) not in _UNITS or (match.group(2) == "" and
                                                         match.group(3) == ""):
            raise ConfigError(f"rate {value!r}: expected N/s, N/m, N/h or N/<seconds>s")
        count = float(match.group(2)) if match.group(2) else 1.0
        unit = _UNITS[match.group(3) or "s"]
        return cls._checked(int(match.group(1)), count * unit)

    @classmethod
    def _checked(cls, limit: int, window_s: float) -> Rate:
        if limit < 1 or not (window_s > 0 and math.isfinite(window_s)):
            raise ConfigError("a rate needs a limit >= 1 and a positive window")
        return cls(limit, window_s)

    def __str__(self) -> str:
        window = "s" if self.window_s == 1 else f"{self.window_s:g}s"
        return f"{self.limit}/{window}"


@dataclass(frozen=True)
class FamilyConfig:
    """How one API family behaves.

    Attributes:
        latency_ms: added to every response of the family.
        jitter_ms: a further uniform random delay in ``[0, jitter_ms]`` (seeded).
        failure_rate: probability that an admitted request fails (seeded).
        failure_status: status of those failures (500 by default).
        rate: requests admitted per sliding window; over it answers 429 + Retry-After.
        token_rate: LLM tokens admitted per sliding window (``llm`` only; prompt
            estimate plus ``max_tokens``).
        count_rejected: rejected (429) arrivals also fill the rate window, as some
            providers count them; by default only admitted requests do.
        require_auth: whether requests without credentials get the API's auth error.
    """

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    failure_rate: float = 0.0
    failure_status: int = 500
    rate: Rate | None = None
    token_rate: Rate | None = None
    count_rejected: bool = False
    require_auth: bool = True

    def updated(self, **knobs: Any) -> FamilyConfig:
        """A copy with ``knobs`` changed (validated).

        Raises:
            ConfigError: an unknown knob or an invalid value.
        """
        names = {f.name for f in fields(self)}
        unknown = set(knobs) - names
        if unknown:
            raise ConfigError(f"unknown knob(s): {', '.join(sorted(unknown))}; "
                              f"known: {', '.join(sorted(names))}")
        clean: dict[str, Any] = {}
        for name, value in knobs.items():
            try:
                if name in ("rate", "token_rate"):
                    clean[name] = Rate.parse(value)
                elif name in ("latency_ms", "jitter_ms"):
                    clean[name] = _non_negative(name, float(value))
                elif name == "failure_rate":
                    clean[name] = float(value)
                    if not 0.0 <= clean[name] <= 1.0:
                        raise ConfigError("failure_rate must be within [0, 1]")
                elif name == "failure_status":
                    clean[name] = int(value)
                    if not 400 <= clean[name] <= 599:
                        raise ConfigError("failure_status must be a 4xx or 5xx status")
                else:
                    clean[name] = _boolean(name, value)
            except (TypeError, ValueError, KeyError) as exc:
                if isinstance(exc, ConfigError):
                    raise
                raise ConfigError(f"{name}: invalid value {value!r}") from exc
        return replace(self, **clean)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready knobs (rates as text such as ``"5/s"``)."""
        out = asdict(self)
        out["rate"] = str(self.rate) if self.rate else None
        out["token_rate"] = str(self.token_rate) if self.token_rate else None
        return out


KNOBS = tuple(f.name for f in fields(FamilyConfig))


@dataclass(frozen=True)
class EmulatorConfig:
    """The whole emulator: a seed and one ``FamilyConfig`` per family."""

    seed: int = 0
    families: Mapping[str, FamilyConfig] = field(
        default_factory=lambda: {name: FamilyConfig() for name in FAMILIES})

    @classmethod
    def build(cls, *, seed: int = 0, families: Mapping[str, Mapping[str, Any]] | None = None,
              **knobs: Any) -> EmulatorConfig:
        """Global ``knobs`` applied to every family, then ``families`` per family.

        Raises:
            ConfigError: unknown family or knob, or an invalid value.
        """
        return cls(seed=int(seed)).updated(families=families, **knobs)

    def updated(self, *, families: Mapping[str, Mapping[str, Any]] | None = None,
                target: str | list[str] | None = None, seed: int | None = None,
                **knobs: Any) -> EmulatorConfig:
        """A copy: ``knobs`` applied to ``target`` (one or more families; all if ``None``),
        then each entry of ``families``.

        Raises:
            ConfigError: unknown family or knob, or an invalid value.
        """
        current = dict(self.families)
        for name in _targets(target):
            current[name] = current[name].updated(**knobs)
        for name, family_knobs in (families or {}).items():
            if name not in FAMILIES:
                raise ConfigError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
            current[name] = current[name].updated(**dict(family_knobs))
        return EmulatorConfig(seed=self.seed if seed is None else int(seed), families=current)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"seed": self.seed,
                "families": {name: cfg.as_dict() for name, cfg in self.families.items()}}


def _targets(target: str | list[str] | None) -> list[str]:
    if target is None or target == "all":
        return list(FAMILIES)
    names = [target] if isinstance(target, str) else list(target)
    for name in names:
        if name not in FAMILIES:
            raise ConfigError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    return names


def _non_negative(name: str, value: float) -> float:
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a non-negative number")
    return value


def _boolean(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be a boolean")
