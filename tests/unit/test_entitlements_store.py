"""The DynamoDB entitlements store, against moto: keys, idempotency, voiding, audit order."""

from __future__ import annotations

import time
from collections.abc import Iterator

import boto3
import pytest
from moto import mock_aws

from usage_limits.entitlements import NotFound, StoreUnavailable
from usage_limits.entitlements.config import StoreSettings
from usage_limits.entitlements.store import EntitlementStore
from usage_limits.exceptions import InvalidArgument

DAY_MS = 86_400_000


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[EntitlementStore]:
    """A store on a fresh moto table."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        s = EntitlementStore(StoreSettings(table="entitlements", region="us-east-1"))
        s.create_table()
        yield s


def now_ms() -> int:
    return int(time.time() * 1000)


def test_a_user_never_seen_has_an_empty_record(store: EntitlementStore) -> None:
    """Loading an unknown user gives no override, no suspension and no grants."""
    record = store.load("nobody")
    assert (record.override, record.suspension, record.grants) == (None, None, ())
    assert store.audit("nobody") == []


def test_override_set_replace_and_clear(store: EntitlementStore) -> None:
    """An override is set, replaced by a second, and cleared; each change is audited."""
    store.set_override("u1", "pro", actor="arn:op", reason="upgrade")
    store.set_override("u1", "free", actor="arn:op", reason="downgrade")
    assert store.load("u1").override.plan == "free"  # type: ignore[union-attr]
    removed = store.clear_override("u1", actor="arn:op", reason="back to claim")
    assert removed is not None and removed.plan == "free"
    assert store.load("u1").override is None
    assert store.clear_override("u1", actor="arn:op", reason="again") is None
    assert [e.action for e in store.audit("u1")] == ["plan.clear", "plan.set", "plan.set"]


def test_grant_creation_is_idempotent_by_reference(store: EntitlementStore) -> None:
    """The same reference with the same terms returns the first grant and adds nothing; with
    other terms it is a GrantConflict naming both, and nothing is written."""
    from usage_limits.entitlements import GrantConflict

    first, created = store.create_grant("u2", tokens=500, kind="paid", reference="inv_1",
                                        expires_at_ms=None, actor="arn:op", reason="bought")
    again, created_again = store.create_grant("u2", tokens=500, kind="paid",
                                              reference="inv_1", expires_at_ms=None,
                                              actor="arn:op", reason="retry")
    assert (created, created_again) == (True, False) and again == first
    with pytest.raises(GrantConflict) as conflict:
        store.create_grant("u2", tokens=999, kind="promo", reference="inv_1",
                           expires_at_ms=None, actor="arn:op", reason="other terms")
    assert conflict.value.existing == first and conflict.value.asked["tokens"] == 999
    assert len(store.load("u2").grants) == 1 and store.load("u2").grants[0].tokens == 500
    assert [e.action for e in store.audit("u2")] == ["grant.create"]


def test_grants_are_per_user(store: EntitlementStore) -> None:
    """One reference used for two users makes one grant for each."""
    for user in ("a", "b"):
        _, created = store.create_grant(user, tokens=5, kind="promo", reference="camp",
                                        expires_at_ms=None, actor="op", reason="campaign")
        assert created


def test_void_grant_once_and_unknown_reference(store: EntitlementStore) -> None:
    """Voiding leaves nothing to draw; a second void changes nothing; an unknown one is 404."""
    store.create_grant("u3", tokens=50, kind="paid", reference="inv_2",
                       expires_at_ms=now_ms() + DAY_MS, actor="op", reason="bought")
    grant, voided = store.void_grant("u3", "inv_2", actor="op", reason="chargeback")
    assert voided and grant.voided is not None and grant.remaining == 0
    assert not grant.live(now_ms())
    _, again = store.void_grant("u3", "inv_2", actor="op", reason="again")
    assert not again
    with pytest.raises(NotFound):
        store.void_grant("u3", "nope", actor="op", reason="x")
    assert [e.action for e in store.audit("u3")] == ["grant.void", "grant.create"]


@pytest.mark.parametrize("kwargs, match", [
    ({"tokens": 0}, "tokens"),
    ({"tokens": True}, "tokens"),
    ({"kind": "gift"}, "kind"),
    ({"reference": "has space"}, "reference"),
    ({"expires_at_ms": 1000}, "future"),
    ({"reason": "  "}, "reason"),
])
def test_bad_grant_input_writes_nothing(store: EntitlementStore, kwargs: dict[str, object],
                                        match: str) -> None:
    """A malformed grant is refused with a clear message and nothing is written."""
    args: dict[str, object] = {"tokens": 10, "kind": "paid", "reference": "ok",
                               "expires_at_ms": None, "actor": "op", "reason": "r", **kwargs}
    with pytest.raises(InvalidArgument, match=match):
        store.create_grant("u4", **args)  # type: ignore[arg-type]
    assert store.load("u4").grants == () and store.audit("u4") == []


def test_suspension_with_end_and_lift(store: EntitlementStore) -> None:
    """A suspension records its reason and end; lifting removes it; both are audited."""
    until = now_ms() + DAY_MS
    store.suspend("u5", reason="abuse", until_ms=until, actor="op")
    suspension = store.load("u5").suspension
    assert suspension is not None and suspension.reason == "abuse"
    assert suspension.until_ms == until and suspension.active(now_ms())
    assert not suspension.active(until)
    lifted = store.lift_suspension("u5", actor="op", reason="appeal granted")
    assert lifted is not None and store.load("u5").suspension is None
    assert store.lift_suspension("u5", actor="op", reason="again") is None
    with pytest.raises(InvalidArgument, match="future"):
        store.suspend("u5", reason="x", until_ms=1, actor="op")


def test_audit_is_newest_first_per_user_and_across_users(store: EntitlementStore) -> None:
    """Each user's audit and the all-users audit list actions newest first, with who and why."""
    t = now_ms()
    store.set_override("x", "pro", actor="arn:alice", reason="r1", now_ms=t)
    store.suspend("y", reason="r2", until_ms=None, actor="arn:bob", now_ms=t + 1)
    store.set_override("x", "free", actor="arn:alice", reason="r3", now_ms=t + 2)
    everyone = store.audit()
    assert [(e.user_id, e.change.reason) for e in everyone] == \
        [("x", "r3"), ("y", "r2"), ("x", "r1")]
    assert everyone[1].change.actor == "arn:bob"
    assert [e.change.reason for e in store.audit("x", limit=1)] == ["r3"]
    assert store.audit("x")[0].details == {"plan": "free"}


def test_support_refund_is_made_once_with_its_audit_entry(store: EntitlementStore) -> None:
    """A support refund of a charge that drew nothing is recorded once with one audit
    entry; asking again returns the first refund."""
    done, created = store.refund_charge("u6", "r:abc", "n1", tokens=8, actor="op",
                                        reason="bad answer")
    assert created and (done.tokens, done.credit) == (8, ())
    again, created = store.refund_charge("u6", "r:abc", "n1", tokens=8, actor="op",
                                         reason="again")
    assert not created and again.tokens == 8
    assert [(e.action, e.details["tokens"]) for e in store.audit("u6")] == [("refund", 8)]


def test_support_refund_returns_a_charges_credit_with_its_audit(store: EntitlementStore) -> None:
    """A support refund gives back exactly what the charge drew, to its grants, in the
    same transaction as its record and audit entry; the charge record shows it returned."""
    _grant(store, "u9", "a", 10)
    epoch = store.bump_epoch("u9")
    assert store.commit_draw("u9", "r:1", "n1", [("a", 6)], epoch, cost=8) == "recorded"
    done, created = store.refund_charge("u9", "r:1", "n1", tokens=0, actor="op", reason="r")
    assert created and done.credit == (("a", 6),)
    assert store.load("u9").grants[0].consumed == 0
    [record] = store.charge_records("u9")
    assert (record.kept, record.state, record.returned) == (0, "returned", (("a", 6),))
    entry = store.audit("u9")[0]
    assert entry.action == "refund" and entry.details["credit"] == [{"reference": "a", "tokens": 6}]
    with pytest.raises(NotFound):
        store.refund_charge("u9", "r:2", "n2", tokens=0, actor="op", reason="r")


def test_a_support_refund_of_a_returned_charge_is_not_found(store: EntitlementStore) -> None:
    """A charge whose credit the request path already returned, and that no window counts,
    has nothing left to refund: NotFound, and nothing is written or audited."""
    _grant(store, "u10", "a", 10)
    epoch = store.bump_epoch("u10")
    assert store.commit_draw("u10", "r:1", "n1", [("a", 4)], epoch, cost=4) == "recorded"
    assert store.return_credit("u10", "r:1", "n1", 0).returned == (("a", 4),)
    with pytest.raises(NotFound):
        store.refund_charge("u10", "r:1", "n1", tokens=0, actor="op", reason="r")
    assert [e.action for e in store.audit("u10")] == ["grant.create"]
    assert store.support_refund("u10", "r:1") is None


def test_a_missing_table_is_store_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls to a table that does not exist raise StoreUnavailable, not a botocore error."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        s = EntitlementStore(StoreSettings(table="missing", region="us-east-1"))
        with pytest.raises(StoreUnavailable):
            s.load("u")


def test_store_uses_an_injected_client(store: EntitlementStore) -> None:
    """A client passed in is used as it is (custom wiring, tests)."""
    client = boto3.client("dynamodb", region_name="us-east-1")
    other = EntitlementStore(store.settings, client=client)
    store.set_override("u8", "pro", actor="op", reason="r")
    assert other.client is client and other.load("u8").override is not None


def _grant(store: EntitlementStore, user: str, reference: str, tokens: int) -> None:
    store.create_grant(user, tokens=tokens, kind="paid", reference=reference,
                       expires_at_ms=None, actor="op", reason="bought")


def test_each_load_epoch_is_new_and_load_ignores_it(store: EntitlementStore) -> None:
    """bump_epoch returns 1, 2, 3 for a user (others start at 1), and the epoch item is not
    mistaken for an entitlement."""
    assert store.epoch("e1") == 0
    assert [store.bump_epoch("e1") for _ in range(3)] == [1, 2, 3]
    assert store.bump_epoch("e2") == 1 and store.epoch("e1") == 3
    _grant(store, "e1", "inv", 10)
    record = store.load("e1")
    assert [g.reference for g in record.grants] == ["inv"] and record.override is None


def consumption_is_its_records(store: EntitlementStore, user: str) -> None:
    """For every grant: consumed = the sum of what its charge records still hold."""
    held: dict[str, int] = {}
    for record in store.charge_records(user):
        for reference, tokens in record.consumed.items():
            held[reference] = held.get(reference, 0) + tokens
    for g in store.load(user).grants:
        assert g.consumed == held.get(g.reference, 0), (g, held)


def test_a_draw_commits_once_under_its_epoch(store: EntitlementStore) -> None:
    """A draw under the current epoch raises each grant's consumed once; the same charge
    committed again (a retry after a lost answer) changes nothing and says recorded."""
    _grant(store, "d1", "a", 10)
    _grant(store, "d1", "b", 10)
    epoch = store.bump_epoch("d1")
    draws = [("a", 4), ("b", 2)]
    assert store.commit_draw("d1", "r:1", "n1", draws, epoch, cost=8) == "recorded"
    assert store.commit_draw("d1", "r:1", "n1", draws, epoch, cost=8) == "recorded"
    store.bump_epoch("d1")  # an answer lost, then an operator change, then the retry
    assert store.commit_draw("d1", "r:1", "n1", draws, epoch, cost=8) == "recorded"
    assert {g.reference: g.consumed for g in store.load("d1").grants} == {"a": 4, "b": 2}
    assert store.charge_record("d1", "r:1", "other") is None
    [record] = store.charge_records("d1")
    assert (record.draws, record.epoch, record.cost, record.kept) == (tuple(draws), epoch, 8, 8)
    consumption_is_its_records(store, "d1")


def test_only_charge_records_carry_the_time_to_live(store: EntitlementStore) -> None:
    """A charge record expires about DRAW_RECORD_DAYS after it was written (DynamoDB's time
    to live); the grant it drew from, and every other item, carries no expiry."""
    import time

    from usage_limits.entitlements.store import DRAW_RECORD_DAYS, TTL_ATTRIBUTE

    _grant(store, "d4", "a", 10)
    epoch = store.bump_epoch("d4")
    assert store.commit_draw("d4", "r:1", "n1", [("a", 3)], epoch, cost=3) == "recorded"
    items = store.client.scan(TableName=store.table)["Items"]
    carrying = {item["sk"]["S"].split("#")[0]: int(item[TTL_ATTRIBUTE]["N"])
                for item in items if TTL_ATTRIBUTE in item}
    assert set(carrying) == {"C"}, carrying
    assert abs(carrying["C"] - (time.time() + DRAW_RECORD_DAYS * 86400)) < 60


def test_a_draw_under_a_replaced_epoch_never_commits(store: EntitlementStore) -> None:
    """Once a load (or an operator change) took a new epoch, a draw made under the old one
    is refused as stale and writes nothing: no record, no consumption."""
    _grant(store, "d2", "a", 10)
    old = store.bump_epoch("d2")
    store.bump_epoch("d2")
    assert store.commit_draw("d2", "r:1", "n1", [("a", 5)], old, cost=5) == "stale"
    assert store.load("d2").grants[0].consumed == 0
    assert store.charge_records("d2") == []


def test_credit_comes_back_once_per_lowering_whatever_the_epoch(store: EntitlementStore) -> None:
    """A settle to 3 then a refund to 0 each give their credit back once, however often
    each is repeated and however many loads came between: a return is conditioned on the
    charge's record, never on the epoch."""
    _grant(store, "d3", "a", 10)
    epoch = store.bump_epoch("d3")
    assert store.commit_draw("d3", "k:x", "n1", [("a", 8)], epoch, cost=8) == "recorded"
    store.bump_epoch("d3")
    first = store.return_credit("d3", "k:x", "n1", 3)
    assert first.changed and first.returned == (("a", 5),)
    again = store.return_credit("d3", "k:x", "n1", 3)
    assert not again.changed and again.returned == ()
    assert store.load("d3").grants[0].consumed == 3
    store.bump_epoch("d3")
    assert store.return_credit("d3", "k:x", "n1", 0).returned == (("a", 3),)
    assert not store.return_credit("d3", "k:x", "n1", 0).changed
    assert store.load("d3").grants[0].consumed == 0
    consumption_is_its_records(store, "d3")


def test_a_lowering_takes_the_last_draw_back_first(store: EntitlementStore) -> None:
    """A charge of 10 that drew 3 then 4 (quota 3), settled to 6, gives 4 back to the grant
    drawn last; refunded, 3 more to the first."""
    _grant(store, "d6", "a", 10)
    _grant(store, "d6", "b", 10)
    epoch = store.bump_epoch("d6")
    assert store.commit_draw("d6", "r:1", "n1", [("a", 3), ("b", 4)], epoch,
                             cost=10) == "recorded"
    assert store.return_credit("d6", "r:1", "n1", 6).returned == (("b", 4),)
    assert store.return_credit("d6", "r:1", "n1", 4).returned == (("a", 2),)
    assert store.return_credit("d6", "r:1", "n1", 0).returned == (("a", 1),)
    assert {g.reference: g.consumed for g in store.load("d6").grants} == {"a": 0, "b": 0}
    consumption_is_its_records(store, "d6")


def test_credit_of_a_voided_or_expired_grant_is_forfeited(store: EntitlementStore) -> None:
    """A return to a grant voided (or expired) since the draw gives that part nothing back:
    it is forfeited on the record, stays consumed, and the other grant gets its part."""
    _grant(store, "d7", "a", 10)
    store.create_grant("d7", tokens=10, kind="promo", reference="soon", actor="op",
                       expires_at_ms=now_ms() + 60_000, reason="r")
    epoch = store.bump_epoch("d7")
    assert store.commit_draw("d7", "r:1", "n1", [("soon", 2), ("a", 3)], epoch,
                             cost=5) == "recorded"
    store.void_grant("d7", "a", actor="op", reason="charge-back")
    done = store.return_credit("d7", "r:1", "n1", 0, now_ms=now_ms() + 120_000)
    assert (done.returned, done.forfeited) == ((), (("a", 3), ("soon", 2)))
    assert {g.reference: g.consumed for g in store.load("d7").grants} == {"a": 3, "soon": 2}
    consumption_is_its_records(store, "d7")


def test_a_lowering_with_no_draw_writes_a_tombstone_the_draw_cannot_pass(
        store: EntitlementStore) -> None:
    """Lowering a charge whose draw is not recorded (its answer was lost) writes it off:
    the draw, arriving late, is refused as void and consumes nothing."""
    _grant(store, "d8", "a", 10)
    epoch = store.bump_epoch("d8")
    done = store.return_credit("d8", "r:1", "n1", 0)
    assert done.changed and not done.existed
    assert store.commit_draw("d8", "r:1", "n1", [("a", 5)], epoch, cost=5) == "void"
    assert store.load("d8").grants[0].consumed == 0
    assert not store.return_credit("d8", "r:1", "n1", 0).changed
    consumption_is_its_records(store, "d8")


@pytest.mark.parametrize("pairs, match", [
    ([], "at least one"),
    ([("a", 0)], "positive"),
    ([("a b", 1)], "reference"),
])
def test_a_malformed_draw_writes_nothing(store: EntitlementStore, pairs: list[tuple[str, int]],
                                         match: str) -> None:
    """Empty draws, non-positive amounts and bad references are refused before any write."""
    _grant(store, "d4", "a", 10)
    epoch = store.bump_epoch("d4")
    with pytest.raises(InvalidArgument, match=match):
        store.commit_draw("d4", "r:1", "n1", pairs, epoch, cost=5)
    with pytest.raises(InvalidArgument, match="nonce"):
        store.commit_draw("d4", "r:1", "n#1", [("a", 1)], epoch, cost=5)
    with pytest.raises(InvalidArgument, match="cost"):
        store.commit_draw("d4", "r:1", "n1", [("a", 3)], epoch, cost=2)
    assert store.charge_records("d4") == [] and store.load("d4").grants[0].consumed == 0


def test_a_draw_from_an_unknown_grant_is_store_unavailable(store: EntitlementStore) -> None:
    """A draw naming a grant the table does not hold is cancelled whole (nothing written)."""
    _grant(store, "d5", "a", 10)
    epoch = store.bump_epoch("d5")
    with pytest.raises(StoreUnavailable):
        store.commit_draw("d5", "r:1", "n1", [("a", 1), ("ghost", 1)], epoch, cost=2)
    assert store.charge_records("d5") == [] and store.load("d5").grants[0].consumed == 0


def test_credit_reports_are_kept_with_the_grant(store: EntitlementStore) -> None:
    """A draw that crossed "low" and "exhausted" keeps both on the grant, once."""
    _grant(store, "d9", "a", 5)
    epoch = store.bump_epoch("d9")
    assert store.commit_draw("d9", "r:1", "n1", [("a", 5)], epoch, cost=5,
                             reported={"a": "lx"}) == "recorded"
    assert store.load("d9").grants[0].reported == "lx"


class _Refusing:
    """A DynamoDB client whose next ``times`` transactions are refused with ``code``."""

    def __init__(self, client: object, code: str, times: int) -> None:
        self._client, self.code, self.times = client, code, times

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def transact_write_items(self, **kwargs: object) -> object:
        from botocore.exceptions import ClientError

        if self.times > 0:
            self.times -= 1
            if self.code == "TransactionConflict":
                items = kwargs["TransactItems"]
                assert isinstance(items, list)
                raise ClientError({"Error": {"Code": "TransactionCanceledException"},
                                   "CancellationReasons": [{"Code": self.code}] * len(items)},
                                  "TransactWriteItems")
            raise ClientError({"Error": {"Code": self.code}}, "TransactWriteItems")
        return self._client.transact_write_items(**kwargs)  # type: ignore[attr-defined]


@pytest.mark.parametrize("code", ["TransactionConflict", "ThrottlingException",
                                  "ProvisionedThroughputExceededException"])
def test_refused_operator_changes_write_nothing_and_can_be_repeated(
        store: EntitlementStore, code: str) -> None:
    """An operator change refused by DynamoDB (a conflicting transaction, throttling) raises
    StoreUnavailable with nothing written, not even its audit entry; repeated, it lands."""
    refusing = EntitlementStore(store.settings, client=_Refusing(store.client, code, 1))
    with pytest.raises(StoreUnavailable):
        refusing.create_grant("o1", tokens=5, kind="paid", reference="inv", expires_at_ms=None,
                              actor="op", reason="r")
    assert store.load("o1").grants == () and store.audit("o1") == []
    _, created = refusing.create_grant("o1", tokens=5, kind="paid", reference="inv",
                                       expires_at_ms=None, actor="op", reason="r")
    assert created and [e.action for e in store.audit("o1")] == ["grant.create"]


@pytest.mark.parametrize("code", ["TransactionConflict", "ThrottlingException"])
def test_refused_draws_and_returns(store: EntitlementStore, code: str) -> None:
    """On the request path a conflicting transaction is retried (the draw and the return
    land once); throttling raises StoreUnavailable with nothing written."""
    _grant(store, "o2", "a", 10)
    epoch = store.bump_epoch("o2")
    refusing = EntitlementStore(store.settings, client=_Refusing(store.client, code, 1))
    if code == "TransactionConflict":
        assert refusing.commit_draw("o2", "r:1", "n1", [("a", 4)], epoch, cost=4) == "recorded"
        refusing.client.times = 1
        assert refusing.return_credit("o2", "r:1", "n1", 0).returned == (("a", 4),)
    else:
        with pytest.raises(StoreUnavailable):
            refusing.commit_draw("o2", "r:1", "n1", [("a", 4)], epoch, cost=4)
        assert store.charge_records("o2") == []
        assert refusing.commit_draw("o2", "r:1", "n1", [("a", 4)], epoch, cost=4) == "recorded"
        refusing.client.times = 1
        with pytest.raises(StoreUnavailable):
            refusing.return_credit("o2", "r:1", "n1", 0)
        assert store.load("o2").grants[0].consumed == 4
        assert refusing.return_credit("o2", "r:1", "n1", 0).returned == (("a", 4),)
    assert store.load("o2").grants[0].consumed == 0
    consumption_is_its_records(store, "o2")
