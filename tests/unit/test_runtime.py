"""The environment's singletons: one ledger per plan over the one Redis client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from usage_limits.web import runtime

FREE = ((100, 3600), (1000, 2_592_000))
PRO = ((400, 3600), (20_000, 2_592_000))


@pytest.fixture
def injected() -> Iterator[object]:
    """A stand-in client injected for the test (no command is sent)."""
    client = object()
    runtime.set_redis(client)
    yield client
    runtime.set_redis(None)


def test_each_plan_keeps_its_ledger_across_requests_of_other_plans(injected: object) -> None:
    """Users on different plans, served in turn, reuse their plan's ledger: none is rebuilt."""
    free, pro = runtime.get_budget(FREE), runtime.get_budget(PRO)
    assert free is not pro and free.redis is injected and pro.redis is injected
    for _ in range(3):
        assert runtime.get_budget(FREE) is free
        assert runtime.get_budget(PRO) is pro


def test_a_new_client_gets_new_ledgers(injected: object) -> None:
    """After the client changes, every plan's ledger is made again over the new client."""
    old = runtime.get_budget(FREE)
    runtime.set_redis(other := object())
    new = runtime.get_budget(FREE)
    assert new is not old and new.redis is other
