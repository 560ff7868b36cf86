"""The fleet's credit invariant itself: a killed request's draw still on its way is allowed,
any other gap between the copy and DynamoDB is a failure (no servers)."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _fleet_credit as credit  # noqa: E402

from usage_limits.entitlements.charges import ChargeRecord  # noqa: E402
from usage_limits.entitlements.models import Change, Grant  # noqa: E402

USER = "user-2"


class Operator:
    """What ``check_credit`` reads of the fleet's operator, over fixed data."""

    def __init__(self, consumed: int, charges: list[ChargeRecord], copy_left: int) -> None:
        grant = Grant(reference="inv", tokens=100, consumed=consumed, kind="paid",
                      expires_at_ms=None, created=Change("op", "why", 0))
        self.users = [USER]
        self.refunded: dict[str, set[str]] = defaultdict(set)
        self.suspensions: list[Any] = []
        self.log: list[dict[str, Any]] = []
        self.store = SimpleNamespace(load=lambda user: SimpleNamespace(grants=[grant]),
                                     charge_records=lambda user: charges)
        self._copy_left = copy_left

    def copy_credit(self, user: str) -> tuple[int, dict[str, str]]:
        return self._copy_left, {}


def ok(rid: str) -> dict[str, Any]:
    return {"user": USER, "rid": rid, "status": 200, "replayed": False}


def drawn(rid: str, tokens: int) -> ChargeRecord:
    return ChargeRecord(rid, "n1", cost=tokens, kept=tokens, draws=(("inv", tokens),),
                        at_ms=0)


def test_a_killed_requests_unrecorded_draw_is_on_its_way() -> None:
    """The copy drew 10 for a request whose process died before DynamoDB recorded it."""
    op = Operator(consumed=30, charges=[drawn("r1", 30)], copy_left=60)
    ledger = {USER: {"draws": {"r1": 30, "killed": 10}}}
    out = credit.check_credit(op, [ok("r1")], [{"user": USER, "rid": "killed"}], ledger)
    assert out["copy_differs"] == []
    assert out["killed_draws_on_the_way"] == 10
    assert credit.credit_ok(out)


@pytest.mark.parametrize(("killed", "copy_left"), [
    ([], 60),                                   # a draw lost with no killed request to own it
    ([{"user": USER, "rid": "killed"}], 70),    # the copy gave the killed draw back twice
    ([{"user": USER, "rid": "killed"}], 50),    # more missing than the killed draw
])
def test_any_other_gap_fails(killed: list[dict[str, Any]], copy_left: int) -> None:
    op = Operator(consumed=30, charges=[drawn("r1", 30)], copy_left=copy_left)
    ledger = {USER: {"draws": {"r1": 30, "killed": 10}}}
    out = credit.check_credit(op, [ok("r1")], killed, ledger)
    assert [d["copy"] for d in out["copy_differs"]] == [copy_left]
    assert not credit.credit_ok(out)


def test_a_killed_draw_dynamodb_recorded_is_not_on_its_way() -> None:
    """Recorded before the kill: DynamoDB already counts it, the copy must equal."""
    op = Operator(consumed=40, charges=[drawn("r1", 30), drawn("killed", 10)], copy_left=50)
    ledger = {USER: {"draws": {"r1": 30, "killed": 10}}}
    out = credit.check_credit(op, [ok("r1")], [{"user": USER, "rid": "killed"}], ledger)
    assert [d["copy"] for d in out["copy_differs"]] == [50]
