"""The transfer book against a small reference model (Hypothesis stateful, moto): random
reservations, posts, voids, reversals, grants voided and expiring, holds running out, the
sweep, and faults (refused, conflicting, applied with the answer lost) followed by a re-send.

After every step: every grant's ``consumed`` equals its legs minus what came back to it,
no grant is overdrawn, every transfer's state is the model's, and no request id holds two
standing transfers of one nonce.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import boto3
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from moto import mock_aws

from tests.dynamofaults import FaultPlan, FaultyClient
from usage_limits.credit import Answer, Result, State, Transfer, TransferBook
from usage_limits.credit.legs import consumed_by, drawn, give_back, plan_legs
from usage_limits.entitlements import StoreUnavailable
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.models import Grant
from usage_limits.entitlements.store import EntitlementStore

USER = "model"
GRANTS = ("g0", "g1", "g2")
KINDS = ("lost", "throttle", "conflict")


@dataclass
class Model:
    """What the book should hold: each transfer's state and legs; grants as planned."""

    transfers: dict[str, Transfer] = field(default_factory=dict)
    voided_grants: set[str] = field(default_factory=set)


class BookMachine(RuleBasedStateMachine):
    """Drives one user's transfers through the book and checks it against the model."""

    def __init__(self) -> None:
        super().__init__()
        self.mock = mock_aws()
        self.mock.start()
        settings_ = StoreSettings(table="entitlements", region="us-east-1")
        self.plan = FaultPlan()
        raw = boto3.client("dynamodb", region_name="us-east-1")
        EntitlementStore(settings_, client=raw).create_table()
        client = FaultyClient(raw, self.plan)
        self.store = EntitlementStore(settings_, client=client)
        self.book = TransferBook(settings_, client=client)
        self.now = int(time.time() * 1000)
        self.model = Model()
        self.tokens = {"g0": 6, "g1": 8, "g2": 10}
        self.expiry = {"g0": self.now + 5_000, "g1": self.now + 60_000, "g2": None}
        for ref, tokens in self.tokens.items():
            self.store.create_grant(USER, tokens=tokens, kind="promo" if ref == "g1" else "paid",
                                    reference=ref, expires_at_ms=self.expiry[ref],
                                    actor="op", reason="model", now_ms=self.now)
        self.count = 0

    def teardown(self) -> None:
        self.mock.stop()

    # --- the model's own view -------------------------------------------------------------

    def grants(self) -> list[Grant]:
        return list(self.store.load(USER).grants)

    def live(self, ref: str) -> bool:
        exp = self.expiry[ref]
        return ref not in self.model.voided_grants and (exp is None or self.now < exp)

    def send(self, call: object, fault: str | None) -> Answer:
        """Call, with ``fault`` on its first write; a failed call is sent again."""
        assert callable(call)
        if fault is not None:
            self.plan.arm(fault, "transact_write_items")
            self.plan.arm(fault, "update_item")
        try:
            answer = call()
        except StoreUnavailable:
            self.plan.armed.clear()
            answer = call()
        self.plan.armed.clear()
        assert isinstance(answer, Answer)
        return answer

    # --- rules ------------------------------------------------------------------------------

    @rule(cost=st.integers(1, 12), quota=st.integers(0, 12),
          hold=st.sampled_from([50, 100_000]), fault=st.none() | st.sampled_from(KINDS))
    def reserve(self, cost: int, quota: int, hold: int, fault: str | None) -> None:
        """A reservation drawing ``cost - quota`` credit (none when the quota covers it)."""
        credit = max(0, cost - quota)
        rid = f"r{self.count}"
        self.count += 1
        expected = plan_legs(self.grants(), credit, self.now)
        answer = self.send(lambda: self.book.reserve(
            USER, rid, "n", reserved=cost, credit=credit, hold_ms=self.now + hold,
            now_ms=self.now), fault)
        if drawn(expected) < credit:
            assert answer.result is Result.EXCEEDS_CREDIT
            assert self.book.get(USER, rid, "n") is None
            return
        assert answer.ok and answer.transfer is not None
        assert answer.transfer.legs == expected
        self.model.transfers[rid] = answer.transfer

    def _pick(self, data: st.DataObject, state: State | None = None) -> Transfer | None:
        ids = sorted(r for r, t in self.model.transfers.items()
                     if state is None or t.state is state)
        return self.model.transfers[data.draw(st.sampled_from(ids))] if ids else None

    @precondition(lambda self: self.model.transfers)
    @rule(data=st.data(), fault=st.none() | st.sampled_from(KINDS))
    def post(self, data: st.DataObject, fault: str | None) -> None:
        """Post a transfer keeping part of its cost."""
        t = self._pick(data)
        if t is None:
            return
        kept = data.draw(st.integers(0, t.reserved))
        answer = self.send(lambda: self.book.post(t, kept, now_ms=self.now), fault)
        self._expect(t, answer, {
            State.PENDING: Result.EXPIRED if t.abandoned(self.now) else Result.APPLIED,
            State.POSTED: Result.EXISTS, State.VOIDED: Result.ALREADY_VOIDED,
            State.REVERSED: Result.EXISTS}[t.state], kept=kept)

    @precondition(lambda self: self.model.transfers)
    @rule(data=st.data(), fault=st.none() | st.sampled_from(KINDS))
    def void(self, data: st.DataObject, fault: str | None) -> None:
        """Void a transfer (a failed request)."""
        t = self._pick(data)
        if t is None:
            return
        answer = self.send(lambda: self.book.void(USER, t.request_id, "n", now_ms=self.now),
                           fault)
        self._expect(t, answer, {
            State.PENDING: Result.APPLIED, State.POSTED: Result.ALREADY_POSTED,
            State.VOIDED: Result.EXISTS, State.REVERSED: Result.ALREADY_REVERSED}[t.state])

    @precondition(lambda self: self.model.transfers)
    @rule(data=st.data(), fault=st.none() | st.sampled_from(KINDS))
    def reverse(self, data: st.DataObject, fault: str | None) -> None:
        """Support reverses a posted transfer."""
        t = self._pick(data, State.POSTED)
        if t is None:
            return
        answer = self.send(lambda: self.book.reverse(USER, t.request_id, "n",
                                                     now_ms=self.now), fault)
        self._expect(t, answer, Result.APPLIED)

    def _expect(self, t: Transfer, answer: Answer, result: Result, *, kept: int = 0) -> None:
        """The answer is ``result`` (``exists`` stands for ``applied`` after a lost answer),
        and the transfer moved as the model says."""
        assert answer.result is result or (result is Result.APPLIED
                                           and answer.result is Result.EXISTS), answer
        assert answer.transfer is not None
        if answer.transfer.state is not t.state:
            came_back = sum(b.returned + b.forfeited for b in answer.transfer.back) \
                - sum(b.returned + b.forfeited for b in t.back)
            target = answer.transfer.state
            if target is State.POSTED:
                assert answer.transfer.kept == kept
                assert came_back == drawn(give_back(t.legs, t.back, t.reserved - kept))
            else:
                assert came_back == t.credit_standing
        self.model.transfers[t.request_id] = answer.transfer

    @rule(ms=st.sampled_from([10, 100, 6_000]))
    def advance(self, ms: int) -> None:
        """Time passes: holds end, a grant expires."""
        self.now += ms

    @precondition(lambda self: len(self.model.voided_grants) < 2)
    @rule(ref=st.sampled_from(GRANTS))
    def void_grant(self, ref: str) -> None:
        """An operator voids a grant: its legs that come back later are forfeited."""
        self.store.void_grant(USER, ref, actor="op", reason="model", now_ms=self.now)
        self.model.voided_grants.add(ref)

    @rule()
    def sweep(self) -> None:
        """The sweep voids every pending transfer past its hold (and only those)."""
        abandoned = {r for r, t in self.model.transfers.items() if t.abandoned(self.now)}
        self.book.sweep(self.now)
        for rid in abandoned:
            stored = self.book.get(USER, rid, "n")
            assert stored is not None and stored.state is State.VOIDED
            self.model.transfers[rid] = stored

    # --- invariants -------------------------------------------------------------------------

    @invariant()
    def books_balance(self) -> None:
        """consumed = legs - returned per grant; 0 <= consumed <= tokens; states as modelled;
        nothing stands on a voided or reversed transfer; forfeits only from dead grants."""
        stored = {t.request_id: t for t in self.book.transfers(USER)}
        assert {r: t.state for r, t in stored.items()} == \
            {r: t.state for r, t in self.model.transfers.items()}
        consumed = consumed_by((t.legs, t.back) for t in stored.values())
        for grant in self.grants():
            expected = consumed.get(grant.reference, 0)
            assert grant.consumed == expected, grant
            assert 0 <= grant.consumed <= grant.tokens
        for t in stored.values():
            if t.state is State.VOIDED or t.state is State.REVERSED:
                assert t.credit_standing == 0  # every leg came back or was forfeited
            for b in t.back:  # only a grant voided or expired forfeits
                assert not b.forfeited or not self.live(b.grant)


BookMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=25,
                                         deadline=None)


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy credentials for moto."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


TestBookModel = BookMachine.TestCase
TestBookModel.__doc__ = "The book stays equal to its reference model under random steps."
