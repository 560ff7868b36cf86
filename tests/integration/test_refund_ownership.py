"""A refund removes only the charge its own caller made, whenever it finally runs.

Two execution environments serve the same user: environment 1 talks to Redis through a
fault-injecting proxy, environment 2 directly. Each keeps its own pending refunds, as two
Lambda environments do. The client retries with the same ``Idempotency-Key`` after a 503.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import Depends

from local.lambda_events import http_event, invoke, lambda_loop
from local.redis_servers import RedisServer
from tests.faultproxy import Fault, FaultProxy, script_sha
from tests.metered import handler, metered_app
from usage_limits._scripts import script
from usage_limits.connection import redis_from_env
from usage_limits.web import (
    idempotency,
    refunds,
    require_tokens,
    runtime,
    settings,
)
from usage_limits.web.errors import REFUNDED, ProviderError

RESERVE = script_sha(script("budget_reserve").sha)
REFUND = script_sha(script("budget_refund").sha)


@dataclass
class Environment:
    """One execution environment: its own Redis client and its own pending refunds."""

    client: Any
    pending: list[Any] = field(default_factory=list)

    def enter(self) -> None:
        runtime.set_redis(self.client)
        refunds._pending[:] = self.pending

    def leave(self) -> None:
        self.pending = list(refunds._pending)
        refunds.clear()


@dataclass
class Fleet:
    handler: Any
    faulty: Environment
    direct: Environment
    proxy: FaultProxy
    current: Environment | None = None

    def call(self, env: Environment, method: str, path: str, **kwargs: Any) -> Any:
        """Serve one request in ``env``."""
        if self.current is not env:
            if self.current is not None:
                self.current.leave()
            env.enter()
            self.current = env
        return invoke(self.handler, http_event(method, path, **kwargs))

    def pending(self, env: Environment) -> int:
        """How many refunds ``env`` keeps."""
        return refunds.pending() if self.current is env else len(env.pending)

    def used(self, user: str) -> int:
        return int(self.call(self.direct, "GET", "/used", user=user).body["used"])


@pytest.fixture
def fleet(monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer,
          fault_proxy: FaultProxy, stored_answers: str) -> Iterator[Fleet]:
    """Two environments of one function; the first reaches Redis through the fault proxy."""
    monkeypatch.setenv("REDIS_URL", redis_server.url)
    monkeypatch.setenv("ATTO_BUDGET", "20/1h")
    monkeypatch.delenv("ATTO_ENV", raising=False)
    settings.cache_clear()
    idempotency.reset()
    # as production configures it (connection.py): one retry, a short socket timeout
    faulty = Environment(redis_from_env(url=fault_proxy.url, retries=1, socket_timeout_s=0.25))
    direct = Environment(redis_from_env(url=redis_server.url, retries=1, socket_timeout_s=2.0))
    app = metered_app("refund ownership test")

    @app.post("/upstream", dependencies=[Depends(require_tokens(cost=5))])
    async def upstream() -> None:
        raise ProviderError("the upstream failed")  # its message ends with REFUNDED

    with lambda_loop():
        yield Fleet(handler(app), faulty, direct, fault_proxy)
    runtime.set_redis(None)
    settings.cache_clear()
    idempotency.reset()
    refunds.clear()


def test_kept_refund_of_a_lost_reserve_spares_the_retry_served_elsewhere(fleet: Fleet) -> None:
    """A refund kept after a reserve that never reached Redis leaves another call's charge."""
    user, key = uuid.uuid4().hex, {"Idempotency-Key": uuid.uuid4().hex}
    fault = fleet.proxy.inject(Fault.DROP_COMMAND, match=RESERVE, times=2)  # and its re-send
    first = fleet.call(fleet.faulty, "POST", "/ok", body={}, user=user, headers=key)
    assert first.status == 503 and first.body["error"]["code"] == "limiter_unavailable"
    assert fault.hits == 2 and fleet.used(user) == 0
    retried = fleet.call(fleet.direct, "POST", "/ok", body={}, user=user, headers=key)
    assert retried.status == 200 and fleet.used(user) == 5
    # environment 1's next request (another user) runs its kept refund first
    fleet.call(fleet.faulty, "POST", "/ok", body={}, user=uuid.uuid4().hex)
    assert fleet.pending(fleet.faulty) == 0
    assert fleet.used(user) == 5  # the successful retry stays charged
    replay = fleet.call(fleet.direct, "POST", "/ok", body={}, user=user, headers=key)
    assert replay.status == 200 and replay.headers.get("idempotent-replayed") == "true"
    assert fleet.used(user) == 5


def test_kept_refund_of_a_lost_reply_removes_its_own_charge(fleet: Fleet) -> None:
    """A reserve that charged but lost its replies answers 503 saying it may have charged,
    and is refunded later, by its own nonce."""
    user, key = uuid.uuid4().hex, {"Idempotency-Key": uuid.uuid4().hex}
    fleet.proxy.inject(Fault.DROP_REPLY, match=RESERVE, times=2)
    first = fleet.call(fleet.faulty, "POST", "/ok", body={}, user=user, headers=key)
    assert first.status == 503 and fleet.used(user) == 5  # charged, but nobody knows
    assert first.body["error"]["charged"] == "unknown"
    assert "may have been charged" in first.body["error"]["message"]
    fleet.call(fleet.faulty, "POST", "/ok", body={}, user=uuid.uuid4().hex)
    assert fleet.used(user) == 0  # the kept refund found its own charge
    retried = fleet.call(fleet.direct, "POST", "/ok", body={}, user=user, headers=key)
    assert retried.status == 200 and fleet.used(user) == 5


def test_kept_middleware_refund_spares_a_later_charge_of_the_same_key(fleet: Fleet) -> None:
    """A failed request's refund that ran but lost its replies, kept and retried, removes
    nothing that another call charged under the same key in the meantime."""
    user, key = uuid.uuid4().hex, {"Idempotency-Key": uuid.uuid4().hex}
    fleet.proxy.inject(Fault.DROP_REPLY, match=REFUND, times=2)
    failed = fleet.call(fleet.faulty, "POST", "/fails", body={}, user=user, headers=key)
    assert failed.status == 502 and fleet.pending(fleet.faulty) == 1
    # the answer went out after the refund failed, and says so; RateLimit keeps the charge
    assert failed.body["error"]["charged"] == "unknown"
    assert "may still be charged" in failed.body["error"]["message"]
    assert failed.headers["ratelimit"].startswith('"1h";r=15;')
    assert fleet.used(user) == 0  # the refund did land; only its replies were lost
    retried = fleet.call(fleet.direct, "POST", "/ok", body={}, user=user, headers=key)
    assert retried.status == 200 and fleet.used(user) == 5
    fleet.call(fleet.faulty, "POST", "/ok", body={}, user=uuid.uuid4().hex)
    assert fleet.pending(fleet.faulty) == 0
    assert fleet.used(user) == 5


def test_a_502_whose_refund_did_not_finish_does_not_also_say_refunded(fleet: Fleet) -> None:
    """A provider_error whose refund lost its replies says the request may still be charged,
    and no longer also that its tokens were refunded."""
    user = uuid.uuid4().hex
    fleet.proxy.inject(Fault.DROP_REPLY, match=REFUND, times=2)
    failed = fleet.call(fleet.faulty, "POST", "/upstream", body={}, user=user)
    assert failed.status == 502 and failed.body["error"]["charged"] == "unknown"
    message = failed.body["error"]["message"]
    assert message.startswith("the upstream failed; ") and "may still be charged" in message
    assert REFUNDED not in message
    fleet.call(fleet.faulty, "POST", "/ok", body={}, user=uuid.uuid4().hex)  # the kept refund
    assert fleet.pending(fleet.faulty) == 0
