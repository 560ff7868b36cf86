"""Errors of the book, under the entitlements store's (one hierarchy)::

    UsageLimitError                   (usage_limits.exceptions)
     ├── InvalidArgument              bad input: nothing was written
     └── EntitlementError             (usage_limits.entitlements.exceptions)
          ├── StoreUnavailable        DynamoDB failed: whether a write landed is unknown
          └── ExtraRefused            an item committed with a transition failed its
                                      condition: nothing was written

A refused transition is not an error: the book answers it (``transfers.Result``).
"""

from __future__ import annotations

from ..entitlements.exceptions import EntitlementError


class ExtraRefused(EntitlementError):
    """An item the caller asked to commit with a transition (an audit entry, a support
    record) failed its condition; nothing was written.

    Attributes:
        index: which of the caller's items failed.
    """

    def __init__(self, index: int) -> None:
        super().__init__(f"the transition's extra item {index} failed its condition")
        self.index = index
