"""Which caller schemas are sent in OpenAI's strict mode, and in what form."""

from __future__ import annotations

from typing import Any

import pytest

from atto_providers.strict import strict_schema
from local.emulator.llm import strict_schema_problem

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize("schema", [
    PERSON,
    {**PERSON, "additionalProperties": False},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                 "minItems": 1},
        "when": {"type": ["string", "null"], "format": "date-time"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "child": {"$ref": "#/$defs/node"}},
     "required": ["tags", "when", "score", "child"],
     "$defs": {"node": {"type": "object", "properties": {"v": {"anyOf": [
         {"type": "integer"}, {"type": "null"}]}}, "required": ["v"]}}},
    {"$schema": "https://json-schema.org/draft/2020-12/schema", **PERSON}])
def test_schemas_that_fit(schema: dict[str, Any]) -> None:
    """A schema in the subset is sent with every object closed, which the emulator accepts."""
    strict = strict_schema(schema)
    assert strict is not None
    assert "$schema" not in strict
    assert strict_schema_problem(strict) is None
    assert strict["additionalProperties"] is False
    assert schema.get("additionalProperties") in (None, False)  # the caller's is untouched


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "string"}},                       # root not an object
    {"type": "object", "properties": {"a": {"type": "string"}}},         # optional property
    {"type": "object", "additionalProperties": {"type": "string"}},      # a free-form map
    {**PERSON, "additionalProperties": True},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 1}},
     "required": ["a"]},                                                   # unsupported keyword
    {"type": "object", "properties": {"a": {"type": "string", "format": "color"}},
     "required": ["a"]},                                                   # unknown format
    {"type": "object", "properties": {"a": {}}, "required": ["a"]},       # anything at all
    {"type": "object", "properties": {"a": {"type": "array"}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}, "required": ["a"]},
    {"type": "object", "properties": {"a": True}, "required": ["a"]}])
def test_schemas_that_do_not_fit(schema: dict[str, Any]) -> None:
    """Outside the subset (or only by making optional properties required): not strict."""
    assert strict_schema(schema) is None


def test_depth_and_size_limits() -> None:
    """More than 10 levels of objects, or 1000 enum values, is not strict."""
    node: dict[str, Any] = {"type": "string"}
    for _ in range(11):
        node = {"type": "object", "properties": {"x": node}, "required": ["x"]}
    assert strict_schema(node) is None
    enum = {"type": "object", "properties": {"e": {"type": "string",
                                                   "enum": [str(i) for i in range(1001)]}},
            "required": ["e"]}
    assert strict_schema(enum) is None
