"""Token budget without Redis: argument checks, script headers, reply decoding, exports."""

from __future__ import annotations

import re
import struct
from importlib import resources
from typing import Any

import pytest

import usage_limits
from usage_limits import CostExceedsLimit, InvalidArgument, TokenBudget, Window
from usage_limits.budget import _decode_reservation, _decode_usage

PLAN = [Window(limit=100, seconds=3600), Window(limit=1000, seconds=30 * 86400)]


class UntouchableRedis:
    """A client stand-in that fails the test if any command is sent."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"redis was touched: {name}")


def budget() -> TokenBudget:
    return TokenBudget(UntouchableRedis(), PLAN)  # type: ignore[arg-type]


def lua(name: str) -> str:
    return resources.files("usage_limits").joinpath("lua", f"{name}.lua").read_text()


@pytest.mark.parametrize("limit, seconds", [
    (0, 60), (-1, 60), (1.5, 60), (True, 60), ("10", 60),
    (10, 0), (10, -1), (10, 0.0001), (10, float("nan")), (10, float("inf")), (10, True),
])
def test_window_rejects_bad_limits_and_lengths(limit: Any, seconds: Any) -> None:
    """A window needs an integer limit >= 1 and a length of at least 1 ms."""
    with pytest.raises(InvalidArgument):
        Window(limit=limit, seconds=seconds)


def test_window_length_in_ms() -> None:
    """Window lengths are stored as whole milliseconds."""
    assert Window(limit=1, seconds=0.05).ms == 50
    assert Window(limit=1, seconds=30 * 86400).ms == 2_592_000_000


@pytest.mark.parametrize("windows", [
    [], [Window(1, 60), Window(5, 60)], [Window(1, 0.0101), Window(2, 0.0099)], [(10, 60)],
    Window(1, 60), "abc",
])
async def test_bad_plans_are_rejected(windows: Any) -> None:
    """Empty plans, two windows of one length and non-Window items are invalid."""
    with pytest.raises(InvalidArgument):
        TokenBudget(UntouchableRedis(), windows)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        await budget().reserve("u", "r", 1, windows=windows)


@pytest.mark.parametrize("kwargs", [
    dict(user_id="", request_id="r", cost=1),
    dict(user_id=None, request_id="r", cost=1),
    dict(user_id="u", request_id="", cost=1),
    dict(user_id="u", request_id="x" * 257, cost=1),
    dict(user_id="u", request_id="a\nb", cost=1),
    dict(user_id="u", request_id=b"r", cost=1),
    dict(user_id="u", request_id="r", cost=0),
    dict(user_id="u", request_id="r", cost=-3),
    dict(user_id="u", request_id="r", cost=1.0),
    dict(user_id="u", request_id="r", cost=True),
    dict(user_id="u", request_id="r", cost=1, route="a\x00b"),
    dict(user_id="u", request_id="r", cost=1, now_ms=-1),
    dict(user_id="u", request_id="r", cost=1, now_ms=1.5),
    dict(user_id="u", request_id="r", cost=1, windows=[]),
])
async def test_reserve_rejects_bad_arguments_before_redis(kwargs: dict[str, Any]) -> None:
    """Malformed reservations raise InvalidArgument without sending any command."""
    with pytest.raises(InvalidArgument):
        await budget().reserve(**kwargs)


async def test_cost_above_a_window_limit_is_a_clear_error() -> None:
    """A cost larger than any window's limit raises CostExceedsLimit, not a retry time."""
    with pytest.raises(CostExceedsLimit) as info:
        await budget().reserve("u", "r", 101)
    assert (info.value.cost, info.value.limit) == (101, 100)
    with pytest.raises(CostExceedsLimit):
        await budget().reserve("u", "r", 6, windows=[Window(5, 1), Window(50, 10)])


@pytest.mark.parametrize("call", [
    lambda b: b.refund("", "r", nonce="n"), lambda b: b.refund("u", "", nonce="n"),
    lambda b: b.refund("u", "\t", nonce="n"), lambda b: b.refund("u", "r", nonce=""),
    lambda b: b.refund("u", "r", nonce="a b"), lambda b: b.refund("u", "r", nonce=7),
    lambda b: b.settle("u", "r", -1, nonce="n"), lambda b: b.settle("u", "r", 1.5, nonce="n"),
    lambda b: b.settle("u", "", 1, nonce="n"), lambda b: b.settle("u", "r", 1, nonce="x" * 65),
    lambda b: b.reserve("u", "r", 1, nonce="a b"),
    lambda b: b.reserve("u", "r", 1, nonce="a\x7f"),
    lambda b: b.reserve("u", "r", 1, nonce="caf\u00e9"),
    lambda b: b.reserve("u", "r", 1, nonce="a\tb"),
    lambda b: b.usage(""), lambda b: b.usage("u", events=-1), lambda b: b.usage("u", events=1001),
    lambda b: b.usage("u", windows=[Window(1, 1), Window(2, 1)]),
])
async def test_refund_settle_usage_reject_bad_arguments_before_redis(call: Any) -> None:
    """Malformed refund, settle and usage calls raise InvalidArgument without any command."""
    with pytest.raises(InvalidArgument):
        await call(budget())


def test_reserve_arguments_follow_the_script_header() -> None:
    """The reservation's ARGV is now, cost and margin in one, the id, the charge's record,
    then the plan in one."""
    keys, args = budget()._reserve_call("alice", "req-1", 8, "/v1/structured", tuple(PLAN),
                                        1_000, "abcd")
    assert keys == ["ul:{u:alice}:log", "ul:{u:alice}:ev", "ul:{u:alice}:meta",
                    "ul:{u:alice}:pv"]
    assert args == [struct.pack("<3d", 1_000, 8, 60_000), "req-1", "8 abcd /v1/structured",
                    struct.pack("<4d", 3_600_000, 100, 2_592_000_000, 1_000)]


def test_a_held_reservation_sends_its_hold_as_a_fourth_number() -> None:
    """A provisional reservation sends now, cost, margin and the hold in ms; a hold that is
    not an integer in range is refused before Redis is touched."""
    _, args = budget()._reserve_call("alice", "req-1", 8, "", tuple(PLAN), 1_000, "abcd",
                                     hold_ms=35_000)
    assert args[0] == struct.pack("<4d", 1_000, 8, 60_000, 35_000)
    for bad in (-1, 1.5, True, 86_400_001):
        with pytest.raises(InvalidArgument):
            budget()._reserve_call("alice", "req-1", 8, "", tuple(PLAN), 1_000, "abcd",
                                   hold_ms=bad)


@pytest.mark.parametrize("name", ["budget_reserve", "budget_usage", "budget_refund",
                                  "budget_ent_load", "budget_ent_invalidate", "budget_hold"])
def test_scripts_name_every_key_and_argument_in_their_header(name: str) -> None:
    """Each script's header names every KEYS[i] and ARGV[i] it reads, copied into locals."""
    source = lua(name)
    header, body = source.split("]]", 1)
    for kind in ("KEYS", "ARGV"):
        used = set(re.findall(kind + r"\[(\d+)\]", body))
        for index in used:
            assert re.search(rf"^{kind}\[{index}\]\s+\w+", header, re.M), (name, kind, index)
    # every KEYS/ARGV read happens in the opening block of named locals
    rest = body.split("\n\n", 2)[2]
    assert "KEYS[" not in rest and "ARGV[" not in rest, name


def test_shared_window_code_is_pasted_into_both_scripts() -> None:
    """budget_reserve.lua and budget_usage.lua run the one copy of the window bookkeeping."""
    from usage_limits._scripts import script

    shared = lua("_budget_windows").split("]]\n", 1)[1].strip()
    for name in ("budget_reserve", "budget_usage"):
        source = script(name).source
        assert source.count(shared) == 1, name
        assert not re.search(r"^--#include", source, re.M), name


def test_reservation_decoding_picks_the_binding_window() -> None:
    """Admitted: the window with least room binds; rejected: the one with the longest wait."""
    plan = (Window(10, 1), Window(50, 60))
    ok = _decode_reservation([1, 0, 0, 8, 5900, 45, 60_100], 3, plan, "n")
    assert (ok.allowed, ok.duplicate, ok.remaining) == (True, False, 2)
    assert (ok.limit, ok.window_s) == (10, 1.0)
    assert ok.windows[1].remaining == 5 and ok.windows[1].resets_at == 60.1
    no = _decode_reservation([0, 7_000, 2, 8, 5900, 49, 60_100], 3, plan, "n")
    assert (no.allowed, no.retry_after_s, no.limit, no.window_s) == (False, 7.0, 50, 60.0)
    assert no.remaining == 1
    dup = _decode_reservation([2, 0, 0, 8, 5900, 45, 60_100], 3, plan, "n")
    assert dup.allowed and dup.duplicate


def test_usage_decoding_reads_events_with_spaces_in_routes() -> None:
    """Spend records decode to cost and route, and a route may contain spaces."""
    reply = [900, 7, 1000, b"r2", b"800", b"4 ab12cd34 GET /v1/salary", b"r1", b"700",
             b"3 ab12cd35 ", b"r0", b"600", None]
    usage = _decode_usage(reply, (Window(10, 1),))
    assert usage.windows[0].used == 7 and usage.now_ms == 900
    assert [(e.request_id, e.cost, e.route, e.at_ms) for e in usage.events] == [
        ("r2", 4, "GET /v1/salary", 800), ("r1", 3, "", 700), ("r0", 0, "", 600)]


def test_budget_names_are_exported_lazily() -> None:
    """The ledger's public names come from the package root."""
    from usage_limits import budget as module

    for name in ("TokenBudget", "Window", "Reservation", "Usage", "WindowUsage", "SpendEvent"):
        assert name in usage_limits.__all__
        assert getattr(usage_limits, name) is getattr(module, name)
