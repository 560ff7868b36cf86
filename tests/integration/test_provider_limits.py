"""Provider clients against a scripted loopback HTTP server and the real redis-server: a call
never outlives the request's deadline, and an upstream's Retry-After is bounded."""

from __future__ import annotations

import importlib
import json
import math
import time
import uuid
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from atto_providers.base import ProviderClient
from local.lambda_events import FakeContext, http_event, invoke
from local.redis_servers import RedisServer
from tests.httpstub import HttpStub, Reply
from tests.ledger import used
from usage_limits import deadline
from usage_limits.exceptions import ProviderBusy
from usage_limits.keys import provider_keys
from usage_limits.throttle import DEFAULT_MAX_PAUSE_S, DEFAULT_PAUSE_S
from usage_limits.web.errors import ProviderError

if TYPE_CHECKING:
    from tests.conftest import StartEnvironment

structured = importlib.import_module("functions.structured.app")

#: A body of 2 KB sent in 40 pieces, one every 0.25 s: 10 s in all, and never 0.25 s of
#: silence, so httpx's read timeout never fires.
TRICKLE = Reply(200, body=json.dumps({"text": "x" * 2000}).encode(), chunks=40, trickle_s=0.25)


def client_class(uid: str) -> type[ProviderClient]:
    """A provider client of its own name (so its throttle's keys are this test's)."""

    class Stub(ProviderClient):
        name: ClassVar[str] = f"stub{uid}"
        default_rate = "1000/s"
        default_burst = 10

    return Stub


async def test_trickling_body_is_cut_at_the_deadline(standalone_client: Any, uid: str) -> None:
    """A provider whose body trickles in is abandoned at the request's deadline: 502 timeout."""
    with HttpStub([TRICKLE]) as stub:
        client = client_class(uid)(stub.url, env={}, redis=standalone_client)
        with deadline.deadline_scope(1.0) as ends_at:
            with pytest.raises(ProviderError) as failed:
                await client.request("GET", "/slow")
            stopped_at = time.monotonic()
        assert "timed out" in str(failed.value)
        assert not stub.seen[0].completed  # it had not finished sending: we left it
        assert stopped_at <= ends_at + 0.5


def test_trickling_llm_answer_is_refunded(lambda_env: StartEnvironment,
                                          redis_server: RedisServer) -> None:
    """A structured request whose provider trickles past the deadline is a 502, refunded."""
    user = uuid.uuid4().hex
    with HttpStub([TRICKLE]) as stub:
        lambda_env({"REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h",
                    "LLM_BASE_URL": stub.url, "LLM_API_KEY": "k", "LLM_RATE": "1000/s"},
                   unset=("ATTO_ENV", "LLM_SECRET_ARN"))
        res = invoke(structured.handler, http_event(
            "POST", "/v1/structured", user=user,
            body={"prompt": "hi", "schema": {"type": "object"}}), FakeContext(timeout_s=2.0))
        assert res.status == 502, res.body
        assert res.body["error"]["code"] == "provider_error"
        assert not stub.seen[0].completed
    assert used(user) == 0


async def test_huge_retry_after_is_clamped(standalone_client: Any, uid: str) -> None:
    """``Retry-After: 1e9`` pauses the provider for at most the maximum pause, not decades."""
    with HttpStub([Reply(429, headers={"Retry-After": "1e9"})]) as stub:
        client = client_class(uid)(stub.url, env={}, redis=standalone_client)
        with pytest.raises(ProviderBusy) as busy:
            await client.request("GET", "/x")
    assert busy.value.retry_after_s <= DEFAULT_MAX_PAUSE_S
    [state] = provider_keys(client.name, "gcra")
    pause_until = float(await standalone_client.hget(state, "pause")) / 1000
    assert pause_until <= time.time() + DEFAULT_MAX_PAUSE_S + 1
    assert await standalone_client.pttl(state) <= (DEFAULT_MAX_PAUSE_S + 2) * 1000


async def test_max_pause_setting_bounds_the_pause(standalone_client: Any, uid: str) -> None:
    """``<PROVIDER>_MAX_PAUSE_S`` lowers the longest pause an upstream can impose."""
    with HttpStub([Reply(429, headers={"Retry-After": "600"})]) as stub:
        cls = client_class(uid)
        client = cls(stub.url, env={f"STUB{uid.upper()}_MAX_PAUSE_S": "5"},
                     redis=standalone_client)
        with pytest.raises(ProviderBusy) as busy, deadline.deadline_scope(3.0):
            await client.request("GET", "/x")
    assert busy.value.retry_after_s <= 5
    [state] = provider_keys(client.name, "gcra")
    assert float(await standalone_client.hget(state, "pause")) / 1000 <= time.time() + 5


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "soon", "-3", ""])
async def test_unreadable_retry_after_gets_the_default_pause(
        standalone_client: Any, uid: str, value: str) -> None:
    """A non-finite, negative or unreadable Retry-After pauses for the default, not a 500."""
    headers = {"Retry-After": value} if value else {}
    with HttpStub([Reply(429, headers=headers), Reply(200, body=b'{"ok": true}')]) as stub:
        client = client_class(uid)(stub.url, env={}, redis=standalone_client)
        before = time.time()
        assert await client.request("GET", "/x") == {"ok": True}
    [state] = provider_keys(client.name, "gcra")
    pause_until = float(await standalone_client.hget(state, "pause")) / 1000
    assert math.isfinite(pause_until)
    assert before + DEFAULT_PAUSE_S - 0.01 <= pause_until <= time.time() + DEFAULT_PAUSE_S
    assert stub.seen[1].at >= pause_until - 0.01  # the retry waited out the pause
