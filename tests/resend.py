"""A Redis client wrapper that runs scripts the way redis-py does after a lost reply.

``Resending(client)`` sends every EVALSHA/EVAL twice and returns the second reply, exactly
what redis-py's retry does when the first reply was lost (the first call did run). It also
records every script call, so a test can run one again later, as a command that was held
up in the network and arrives after the caller moved on (``replay``). Redis itself runs
every call: nothing about its behaviour is imitated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ScriptCall:
    """One script call as sent: the command name and its arguments."""

    command: str
    args: tuple[Any, ...]


class Resending:
    """Wraps an async Redis client; ``twice`` turns re-sending on and off."""

    def __init__(self, client: Any, *, twice: bool = True) -> None:
        self.client = client
        self.twice = twice
        self.calls: list[ScriptCall] = []

    async def evalsha(self, *args: Any) -> Any:
        return await self._run("evalsha", args)

    async def eval(self, *args: Any) -> Any:
        return await self._run("eval", args)

    async def _run(self, command: str, args: tuple[Any, ...]) -> Any:
        reply = await getattr(self.client, command)(*args)
        self.calls.append(ScriptCall(command, args))  # only calls that ran (not NOSCRIPT)
        if self.twice:
            reply = await getattr(self.client, command)(*args)
        return reply

    async def replay(self, call: ScriptCall) -> Any:
        """Run a recorded call once more, as a late duplicate; returns its reply."""
        return await getattr(self.client, call.command)(*call.args)

    def calls_of(self, script: Any) -> list[ScriptCall]:
        """Recorded calls of one ``LuaScript`` (by its SHA1 or its source)."""
        return [c for c in self.calls if c.args and c.args[0] in (script.sha, script.source)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)
