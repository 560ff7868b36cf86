"""Costs computed from a validated request: ``per_started``, ``Cost`` and ``require_tokens``."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from pydantic import BaseModel

from usage_limits.exceptions import InvalidArgument
from usage_limits.web import require_tokens
from usage_limits.web.costs import Cost, per_started, price

embeddings_fn = importlib.import_module("functions.embeddings.app")
structured_fn = importlib.import_module("functions.structured.app")


class Batch(BaseModel):
    items: list[str]


@pytest.mark.parametrize(("units", "tokens"), [(0, 3), (1, 3), (10, 3), (11, 6), (30, 9)])
def test_per_started_charges_every_started_step(units: int, tokens: int) -> None:
    """``tokens`` per started ``size`` units, and one step for an empty request."""
    cost = per_started(Batch, lambda b: len(b.items), size=10, tokens=3, what="items")
    assert cost.of(Batch(items=["x"] * units)) == tokens
    assert cost.rule == "3 per started 10 items"


def test_rule_reads_with_thousands_separators() -> None:
    """The price list's rule writes big step sizes the way people read them."""
    assert per_started(Batch, len, size=8_000, what="characters").rule == (
        "1 per started 8,000 characters")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_per_started_refuses_a_bad_step_or_price(bad: Any) -> None:
    """Step size and tokens per step must be positive integers, checked at import time."""
    with pytest.raises(InvalidArgument):
        per_started(Batch, len, size=bad, what="items")
    with pytest.raises(InvalidArgument):
        per_started(Batch, len, size=1, tokens=bad, what="items")


def test_cost_refuses_another_model_and_a_non_positive_result() -> None:
    """A rule applied to the wrong object, or giving 0, is a bug reported as InvalidArgument."""
    zero = Cost(Batch, lambda b: 0, "nothing")
    with pytest.raises(InvalidArgument):
        zero.of(Batch(items=[]))
    with pytest.raises(InvalidArgument):
        per_started(Batch, len, size=1, what="items").of({"items": []})


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, None, "8"])
def test_require_tokens_refuses_what_is_neither_a_count_nor_a_cost(bad: Any) -> None:
    """require_tokens takes a positive integer or a Cost, nothing else."""
    with pytest.raises(InvalidArgument):
        require_tokens(cost=bad)


def test_price_is_the_number_or_the_rule() -> None:
    """The price list shows a fixed cost as its number and a computed one as its rule."""
    assert price(8) == 8
    assert price(embeddings_fn.COST) == "1 per started 8,000 characters of input"
    assert require_tokens(cost=embeddings_fn.COST).cost == embeddings_fn.COST.rule  # type: ignore[attr-defined]


@pytest.mark.parametrize(("texts", "tokens"), [
    (["one text"], 1), (["x"] * 64, 1), (["a" * 8_000] * 64, 64), (["a" * 8_000, "b"], 2)])
def test_embeddings_cost_follows_the_characters_of_input(texts: list[str], tokens: int) -> None:
    """Embeddings cost 1 token per started 8,000 characters of all the texts together."""
    assert embeddings_fn.COST.of(embeddings_fn.EmbeddingsIn(input=texts)) == tokens


def test_structured_cost_counts_the_prompt_and_the_compact_schema() -> None:
    """Structured output costs 8 per started 8,000 characters of prompt and compact schema."""
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    compact = '{"type":"object","properties":{"title":{"type":"string"}}}'
    small = structured_fn.StructuredIn(prompt="Summarise", schema=schema)
    assert structured_fn.input_chars(small) == len("Summarise") + len(compact)
    assert structured_fn.COST.of(small) == 8
    big = structured_fn.StructuredIn(prompt="p" * (8_001 - len(compact)), schema=schema)
    assert structured_fn.COST.of(big) == 16
