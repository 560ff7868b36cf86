"""A boto3 DynamoDB client that fails calls as told, for tests of the entitlements store.

The refusals are the shapes DynamoDB gives (``local.dynamodb.refusal``: a transaction
cancelled for a conflict, throttling, capacity, the service unavailable), raised as the
``ClientError`` botocore raises once its own retries are used up; ``lost`` runs the call
and then raises a read timeout (the write landed, its answer did not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError, ReadTimeoutError

from local.dynamodb import FAULT_KINDS, refusal

#: the fault kinds of the request-path model (``down`` there: throttled past every retry)
MODEL_KINDS = {"down": "throttle", "conflict": "conflict", "lost": "lost"}


@dataclass
class Armed:
    """``kind`` for the next ``times`` calls of ``operation``, after ``skip`` calls pass."""

    kind: str
    operation: str
    times: int = 1
    skip: int = 0


@dataclass
class FaultPlan:
    """The faults armed for the next calls, shared by every client that wraps with it.

    Attributes:
        armed: what is still to fail, first match first.
        met: (operation, kind) of every call that met a fault.
    """

    armed: list[Armed] = field(default_factory=list)
    met: list[tuple[str, str]] = field(default_factory=list)

    def arm(self, kind: str, operation: str = "transact_write_items", *, times: int = 1,
            skip: int = 0) -> None:
        """Fail the next ``times`` calls of ``operation`` as ``kind`` after ``skip`` pass.

        Raises:
            ValueError: ``kind`` is not one of ``local.dynamodb.FAULT_KINDS``.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {FAULT_KINDS}")
        self.armed.append(Armed(kind, operation, times, skip))

    def take(self, operation: str) -> str | None:
        """The fault of this call of ``operation``, or None."""
        for armed in self.armed:
            if armed.operation != operation:
                continue
            if armed.skip:
                armed.skip -= 1
                return None
            armed.times -= 1
            if armed.times <= 0:
                self.armed.remove(armed)
            self.met.append((operation, armed.kind))
            return armed.kind
        return None


class FaultyClient:
    """A boto3 DynamoDB client whose calls fail as ``plan`` says (then work again).

    ``fault`` is a shortcut kept for the model test: the next transaction fails as
    ``down`` (throttled), ``conflict`` or ``lost``.
    """

    def __init__(self, client: Any, plan: FaultPlan | None = None) -> None:
        self._client = client
        self.plan = plan or FaultPlan()

    @property
    def fault(self) -> str | None:
        return next((a.kind for a in self.plan.armed
                     if a.operation == "transact_write_items"), None)

    @fault.setter
    def fault(self, kind: str | None) -> None:
        self.plan.armed = [a for a in self.plan.armed if a.operation != "transact_write_items"]
        if kind is not None:
            self.plan.arm(MODEL_KINDS.get(kind, kind))

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._client, name)
        if not callable(real) or name.startswith("_") or name in ("meta", "exceptions"):
            return real

        def call(**kwargs: Any) -> Any:
            kind = self.plan.take(name)
            if kind is None:
                return real(**kwargs)
            if kind == "lost":
                real(**kwargs)
                raise ReadTimeoutError(endpoint_url="dynamodb")
            error = refusal(kind, len(kwargs.get("TransactItems") or ()))
            raise ClientError(error, _operation(name))
        return call


def _operation(method: str) -> str:
    """``transact_write_items`` -> ``TransactWriteItems``."""
    return "".join(part.title() for part in method.split("_"))
