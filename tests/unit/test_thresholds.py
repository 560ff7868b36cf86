"""Usage-threshold settings: read once from the environment, passed to the script compactly."""

from __future__ import annotations

import struct

import pytest

from usage_limits.exceptions import InvalidArgument
from usage_limits.thresholds import (
    ATTO_USAGE_THRESHOLD_MARGIN,
    ATTO_USAGE_THRESHOLDS,
    Thresholds,
)


def test_defaults_are_80_and_100_with_a_margin_of_5() -> None:
    """Unset, the thresholds are 80% and 100% with 5 points of margin, as "80,100/5"."""
    assert Thresholds.from_env({}) == Thresholds((80, 100), 5)
    assert Thresholds.from_env({}).spec == "80,100/5"


def test_values_are_read_sorted_and_none_turns_them_off() -> None:
    """A list is sorted; ``none`` means no thresholds and an empty spec (nothing is sent)."""
    env = {ATTO_USAGE_THRESHOLDS: "100, 50,90", ATTO_USAGE_THRESHOLD_MARGIN: "0"}
    assert Thresholds.from_env(env).spec == "50,90,100/0"
    assert Thresholds.from_env({ATTO_USAGE_THRESHOLDS: "none"}).spec == ""


def test_the_script_reads_the_margin_then_the_thresholds_ascending_as_doubles() -> None:
    """The script's argument is the margin and the thresholds (ascending) as little-endian
    doubles, and empty without thresholds."""
    assert Thresholds((50, 90, 100), 3).script_arg == struct.pack("<4d", 3, 50, 90, 100)
    assert Thresholds((), 5).script_arg == b""


@pytest.mark.parametrize("env", [
    {ATTO_USAGE_THRESHOLDS: "80,eighty"}, {ATTO_USAGE_THRESHOLDS: "0,100"},
    {ATTO_USAGE_THRESHOLDS: "80,120"}, {ATTO_USAGE_THRESHOLDS: "80,80"},
    {ATTO_USAGE_THRESHOLD_MARGIN: "100"}, {ATTO_USAGE_THRESHOLD_MARGIN: "-1"},
    {ATTO_USAGE_THRESHOLD_MARGIN: "2.5"},
])
def test_bad_values_are_clear_errors(env: dict[str, str]) -> None:
    """A malformed or out-of-range value raises InvalidArgument naming the variable."""
    with pytest.raises(InvalidArgument, match="ATTO_USAGE_THRESHOLD"):
        Thresholds.from_env(env)
