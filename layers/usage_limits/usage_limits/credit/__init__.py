"""Money: every charge a transfer in DynamoDB, decided there and nowhere else.

- ``transfers``: the states, the events, the table of transitions (data) and ``apply``.
- ``legs``: which grants a charge draws from, and what comes back (pure).
- ``book``: ``TransferBook``, the DynamoDB book; every write generated from the table.
- ``request``: one request's transfer (reserve, then post or void) and the user's
  abandoned transfers; ``outbox``: the voids DynamoDB did not answer, retried later.

Importing this package imports no AWS code (boto3 loads on the book's first call).
"""

from __future__ import annotations

from . import outbox
from .book import (
    PENDING_INDEX,
    PENDING_SHARDS,
    TRANSFER_DAYS,
    Answer,
    Transfer,
    TransferBook,
    pending_shard,
    transfer_sk,
)
from .exceptions import ExtraRefused
from .legs import Back, Leg, balance, plan_legs
from .transfers import TRANSITIONS, Event, Result, State, Transition, apply

__all__ = [
    "PENDING_INDEX", "PENDING_SHARDS", "TRANSFER_DAYS", "TRANSITIONS", "Answer", "Back", "Event",
    "ExtraRefused", "Leg", "Result", "State", "Transfer", "TransferBook", "Transition", "apply",
    "balance", "outbox", "pending_shard", "plan_legs", "transfer_sk",
]
