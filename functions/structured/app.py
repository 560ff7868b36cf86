"""POST /v1/structured: a JSON answer valid for the caller's JSON Schema.

Priced by size, 8 tokens per started 8,000 characters of prompt and schema (the schema
counted as compact JSON): both go to the model, whose price grows with its input; the
prompt alone may be 1 or 32,000 characters.
"""

from __future__ import annotations

import usage_limits.coldstart  # noqa: F401  (first: no GC while loading; see its docstring)

# isort: split
import json
from typing import Any

from fastapi import Depends
from pydantic import BaseModel, ConfigDict, Field, field_validator

from atto_providers.llm import llm_client
from atto_providers.patterns import check_schema, check_schema_patterns, validator_for
from usage_limits.web import METERED_RESPONSES, create_app, lambda_handler, require_tokens
from usage_limits.web.costs import per_started

app = create_app("Atto Cloud: structured output")

#: Objects and arrays a schema may nest (about 30 levels of properties). Validating a much
#: deeper schema exhausts Python's recursion limit: a 500 instead of a 422.
MAX_SCHEMA_DEPTH = 64


class StructuredIn(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    prompt: str = Field(min_length=1, max_length=32_000, description="What to answer.")
    json_schema: dict[str, Any] = Field(alias="schema", description="JSON Schema of the answer.")
    model: str | None = Field(default=None, min_length=1, max_length=100,
                              description="Provider model; the deployment's default if omitted.")

    @field_validator("json_schema")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        from jsonschema import SchemaError

        if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        try:
            check_schema(schema)  # its meta-schema, with no caller regex on ``re``
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from exc
        check_schema_patterns(schema)  # regexes RE2 can run in linear time, else a 422
        check_references(schema)
        return schema


#: The keywords that refer to another part of a schema.
REFERENCE_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


def check_references(schema: dict[str, Any]) -> None:
    """Refuse, before any charge, a schema whose references could never be checked.

    Only references inside the schema itself (``#...``) that resolve to a schema are
    allowed, and the schema must not loop without end: otherwise the provider would be
    called and its answer could not be validated (a 502, refunded, so repeatable for free).
    The lookups run in a registry that holds the schema alone (``validator_for``).

    Raises:
        ValueError: a remote, dangling or endless reference, or one to a non-schema.
    """
    from referencing import Registry
    from referencing.exceptions import Unresolvable

    refs = [(keyword, node[keyword]) for node in _nodes(schema) if isinstance(node, dict)
            for keyword in REFERENCE_KEYWORDS if isinstance(node.get(keyword), str)]
    if not refs:
        return
    validator = validator_for(schema, Registry())
    for keyword, ref in refs:
        if not ref.startswith("#"):
            raise ValueError(f"{keyword} {ref[:100]!r} points outside the schema; only local "
                             "references (#/...) are allowed")
        try:
            target = validator._resolver.lookup(ref).contents  # no public lookup
        except Unresolvable as exc:
            raise ValueError(f"{keyword} {ref[:100]!r} does not resolve within the "
                             "schema") from exc
        if not isinstance(target, (dict, bool)) or (isinstance(target, dict)
                                                    and "$schema" in target):
            raise ValueError(f"{keyword} {ref[:100]!r} does not point to a subschema")
    try:
        validator.is_valid(None)  # a probe: a reference loop with no end recurses forever
    except (RecursionError, Unresolvable) as exc:
        raise ValueError("the schema's references loop without end") from exc


def _nodes(value: Any) -> list[Any]:
    out, stack = [], [value]
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def nesting_depth(value: Any) -> int:
    """How many objects and arrays deep ``value`` goes (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in node)
    return deepest


def input_chars(body: StructuredIn) -> int:
    """Characters of the prompt plus the schema written as compact JSON."""
    schema = json.dumps(body.json_schema, ensure_ascii=False, separators=(",", ":"))
    return len(body.prompt) + len(schema)


#: 8 tokens per started 8,000 characters: a prompt and schema of up to 8,000 cost 8.
COST = per_started(StructuredIn, input_chars, size=8_000, tokens=8,
                   what="characters of prompt and schema")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class StructuredOut(BaseModel):
    data: Any = Field(description="An instance valid for the requested schema.")
    model: str
    usage: Usage
    strict: bool = Field(description="Whether the answer came in strict mode, which "
                                     "guarantees the schema; the answer is validated either "
                                     "way.")
    strict_rejected: str | None = Field(
        default=None,
        description="The provider's reason when it refused the schema in strict mode and the "
                    "answer was asked without it (strict is then false); null otherwise. "
                    "The answer is valid for the schema and charged like any other.")


@app.post("/v1/structured", dependencies=[Depends(require_tokens(cost=COST))],
          responses=METERED_RESPONSES)
async def structured(body: StructuredIn) -> StructuredOut:
    """Answer ``prompt`` with a JSON value valid for ``schema``."""
    result = await llm_client().structured(body.prompt, body.json_schema, model=body.model)
    return StructuredOut(data=result.data, model=result.model,
                         usage=Usage(prompt_tokens=result.prompt_tokens,
                                     completion_tokens=result.completion_tokens),
                         strict=result.strict, strict_rejected=result.strict_rejected)


handler = lambda_handler(app)
