"""Error replies are classified by their kind, as redis-py parses them off the wire."""

from __future__ import annotations

import pytest
from redis._parsers.base import BaseParser

from usage_limits._scripts import BUG_KINDS, OUTAGE_KINDS, error_kind, is_script_bug

INSIDE = " script: 1a2b3c, on @user_script:40."


@pytest.mark.parametrize("reply,kind", [
    ("OOM command not allowed when used memory > 'maxmemory'." + INSIDE, "OOM"),
    ("READONLY You can't write against a read only replica." + INSIDE, "READONLY"),
    ("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
     "BUSY"),
    ("LOADING Redis is loading the dataset in memory", "LOADING"),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."
     + INSIDE, "MASTERDOWN"),
    ("CLUSTERDOWN The cluster is down" + INSIDE, "CLUSTERDOWN"),
    ("TRYAGAIN Multiple keys request during rehashing of slot" + INSIDE, "TRYAGAIN"),
    ("NOREPLICAS Not enough good replicas to write." + INSIDE, "NOREPLICAS"),
    ("MISCONF Errors writing to the AOF file: No space left on device" + INSIDE, "MISCONF"),
    ("ERR Error running script (call to f_1a2b): @user_script:40: @user_script: 40: "
     "-OOM command not allowed when used memory > 'maxmemory'.", "OOM"),
])
def test_outages_raised_inside_a_script_are_not_bugs(reply: str, kind: str) -> None:
    """OOM, READONLY, BUSY, LOADING and the rest are outages even with @user_script in them."""
    exc = BaseParser.parse_error(reply)
    assert error_kind(exc) == kind
    assert kind in OUTAGE_KINDS and not is_script_bug(exc)


@pytest.mark.parametrize("reply,kind", [
    ("ERR user_script:12: attempt to compare nil with number" + INSIDE, "ERR"),
    ("ERR Error running script (call to f_1a2b): @user_script:12: user_script:12: "
     "attempt to compare nil with number", "ERR"),
    ("WRONGTYPE Operation against a key holding the wrong kind of value" + INSIDE,
     "WRONGTYPE"),
    ("CROSSSLOT Keys in request don't hash to the same slot", "CROSSSLOT"),
])
def test_script_bugs_stay_errors(reply: str, kind: str) -> None:
    """A Lua runtime error, a key of the wrong type or keys on two slots are bugs."""
    exc = BaseParser.parse_error(reply)
    assert error_kind(exc) == kind and kind in BUG_KINDS and is_script_bug(exc)


def test_an_unknown_kind_fails_closed() -> None:
    """A kind the code does not know is treated as an outage (503), not as a bug (500)."""
    exc = BaseParser.parse_error("NEWKIND something this Redis version says" + INSIDE)
    assert error_kind(exc) == "NEWKIND" and not is_script_bug(exc)
