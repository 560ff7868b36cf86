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

        Raises:
            LimiterUnavailable: Redis is unreachable, timed out, or refused the script.
        """
        try:
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                return await client.eval(self.source, len(keys), *keys, *args)
        except ResponseError as exc:
            if _is_script_bug(exc):
                raise  # a bug in the script or its arguments, not an outage
            raise LimiterUnavailable(f"redis refused {self.name}: {exc}") from exc
        except (RedisError, RedisClusterException) as exc:
            # RedisClusterException ("no node reachable") is not a RedisError.
            raise LimiterUnavailable(f"redis unavailable running {self.name}: {exc}") from exc
        except OSError as exc:  # socket errors that escaped the client's own wrapping
            raise LimiterUnavailable(f"redis unreachable running {self.name}: {exc}") from exc


def _is_script_bug(exc: ResponseError) -> bool:
    text = str(exc)
    return "user_script" in text or text.startswith("Error running script")


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
