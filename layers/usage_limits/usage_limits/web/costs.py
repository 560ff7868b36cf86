"""Costs computed from a route's validated request: ``require_tokens(cost=per_started(...))``.

A route whose work grows with its input declares the rule instead of a number:

    EMBED_COST = per_started(EmbeddingsIn, lambda body: sum(map(len, body.input)),
                             size=8_000, what="characters of input")

    @app.post("/v1/embeddings", dependencies=[Depends(require_tokens(cost=EMBED_COST))])
    async def embeddings(body: EmbeddingsIn) -> EmbeddingsOut: ...

The guard computes the cost from the route's own validated ``EmbeddingsIn`` after FastAPI has
validated the request, and reserves it through the same path as a fixed cost. ``rule`` is the
text the price list shows for the route (``"1 per started 8,000 characters of input"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..exceptions import InvalidArgument

ModelT = TypeVar("ModelT")


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class Cost(Generic[ModelT]):
    """Tokens computed from the route's validated request model.

    Attributes:
        model: the request model class the route takes (its body or query model); the guard
            finds the route's argument of this class.
        tokens: the cost of one validated request, a positive integer.
        rule: how the cost is computed, in words, as the price list shows it.

    Raises:
        InvalidArgument: ``model`` is not a class, ``tokens`` is not callable or ``rule`` is
            empty (at import time).
    """

    model: type[ModelT]
    tokens: Callable[[ModelT], int]
    rule: str

    def __post_init__(self) -> None:
        if not isinstance(self.model, type):
            raise InvalidArgument(f"Cost: model must be a class, not {self.model!r}")
        if not callable(self.tokens):
            raise InvalidArgument("Cost: tokens must be a callable taking the model")
        if not isinstance(self.rule, str) or not self.rule.strip():
            raise InvalidArgument("Cost: rule must be a non-empty description")

    def of(self, request: Any) -> int:
        """The cost of one validated request.

        Raises:
            InvalidArgument: ``request`` is not a ``model``, or the rule gave something
                other than a positive integer (a bug in the route's rule).
        """
        if not isinstance(request, self.model):
            raise InvalidArgument(f"Cost: expected a {self.model.__name__}, got "
                                  f"{type(request).__name__}")
        tokens = self.tokens(request)
        if not _positive(tokens):
            raise InvalidArgument(f"Cost {self.rule!r} gave {tokens!r}, not a positive integer")
        return tokens


def per_started(model: type[ModelT], measure: Callable[[ModelT], int], *, size: int,
                what: str, tokens: int = 1) -> Cost[ModelT]:
    """``tokens`` for every started ``size`` units that ``measure`` counts in the request.

    A request measuring 0 units still costs ``tokens`` (it is one call all the same).

    Args:
        model: the route's request model class.
        measure: units in one validated request (characters, items, ...), an integer >= 0.
        size: units per step, a positive integer.
        what: the unit in words, plural (``"characters of input"``).
        tokens: tokens per step, a positive integer.

    Returns:
        A ``Cost`` whose rule reads ``"<tokens> per started <size> <what>"``.

    Raises:
        InvalidArgument: ``size`` or ``tokens`` is not a positive integer.
    """
    if not _positive(size) or not _positive(tokens):
        raise InvalidArgument(f"per_started: size and tokens must be positive integers, "
                              f"got {size!r} and {tokens!r}")

    def cost(request: ModelT) -> int:
        units = measure(request)
        return tokens * max(1, -(-units // size))

    return Cost(model, cost, f"{tokens} per started {size:,} {what}")


def price(cost: int | Cost[Any]) -> int | str:
    """What the price list shows for a route: its fixed cost, or its rule in words."""
    return cost if isinstance(cost, int) else cost.rule
