"""Usage records against a reference model: any order of puts, lowerings, re-sends and
lowerings that come before their put ends in the record the model predicts (moto)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from moto import mock_aws

from usage_limits.entitlements.usage import UsageRecord, lowered_state
from usage_limits.entitlements.usage_store import UsageSettings, UsageStore

T0 = 1_793_491_200_000
CHARGES = ("r1", "r2")
COST = 6


class RecordsMachine(RuleBasedStateMachine):
    """Two charges' records; the model keeps, per charge, whether its put landed, the
    lowest kept any lowering asked for, and that lowering's state and instant."""

    @initialize()
    def table(self) -> None:
        self.aws = mock_aws()
        self.aws.start()
        self.store = UsageStore(UsageSettings(table="usage-model", region="us-east-1"))
        self.store.create_table()
        self.model: dict[str, dict[str, Any]] = {
            rid: {"put": False, "kept": None, "state": None, "changed": None}
            for rid in CHARGES}
        self.clock = T0

    def teardown(self) -> None:
        if hasattr(self, "aws"):
            self.aws.stop()

    def record(self, rid: str) -> UsageRecord:
        return UsageRecord("u", rid, "n1", "POST /v1/x", "free", COST, COST, (("g", 2),),
                           "charged", T0 + CHARGES.index(rid))

    @rule(rid=st.sampled_from(CHARGES))
    def put(self, rid: str) -> None:
        """A put, first or re-sent: it makes the record only once."""
        created = self.store.put(self.record(rid))
        m = self.model[rid]
        assert created == (not m["put"] and m["kept"] is None)
        m["put"] = True

    @rule(rid=st.sampled_from(CHARGES), kept=st.integers(0, COST - 1),
          support=st.booleans())
    def lower(self, rid: str, kept: int, support: bool) -> None:
        """A settle, refund or support refund (or a re-send of one): moves kept down only."""
        self.clock += 1
        state = lowered_state(kept, support=support)
        moved = self.store.lower("u", rid, "n1", kept, state, self.clock)
        m = self.model[rid]
        assert moved == (m["kept"] is None or kept < m["kept"])
        if moved:
            m.update(kept=kept, state=state, changed=self.clock)

    @invariant()
    def records_match_the_model(self) -> None:
        if not hasattr(self, "store"):
            return
        for rid in CHARGES:
            got, m = self.store.get("u", rid, "n1"), self.model[rid]
            if not m["put"] and m["kept"] is None:
                assert got is None
                continue
            assert got is not None
            if m["put"]:
                fixed = self.record(rid)
                assert (got.route, got.cost, got.draws, got.at_ms) == (
                    fixed.route, fixed.cost, fixed.draws, fixed.at_ms)
            if m["kept"] is None:
                assert (got.kept, got.state, got.changed_ms) == (COST, "charged", None)
            else:
                assert (got.kept, got.state, got.changed_ms) == (
                    m["kept"], m["state"], m["changed"])


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


def test_records_follow_the_model() -> None:
    """Random puts and lowerings of two records, in any order and repeated, always leave
    each record as the reference model says."""
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(RecordsMachine, settings=settings(
        max_examples=15, stateful_step_count=10, deadline=None))
