"""The fleet's heavy-user invariant itself: another user's LLM provider_busy outside the
excused fault windows fails it; inside them, or by another provider, it does not (no servers)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _fleet_check as check  # noqa: E402

HEAVY = "heavy-user"
PAUSE = {"fault": "upstream-429", "start": 100.0, "end": 101.0}
SLOW_UPSTREAM = {"fault": "upstream-latency", "start": 200.0, "end": 201.0}


def end(user: str, t0: float, *, code: str | None = None, provider: str | None = None,
        wait_ms: float | None = None) -> dict[str, Any]:
    """One answered invocation's record, as the fleet's processes write it."""
    return {"user": user, "route": "structured", "t0": t0, "t1": t0 + 0.5,
            "status": 503 if code else 200, "code": code, "provider": provider,
            "wait_ms": {} if wait_ms is None else {"llm": wait_ms}}


def test_light_user_refused_by_llm_outside_fault_windows_is_starved() -> None:
    """A light user's LLM provider_busy with no excusing fault around it is reported."""
    got = check.check_heavy_user([end("user-1", 50.0, code="provider_busy", provider="llm")],
                                 HEAVY, [PAUSE])
    assert [s["user"] for s in got["starved"]] == ["user-1"]
    assert got["provider_busy_by_user"] == {"user-1": {"llm": 1}}


def test_refusals_in_a_pause_window_by_other_providers_or_of_the_heavy_user_are_excused() -> None:
    """The 429 pause (and FAULT_AFTER_S after it), another provider, the heavy user itself:
    none of these counts against the heavy user; a fault that is not excusing does not hide."""
    ends = [end("user-1", 102.5, code="provider_busy", provider="llm"),
            end("user-2", 50.0, code="provider_busy", provider="search"),
            end(HEAVY, 50.0, code="provider_busy", provider="llm"),
            end("user-3", 200.5, code="provider_busy", provider="llm")]
    got = check.check_heavy_user(ends, HEAVY, [PAUSE, SLOW_UPSTREAM])
    assert [s["user"] for s in got["starved"]] == ["user-3"]
    assert got["excused_by_fault"] == {"upstream-429": 1}
    assert got["provider_busy_by_user"] == {HEAVY: {"llm": 1}, "user-1": {"llm": 1},
                                            "user-2": {"search": 1}, "user-3": {"llm": 1}}


def test_waits_are_split_between_the_heavy_user_and_the_others() -> None:
    """The heavy user's slot waits and the other users' are summarised apart, in ms."""
    ends = [end(HEAVY, 1.0, wait_ms=900.0), end(HEAVY, 2.0, wait_ms=1100.0),
            end("user-1", 3.0, wait_ms=100.0), end("user-2", 4.0)]
    got = check.check_heavy_user(ends, HEAVY, [])
    assert (got["heavy_calls"], got["light_calls"]) == (2, 1)
    assert got["light_wait_p95_ms"] == 100.0 and got["heavy_wait_p50_ms"] == 1000.0
    assert got["starved"] == []


def test_saturation_counts_the_seconds_at_nine_tenths_of_the_limit() -> None:
    """Ten calls in the first second and two in the second: one saturated second of two."""
    times = [i / 10 for i in range(10)] + [1.2, 2.0]
    got = check.saturation(times, (10.0, 1.0))
    assert (got["saturated_s"], got["seconds"]) == (1, 2)
    assert got["used_share"] == 0.6
