"""Errors of the entitlements store, under the package's one base class.

    UsageLimitError                       (usage_limits.exceptions)
     ├── InvalidArgument                  bad input: nothing was written
     └── EntitlementError
          ├── NotFound                    no such grant (or charge) for this user
          ├── GrantConflict               a grant reference reused with other terms
          ├── StoreUnavailable            DynamoDB unreachable, throttling or misconfigured
          └── NotRefreshed                a change is recorded, but the cache's copy of the
                                          user was not invalidated (repeat the change)

AWS client errors are re-raised as ``StoreUnavailable`` ``from`` the original, so callers
never need botocore to handle them.
"""

from __future__ import annotations

from ..exceptions import UsageLimitError


class EntitlementError(UsageLimitError):
    """Base class of the entitlements store's errors."""


class NotFound(EntitlementError):
    """The thing named does not exist for this user. Nothing was written."""


class GrantConflict(EntitlementError):
    """A grant's reference was used before with other terms (tokens, kind or expiry).
    Nothing was written: a top-up or an extension is a new grant with a new reference.

    Attributes:
        existing: the grant the reference names.
        asked: the terms asked for now (``tokens``, ``kind``, ``expires_at_ms``).
    """

    def __init__(self, message: str, *, existing: object, asked: dict[str, object]) -> None:
        super().__init__(message)
        self.existing = existing
        self.asked = asked


class StoreUnavailable(EntitlementError):
    """The durable store could not be reached or refused the call. Fail closed."""


class NotRefreshed(EntitlementError):
    """An operator change is committed, but the user's cached copy could not be invalidated
    (DynamoDB or Redis failed right after). Repeating the change (every change is
    idempotent) invalidates it."""
