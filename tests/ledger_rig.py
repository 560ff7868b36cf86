"""The ledger seen two ways, for the fault-proxy tests: a production-configured client that
reaches Redis through the fault proxy, and a direct one that shows what Redis really holds.

The faulty client re-sends once (``REDIS_RETRIES=1``), as in production: one fault is
absorbed by redis-py's re-send (the script may then run twice), two make the call fail.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from tests.faultproxy import Fault, FaultProxy, script_sha
from usage_limits import TokenBudget, Window
from usage_limits._scripts import script
from usage_limits.connection import redis_from_env

#: The faulty client's socket timeout, s: a delayed reply waits twice as long.
SOCKET_TIMEOUT_S = 0.25
#: Faults and whether the script ran on Redis before the client lost it.
RUNS = {Fault.DROP_COMMAND: False, Fault.CUT_COMMAND: False, Fault.DROP_REPLY: True,
        Fault.DELAY: True, Fault.CUT_REPLY: True, Fault.DUPLICATE: True}
#: (fault, times in a row): once is absorbed by the re-send, twice fails the call.
CASES = [(fault, times) for fault in Fault for times in (1, 2)
         if not (fault is Fault.DUPLICATE and times == 2)]  # a duplicate never fails a call
IDS = [f"{f.value}x{t}" for f, t in CASES]


@dataclass
class LedgerRig:
    """One user's ledger, faulty and direct."""

    faulty: TokenBudget  # through the proxy, configured as production
    direct: TokenBudget  # straight to Redis: what the ledger really holds
    proxy: FaultProxy
    user: str

    def arm(self, name: str, fault: Fault, times: int) -> None:
        """Inject ``fault`` into the next ``times`` calls of the script ``name``."""
        self.proxy.inject(fault, match=script_sha(script(name).sha), times=times,
                          delay_s=2 * SOCKET_TIMEOUT_S)


@asynccontextmanager
async def ledger_rig(rig: type[LedgerRig], port: int, proxy: FaultProxy,
                     plan: list[Window], **budget: Any) -> AsyncIterator[Any]:
    """A ``rig`` (LedgerRig or a subclass) for a fresh user over the redis-server on
    ``port`` and ``proxy`` to it; ``budget`` goes to both TokenBudgets."""
    faulty_client = redis_from_env(url=proxy.url, retries=1, socket_timeout_s=SOCKET_TIMEOUT_S)
    direct_client = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    try:
        yield rig(TokenBudget(faulty_client, plan, **budget),
                  TokenBudget(direct_client, plan, **budget), proxy, uuid.uuid4().hex)
    finally:
        proxy.clear()
        await faulty_client.aclose()
        await direct_client.aclose()
