"""Redis key names. Every key of one user (or one provider) shares a hash tag.

ElastiCache Serverless always runs in cluster mode, where a script may only touch keys of
one slot. Wrapping the owner in ``{...}`` makes every key of that owner hash to the same
slot, so one script can read and write all of them atomically.

Owner names are untrusted (user ids come from tokens and headers). A name made only of
``[A-Za-z0-9_.@|-]`` and at most 128 characters is used as it is, which keeps keys readable
for operators; anything else (braces, colons, spaces, newlines, very long ids) is replaced
by ``~`` and its SHA-256, so no input can reach another owner's keys or break the hash tag.
"""

from __future__ import annotations

import hashlib
import re

PREFIX = "ul"
_SAFE = re.compile(r"[A-Za-z0-9_.@|-]{1,128}")


def safe_name(name: str) -> str:
    """``name`` if it is safe inside a key, else ``~`` + its SHA-256 (hex)."""
    if _SAFE.fullmatch(name):
        return name
    return "~" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


def user_keys(user_id: str, *parts: str) -> list[str]:
    """Keys of one user, e.g. ``user_keys("alice", "log", "ev")``; all in one slot."""
    tag = f"{PREFIX}:{{u:{safe_name(user_id)}}}"
    return [f"{tag}:{part}" for part in parts]


def provider_keys(provider: str, *parts: str) -> list[str]:
    """Keys of one provider throttle; all in one slot."""
    tag = f"{PREFIX}:{{p:{safe_name(provider)}}}"
    return [f"{tag}:{part}" for part in parts]
