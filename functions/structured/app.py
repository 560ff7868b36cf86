"""POST /v1/structured: a JSON answer valid for the caller's JSON Schema (8 tokens)."""

from __future__ import annotations

from typing import Any

from fastapi import Depends
from mangum import Mangum
from pydantic import BaseModel, ConfigDict, Field, field_validator

from atto_providers.llm import llm_client
from usage_limits.web import METERED_RESPONSES, create_app, require_tokens

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
        from jsonschema import SchemaError, validators

        if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        try:
            validators.validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from exc
        return schema


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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class StructuredOut(BaseModel):
    data: Any = Field(description="An instance valid for the requested schema.")
    model: str
    usage: Usage


@app.post("/v1/structured", dependencies=[Depends(require_tokens(cost=8))],
          responses=METERED_RESPONSES)
async def structured(body: StructuredIn) -> StructuredOut:
    """Answer ``prompt`` with a JSON value valid for ``schema``."""
    result = await llm_client().structured(body.prompt, body.json_schema, model=body.model)
    return StructuredOut(data=result.data, model=result.model,
                         usage=Usage(prompt_tokens=result.prompt_tokens,
                                     completion_tokens=result.completion_tokens))


handler = Mangum(app, lifespan="off")
