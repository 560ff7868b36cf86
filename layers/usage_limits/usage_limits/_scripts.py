"""Lua scripts: loaded once from ``lua/*.lua``, run by EVALSHA, reloaded on NOSCRIPT.

Works with ``redis.asyncio.Redis`` and ``redis.asyncio.cluster.RedisCluster``: every script
takes keys that share one hash tag, so the cluster client routes it to one node. When that
node does not know the script (restart, failover, SCRIPT FLUSH) the script is sent once in
full with EVAL, which also caches it there.
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from .exceptions import LimiterUnavailable

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    AnyRedis = Redis | RedisCluster


class LuaScript:
    """One script file, identified by its SHA1 and run atomically by Redis."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = _expand(_read(f"{name}.lua"))
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def __call__(self, client: AnyRedis, keys: list[str], args: list[Any]) -> Any:
        """Run the script; Redis errors become ``LimiterUnavailable``.

        An error reply is classified by its kind (``error_kind``), not by where it was
        raised: OOM, READONLY, BUSY and the like arrive from inside a script too.

        Raises:
            LimiterUnavailable: Redis is unreachable, timed out, or cannot serve the call
                (any error kind but those of ``BUG_KINDS``).
            redis.exceptions.ResponseError: a bug in the script or its arguments
                (``BUG_KINDS``: a Lua runtime error, a key of the wrong type, CROSSSLOT).
        """
        try:
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                return await client.eval(self.source, len(keys), *keys, *args)
        except ResponseError as exc:
            if is_script_bug(exc):
                raise  # a bug in the script or its arguments, not an outage
            raise LimiterUnavailable(
                f"redis refused {self.name} ({error_kind(exc)}): {exc}") from exc
        except (RedisError, RedisClusterException) as exc:
            # RedisClusterException ("no node reachable") is not a RedisError.
            raise LimiterUnavailable(f"redis unavailable running {self.name}: {exc}") from exc
        except OSError as exc:  # socket errors that escaped the client's own wrapping
            raise LimiterUnavailable(f"redis unreachable running {self.name}: {exc}") from exc


#: Error kinds that are mistakes in a script, its arguments or its keys: raised as they are.
#: ``ERR`` is what a Lua runtime error inside a script reports ("ERR user_script:12: ...").
BUG_KINDS = frozenset({"ERR", "WRONGTYPE", "CROSSSLOT"})
#: Error kinds known to mean "Redis cannot serve this now", wherever they are raised
#: (before the script, or by a command inside it): out of memory, a replica after a
#: failover, another script running, loading, a cluster or replication link down,
#: persistence failing. Every kind not in BUG_KINDS is treated the same way (fail closed).
OUTAGE_KINDS = frozenset({"OOM", "READONLY", "BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN",
                          "TRYAGAIN", "NOREPLICAS", "MISCONF", "NOTBUSY", "UNBLOCKED"})
# Redis 6 wraps an error raised inside a script: "ERR Error running script (call to f_..):
# @user_script:40: @user_script: 40: -OOM command not allowed ...". The inner kind counts.
_WRAPPED = re.compile(r"^(?:ERR )?Error running script\b.*?: -([A-Z]+)\b")


def error_kind(exc: BaseException) -> str:
    """The kind of a Redis error reply: its first word (``OOM``, ``READONLY``, ``ERR``, ...).

    redis-py keeps the first word as ``status_code`` for the kinds it maps to classes and
    leaves it in the message otherwise. An error that Redis 6 wrapped as "Error running
    script" has the kind of the error inside it.
    """
    text = str(exc)
    wrapped = _WRAPPED.match(text)
    if wrapped:
        return wrapped.group(1)
    code = getattr(exc, "status_code", None)
    if code:
        return str(code)
    return text.split(" ", 1)[0] if text else ""


def is_script_bug(exc: ResponseError) -> bool:
    """True for an error of a kind that a bug causes (``BUG_KINDS``), not an outage."""
    return error_kind(exc) in BUG_KINDS


_INCLUDE = re.compile(r"^--#include (\S+\.lua)\b.*$", re.MULTILINE)


def _read(filename: str) -> str:
    return resources.files(__package__).joinpath("lua", filename).read_text()


def _expand(source: str) -> str:
    """Paste every ``--#include file.lua`` line's file in its place (one level deep).

    Redis runs a script as one text; shared code lives in one file and is pasted into each
    script that needs it, so the scripts cannot drift apart.
    """
    return _INCLUDE.sub(lambda m: _read(m.group(1)).rstrip("\n"), source)


@cache
def script(name: str) -> LuaScript:
    """The shared ``LuaScript`` for ``lua/<name>.lua`` (read from disk once per process)."""
    return LuaScript(name)
