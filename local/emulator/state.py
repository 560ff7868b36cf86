"""What the emulator remembers: counters, rate windows, forced outcomes, seeded RNGs.

The server is one process with one event loop and every handler is ``async``, so these
plain objects are only ever touched by one coroutine at a time: counters are exact.
Rate windows run on ``time.monotonic()``; arrival timestamps in the stats are
``time.time()``.
"""

from __future__ import annotations

import math
import random
import time
from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from .config import FAMILIES, ConfigError, EmulatorConfig, FamilyConfig, Rate
from .dialects import FAILURE_KINDS

#: Arrival timestamps kept per family for the stats (the 1 s maximum is exact anyway).
MAX_TIMES = 200_000


class SlidingWindow:
    """A log of (time, weight) of what a rate admitted; O(1) amortised per call."""

    def __init__(self) -> None:
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def _expire(self, now: float, window_s: float) -> None:
        while self.events and self.events[0][0] <= now - window_s:
            self.total -= self.events.popleft()[1]

    def wait_s(self, now: float, rate: Rate, weight: int = 1) -> float:
        """0 if ``weight`` fits now, else the seconds until enough of the log expires
        (``math.inf`` if ``weight`` exceeds the limit itself)."""
        self._expire(now, rate.window_s)
        if self.total + weight <= rate.limit:
            return 0.0
        if weight > rate.limit:
            return math.inf
        excess = self.total + weight - rate.limit
        freed = 0
        for t, w in self.events:
            freed += w
            if freed >= excess:
                return max(t + rate.window_s - now, 1e-6)
        return rate.window_s  # not reached: total > limit only if the limit was lowered

    def add(self, now: float, weight: int = 1) -> None:
        self.events.append((now, weight))
        self.total += weight

    def usage(self, now: float, rate: Rate) -> tuple[int, float]:
        """(units in the window, seconds until the oldest leaves)."""
        self._expire(now, rate.window_s)
        reset = self.events[0][0] + rate.window_s - now if self.events else 0.0
        return self.total, max(reset, 0.0)


@dataclass(frozen=True)
class Decision:
    """What happens to one arrival before its handler runs.

    Attributes:
        outcome: ``ok``, ``forced`` (a queued forced response), ``rate`` or ``tokens``
            (over a rate limit), ``random`` (failure_rate), ``too_large`` (a request
            above the token limit itself).
        status: the HTTP status when not ``ok``.
        retry_after_s: exact seconds for Retry-After, or ``None``.
        delay_s: latency to add before answering.
        kind: the named failure of a forced outcome (``dialects.FAILURE_KINDS``), or "".
    """

    outcome: str
    status: int = 200
    retry_after_s: float | None = None
    delay_s: float = 0.0
    message: str = ""
    rate: Rate | None = None
    kind: str = ""


class FamilyState:
    """Counters and limits of one API family."""

    def __init__(self, name: str, config: FamilyConfig, seed: int) -> None:
        self.name = name
        self.config = config
        self.reseed(seed)
        self.clear()

    def reseed(self, seed: int) -> None:
        self.rng_fail = random.Random(f"fail:{seed}:{self.name}")
        self.rng_jitter = random.Random(f"jitter:{seed}:{self.name}")

    def clear(self) -> None:
        self.arrivals = 0
        self.status_counts: Counter[int] = Counter()
        self.routes: Counter[str] = Counter()
        self.injected = 0
        self.arrival_times: deque[float] = deque(maxlen=MAX_TIMES)
        self.served_times: deque[float] = deque(maxlen=MAX_TIMES)
        self._recent: deque[float] = deque()
        self.max_arrivals_1s = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.fail_next: deque[dict[str, Any]] = deque()
        self.spike_next: deque[dict[str, Any]] = deque()
        self.requests = SlidingWindow()
        self.tokens = SlidingWindow()

    # -- per request -----------------------------------------------------------------

    def arrive(self, route: str) -> float:
        """Count an arrival; returns its ``time.time()`` stamp."""
        stamp = time.time()
        self.arrivals += 1
        self.routes[route] += 1
        self.arrival_times.append(stamp)
        self._recent.append(stamp)
        while self._recent[0] <= stamp - 1.0:
            self._recent.popleft()
        self.max_arrivals_1s = max(self.max_arrivals_1s, len(self._recent))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return stamp

    def decide(self, token_cost: int = 0) -> Decision:
        """Forced outcome, rate limits, then random failure, in that order.

        Args:
            token_cost: LLM tokens the request reserves (checked against ``token_rate``).
        """
        cfg = self.config
        delay = cfg.latency_ms / 1000
        if cfg.jitter_ms:
            delay += self.rng_jitter.uniform(0, cfg.jitter_ms) / 1000
        if self.spike_next:
            spike = self.spike_next[0]
            delay += spike["latency_ms"] / 1000
            spike["remaining"] -= 1
            if spike["remaining"] <= 0:
                self.spike_next.popleft()
        if self.fail_next:
            forced = self.fail_next[0]
            forced["remaining"] -= 1
            if forced["remaining"] <= 0:
                self.fail_next.popleft()
            self.injected += 1
            return Decision("forced", forced["status"], forced.get("retry_after_s"), delay,
                            forced.get("message", ""), kind=forced.get("kind", ""))
        now = time.monotonic()
        if cfg.rate is not None:
            wait = self.requests.wait_s(now, cfg.rate)
            if wait > 0:
                if cfg.count_rejected:
                    self.requests.add(now)
                return Decision("rate", 429, wait, delay, rate=cfg.rate)
        if cfg.token_rate is not None and token_cost > 0:
            wait = self.tokens.wait_s(now, cfg.token_rate, token_cost)
            if wait > 0:
                if cfg.rate is not None and cfg.count_rejected:
                    self.requests.add(now)
                return Decision("too_large" if math.isinf(wait) else "tokens", 429,
                                None if math.isinf(wait) else wait, delay,
                                rate=cfg.token_rate)
        if cfg.rate is not None:
            self.requests.add(now)
        if cfg.token_rate is not None and token_cost > 0:
            self.tokens.add(now, token_cost)
        if cfg.failure_rate and self.rng_fail.random() < cfg.failure_rate:
            self.injected += 1
            return Decision("random", cfg.failure_status, None, delay)
        return Decision("ok", 200, None, delay)

    def finish(self, status: int, stamp: float) -> None:
        self.in_flight -= 1
        self.status_counts[status] += 1
        if 200 <= status < 300:
            self.served_times.append(stamp)

    def rate_headroom(self) -> tuple[int, int, float] | None:
        """(limit, remaining, seconds to reset) of the request rate, if one is set."""
        rate = self.config.rate
        if rate is None:
            return None
        used, reset = self.requests.usage(time.monotonic(), rate)
        return rate.limit, max(rate.limit - used, 0), reset

    # -- reporting -------------------------------------------------------------------

    def stats(self, window_s: float, include_times: bool) -> dict[str, Any]:
        counts = self.status_counts
        out: dict[str, Any] = {
            "arrivals": self.arrivals,
            "served": sum(n for s, n in counts.items() if 200 <= s < 300),
            "rate_limited": counts.get(429, 0),
            "failures": sum(n for s, n in counts.items() if s >= 500),
            "client_errors": sum(n for s, n in counts.items() if 400 <= s < 500 and s != 429),
            "redirects": sum(n for s, n in counts.items() if 300 <= s < 400),
            "injected": self.injected,
            "status_counts": {str(s): n for s, n in sorted(counts.items())},
            "routes": dict(sorted(self.routes.items())),
            "max_arrivals_1s": self.max_arrivals_1s,
            "max_served_1s": max_in_window(self.served_times, 1.0),
            "max_arrivals_window": max_in_window(self.arrival_times, window_s),
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "first_arrival": self.arrival_times[0] if self.arrival_times else None,
            "last_arrival": self.arrival_times[-1] if self.arrival_times else None,
            "config": self.config.as_dict(),
            "pending": {"fail_next": [dict(f) for f in self.fail_next],
                        "spike_next": [dict(s) for s in self.spike_next]},
        }
        if self.name == "llm":
            out["tokens"] = {"prompt": self.prompt_tokens, "completion": self.completion_tokens}
        if include_times:
            out["arrival_times"] = list(self.arrival_times)
            out["served_times"] = list(self.served_times)
        return out


def max_in_window(times: Any, window_s: float) -> int:
    """Most timestamps in any half-open window ``[t, t + window_s)``."""
    ordered = sorted(times)
    best = 0
    for j, t in enumerate(ordered):
        i = bisect_left(ordered, t - window_s + 1e-9, 0, j + 1)
        # ordered[i..j] lie within (t - window_s, t]: a window of length window_s.
        best = max(best, j - i + 1)
    return best


class EmulatorState:
    """All families, the current and the start-up configuration."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.initial = config
        self.config = config
        self.started_at = time.time()
        self.sequence = 0
        self.families = {name: FamilyState(name, config.families[name], config.seed)
                         for name in FAMILIES}

    def next_id(self) -> int:
        self.sequence += 1
        return self.sequence

    def apply(self, config: EmulatorConfig) -> None:
        reseed = config.seed != self.config.seed
        self.config = config
        for name, fam in self.families.items():
            fam.config = config.families[name]
            if reseed:
                fam.reseed(config.seed)

    def reset(self, *, keep_config: bool = False) -> None:
        if not keep_config:
            self.config = self.initial
        self.sequence = 0
        for name, fam in self.families.items():
            fam.config = self.config.families[name]
            fam.reseed(self.config.seed)
            fam.clear()

    def force(self, kind: str, spec: dict[str, Any], targets: list[str]) -> None:
        """Queue forced outcomes (``fail_next``) or latency spikes (``spike_next``).

        Raises:
            ConfigError: an invalid specification.
        """
        try:
            count = int(spec.get("count", 1))
            if count < 1:
                raise ConfigError(f"{kind}.count must be >= 1")
            if kind == "fail_next":
                failure = spec.get("kind")
                if failure is not None and failure not in FAILURE_KINDS:
                    raise ConfigError(f"fail_next.kind {failure!r}; known: "
                                      f"{', '.join(FAILURE_KINDS)}")
                status = int(spec.get("status", FAILURE_KINDS.get(failure, 500)))
                if failure is not None and status != FAILURE_KINDS[failure]:
                    raise ConfigError(f"fail_next.kind {failure!r} answers "
                                      f"{FAILURE_KINDS[failure]}, not {status}")
                if failure is None and not 400 <= status <= 599:
                    raise ConfigError("fail_next.status must be a 4xx or 5xx status")
                entry: dict[str, Any] = {"remaining": count, "status": status}
                if failure is not None:
                    entry["kind"] = failure
                retry = spec.get("retry_after_s")
                if retry is None and status == 429 and failure is None:
                    retry = 1
                if retry is not None:
                    entry["retry_after_s"] = float(retry)
                if spec.get("message"):
                    entry["message"] = str(spec["message"])
            else:
                entry = {"remaining": count, "latency_ms": float(spec["latency_ms"])}
        except (TypeError, ValueError, KeyError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{kind}: invalid specification {spec!r}") from exc
        for name in targets:
            queue = self.families[name].fail_next if kind == "fail_next" else \
                self.families[name].spike_next
            queue.append(dict(entry))

    def stats(self, *, window_s: float = 1.0, include_times: bool = True) -> dict[str, Any]:
        return {
            "now": time.time(),
            "started_at": self.started_at,
            "seed": self.config.seed,
            "window_s": window_s,
            "families": {name: fam.stats(window_s, include_times)
                         for name, fam in self.families.items()},
        }
