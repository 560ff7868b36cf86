"""Contention on every DynamoDB call of the request path and the operator path: refused
transactions (``TransactionCanceledException``, TransactionConflict) and throttling
(``ThrottlingException``, ``ProvisionedThroughputExceededException``), which moto cannot
produce, injected at each call site, once (a transient refusal) and on every call until the
fault is lifted (a persistent one). Each answer must be true: a 503 that says what it
knows, or the change applied exactly once (after the caller repeats it), and the books
balance afterwards.

Real handlers (embeddings, admin), real Redis, moto DynamoDB; plan ``free`` has a 4-token
quota, so from the fifth 1-token request on every charge draws from the user's grant.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from local.emulator import EmulatorProcess
from local.lambda_events import http_event, invoke
from tests.dynamofaults import FaultPlan, FaultyClient
from tests.integration.test_credit_exactness import (  # noqa: F401  (patch: a fixture)
    books_balance,
    fail_once,
    fill_quota,
    patch,
    serve_until_kept_refunds_land,
)
from tests.integration.test_entitlements_hotpath import (  # noqa: F401  (env: a fixture)
    OPERATOR,
    admin,
    consumed,
    embed_one,
    env,
    grant,
    store,
)
from usage_limits.entitlements.store import EntitlementStore

#: "once": the next call is refused; "every": every call until the fault is lifted.
TIMES = {"once": 1, "every": 1000}
TRANSACTION_KINDS = ["conflict", "throttle", "capacity"]
READ_KINDS = ["throttle", "capacity"]  # a Query is never cancelled for a conflict

pytestmark = pytest.mark.parametrize("env", ["standalone"], indirect=True)


@pytest.fixture
def faults(patch: pytest.MonkeyPatch) -> Iterator[FaultPlan]:  # noqa: F811
    """Every entitlements store of the test reaches DynamoDB through one fault plan."""
    plan = FaultPlan()
    real = EntitlementStore.client

    def client(self: EntitlementStore) -> Any:
        inner = real.fget(self)  # type: ignore[attr-defined]
        if not isinstance(inner, FaultyClient):
            inner = self._client = FaultyClient(inner, plan)
        return inner

    patch.setattr(EntitlementStore, "client", property(client))
    yield plan
    plan.armed.clear()


def call(method: str, path: str, body: Any = None) -> Any:
    """An operator call through the admin function (any status)."""
    event = http_event(method, path, body=body, user=None)
    event["requestContext"]["authorizer"] = {"iam": {"userArn": OPERATOR}}
    return invoke(admin.handler, event)


def audited(user: str, action: str) -> int:
    return sum(1 for e in store().audit(user, limit=500) if e.action == action)


def standing(user: str, rid_suffix: str) -> int:
    """Credit still held by the user's charge whose id ends with ``rid_suffix``."""
    return sum(n for r in store().charge_records(user) if r.request_id.endswith(rid_suffix)
               for _, n in r.standing)


def cases(kinds: list[str]) -> list[Any]:
    return [pytest.param(kind, times, id=f"{kind}-{times}") for kind in kinds
            for times in TIMES]


# ----------------------------------------------------------------------- request path


@pytest.mark.parametrize("kind, times", cases(TRANSACTION_KINDS))
def test_commit_draw_refused(env: Any, emulator: EmulatorProcess, faults: FaultPlan,  # noqa: F811
                             kind: str, times: str) -> None:
    """The draw's transaction is refused: the request is served with its draw recorded,
    or answered 503 with nothing drawn (saying so when it knows), never both."""
    user = uuid.uuid4().hex
    grant(user, "inv", 100)
    fill_quota(user)
    faults.arm(kind, times=TIMES[times])
    res = embed_one(user, request_id="gw-r")
    faults.armed.clear()
    assert faults.met and faults.met[0] == ("transact_write_items", kind)
    after = embed_one(user)  # the environment's next request: kept refunds land first
    assert after.status == 200
    if res.status == 200:
        assert standing(user, "gw-r") == 1 and consumed(user) == {"inv": 2}
    else:
        assert res.status == 503 and res.headers.get("retry-after") == "1"
        message = res.body["error"]["message"]
        assert "nothing was charged" in message or "may have been charged" in message
        assert standing(user, "gw-r") == 0 and consumed(user) == {"inv": 1}
    if times == "every":
        assert res.status == 503  # every write refused: never served on an unrecorded draw
    books_balance(user)


@pytest.mark.parametrize("kind, times", cases(TRANSACTION_KINDS))
def test_return_credit_refused(env: Any, emulator: EmulatorProcess, faults: FaultPlan,  # noqa: F811
                               kind: str, times: str) -> None:
    """A failed request's return is refused: the answer is the provider's 502, the refund
    is kept, and the credit comes back exactly once when DynamoDB answers again."""
    user = uuid.uuid4().hex
    grant(user, "inv", 100)
    fill_quota(user)
    with pytest.MonkeyPatch.context() as upstream:
        fail_once(upstream)
        faults.arm(kind, times=TIMES[times], skip=1)  # the draw's transaction passes
        res = embed_one(user, request_id="gw-r")
    faults.armed.clear()
    assert res.status == 502
    assert ("transact_write_items", kind) in faults.met
    served = serve_until_kept_refunds_land(user)
    assert standing(user, "gw-r") == 0 and consumed(user) == {"inv": served}
    assert embed_one(user).status == 200  # nothing is returned twice
    assert consumed(user) == {"inv": served + 1}
    books_balance(user)


@pytest.mark.parametrize("kind, times", cases(READ_KINDS))
def test_load_refused(env: Any, emulator: EmulatorProcess, faults: FaultPlan, kind: str,  # noqa: F811
                      times: str) -> None:
    """The load of the user's copy is throttled: 503 "nothing was charged" and nothing is
    drawn; once DynamoDB answers the copy loads and shows DynamoDB's credit."""
    user = uuid.uuid4().hex
    grant(user, "inv", 100)  # the grant drops the copy: the next request loads it
    faults.arm(kind, "query", times=TIMES[times])
    res = embed_one(user)
    faults.armed.clear()
    assert faults.met == [("query", kind)] * len(faults.met) and faults.met
    assert res.status == 503 and "nothing was charged" in res.body["error"]["message"]
    fill_quota(user)
    assert embed_one(user).status == 200
    assert consumed(user) == {"inv": 1}
    books_balance(user)


# ---------------------------------------------------------------------- operator path


OPERATOR_KINDS = ["conflict", "throttle"]
OPERATOR_SITES: dict[str, tuple[str, str, Any]] = {
    # site: (method, path template, body)
    "refund_charge": ("POST", "/admin/v1/users/{user}/refunds",
                      {"request_id": "gw-r", "reason": "support"}),
    "grant": ("POST", "/admin/v1/users/{user}/grants",
              {"tokens": 50, "kind": "paid", "reference": "inv2", "reason": "top-up"}),
    "void": ("DELETE", "/admin/v1/users/{user}/grants/inv", {"reason": "chargeback"}),
    "plan": ("PUT", "/admin/v1/users/{user}/plan", {"plan": "pro", "reason": "upgrade"}),
    "suspend": ("PUT", "/admin/v1/users/{user}/suspension", {"reason": "review"}),
}
ACTIONS = {"refund_charge": "refund", "grant": "grant.create", "void": "grant.void",
           "plan": "plan.set", "suspend": "suspension.set"}


@pytest.mark.parametrize("site", list(OPERATOR_SITES))
@pytest.mark.parametrize("kind, times", cases(OPERATOR_KINDS))
def test_operator_change_refused(env: Any, emulator: EmulatorProcess, faults: FaultPlan,  # noqa: F811
                                 site: str, kind: str, times: str) -> None:
    """An operator change whose transaction is refused answers 503 store_unavailable with
    nothing changed, or is made; repeated until it answers, it is made exactly once, with
    one audit entry, and the books balance."""
    user = uuid.uuid4().hex
    grant(user, "inv", 100)
    fill_quota(user)
    assert embed_one(user, request_id="gw-r").status == 200  # a charge that drew 1
    method, path, body = OPERATOR_SITES[site]
    action = ACTIONS[site]
    before = audited(user, action)
    faults.arm(kind, times=TIMES[times])
    first = call(method, path.format(user=user), body)
    faults.armed.clear()
    assert ("transact_write_items", kind) in faults.met
    if first.status >= 300:
        assert first.status == 503 and first.body["error"]["code"] == "store_unavailable"
        assert first.headers.get("retry-after") == "1"
        assert audited(user, action) == before  # refused: nothing was changed
        again = call(method, path.format(user=user), body)
        assert again.status < 300, again.body
    if times == "every":
        assert first.status == 503
    assert audited(user, action) == before + 1
    record = store().load(user)
    if site == "refund_charge":
        assert standing(user, "gw-r") == 0 and consumed(user) == {"inv": 0}
    elif site == "grant":
        assert sorted(g.reference for g in record.grants) == ["inv", "inv2"]
    elif site == "void":
        assert record.grants[0].voided is not None
    elif site == "plan":
        assert record.override is not None and record.override.plan == "pro"
    else:
        assert record.suspension is not None
        return  # a suspended user's copy refuses everything; nothing to compare
    books_balance(user)
