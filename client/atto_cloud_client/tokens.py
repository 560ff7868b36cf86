"""Tokens from sign-in, and where they are kept: the ``TokenStore`` protocol and two stores.

``FileTokenStore`` writes a JSON file readable by its owner only (mode 0600, in a folder
of mode 0700 when it creates one), atomically: a crash never leaves half a file.
``MemoryTokenStore`` keeps them for the life of the process. An app with a keychain
implements the three methods of ``TokenStore`` over it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from .exceptions import SignInError

#: Where ``FileTokenStore.default()`` keeps the tokens (under ``$XDG_CONFIG_HOME``).
CONFIG_DIR_NAME = "atto-cloud"
XDG_CONFIG_HOME = "XDG_CONFIG_HOME"


@dataclass(frozen=True)
class TokenSet:
    """What the token endpoint gave.

    Attributes:
        access_token: the bearer token for Atto Cloud.
        refresh_token: gets new tokens without the browser; None if none was issued.
        id_token: the OpenID Connect ID token, if any.
        token_type: normally ``Bearer``.
        expires_at: Unix time the access token expires, if the server said.
        scope: the granted scopes, if the server said.
    """

    access_token: str
    refresh_token: str | None = None
    id_token: str | None = None
    token_type: str = "Bearer"
    expires_at: float | None = None
    scope: str | None = None

    def expires_within(self, seconds: float, *, now: float | None = None) -> bool:
        """Whether the access token expires in less than ``seconds`` (False if unknown)."""
        if self.expires_at is None:
            return False
        return self.expires_at - (time.time() if now is None else now) < seconds

    @classmethod
    def from_token_response(cls, body: dict[str, Any], *, now: float,
                            previous: TokenSet | None = None) -> TokenSet:
        """Tokens from a token endpoint's JSON answer (RFC 6749 section 5.1).

        A refresh answer without a new refresh token keeps the previous one (Cognito sends
        none), and without an ID token keeps the previous ID token.

        Raises:
            SignInError: the answer has no ``access_token``.
        """
        access = body.get("access_token")
        if not isinstance(access, str) or not access:
            raise SignInError("the token endpoint answered without an access_token")
        expires_in = body.get("expires_in")
        expires_at = (now + float(expires_in)
                      if isinstance(expires_in, int | float | str) and str(expires_in).strip()
                      and not isinstance(expires_in, bool) else None)
        return cls(
            access_token=access,
            refresh_token=body.get("refresh_token") or (previous.refresh_token if previous
                                                        else None),
            id_token=body.get("id_token") or (previous.id_token if previous else None),
            token_type=str(body.get("token_type") or "Bearer"),
            expires_at=expires_at, scope=body.get("scope"))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TokenSet:
        access, expires = obj.get("access_token"), obj.get("expires_at")
        if not isinstance(access, str):
            raise TypeError("no access_token")
        return cls(access_token=access, refresh_token=obj.get("refresh_token"),
                   id_token=obj.get("id_token"), scope=obj.get("scope"),
                   expires_at=float(expires) if isinstance(expires, int | float) else None,
                   token_type=str(obj.get("token_type") or "Bearer"))


class TokenStore(Protocol):
    """Where the app keeps its tokens."""

    def load(self) -> TokenSet | None:
        """The stored tokens, or None."""
        ...

    def save(self, tokens: TokenSet) -> None:
        """Replace the stored tokens."""
        ...

    def clear(self) -> None:
        """Forget the tokens (sign out)."""
        ...


class MemoryTokenStore:
    """Tokens kept in memory for the life of the process."""

    def __init__(self, tokens: TokenSet | None = None) -> None:
        self._tokens = tokens

    def load(self) -> TokenSet | None:
        return self._tokens

    def save(self, tokens: TokenSet) -> None:
        self._tokens = tokens

    def clear(self) -> None:
        self._tokens = None


class FileTokenStore:
    """Tokens in a JSON file only its owner can read (0600), replaced atomically.

    Args:
        path: the file. Its folder is created (mode 0700) when missing.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def default(cls) -> FileTokenStore:
        """``$XDG_CONFIG_HOME/atto-cloud/tokens.json`` (``~/.config`` without the variable)."""
        base = os.environ.get(XDG_CONFIG_HOME) or str(Path.home() / ".config")
        return cls(Path(base) / CONFIG_DIR_NAME / "tokens.json")

    def load(self) -> TokenSet | None:
        """The stored tokens; None when the file is missing or unreadable as tokens."""
        try:
            obj = json.loads(self.path.read_text())
            return TokenSet.from_json(obj) if isinstance(obj, dict) else None
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def save(self, tokens: TokenSet) -> None:
        """Write the tokens to a 0600 temporary file beside the target, then rename it."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tokens-", suffix=".tmp")
        try:
            if hasattr(os, "fchmod"):  # mkstemp makes 0600 already; say so, whatever the umask
                os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(tokens.to_json(), out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
