"""The emulator's JSON Schema instance generator and OpenAI strict-mode check (no server)."""

from __future__ import annotations

import json
import random
import re

import pytest

from local.emulator.llm import strict_schema_problem
from local.emulator.regex_strings import string_for_pattern
from local.emulator.schema_instances import generate_instance, is_valid

JOB = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "company": {"type": "string"},
        "location": {"type": "string"},
        "salary_min": {"type": ["integer", "null"], "minimum": 0},
        "salary_max": {"type": ["integer", "null"], "minimum": 0},
        "skills": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "remote": {"type": "boolean"},
    },
    "required": ["title", "company", "location", "salary_min", "salary_max", "skills",
                 "remote"],
    "additionalProperties": False,
}

SCHEMAS: dict[str, object] = {
    "true": True,
    "empty": {},
    "string": {"type": "string"},
    "integer": {"type": "integer"},
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "type-list": {"type": ["string", "null"]},
    "type-list-number-first": {"type": ["number", "string"]},
    "nullable-openapi": {"type": "string", "nullable": True},
    "enum": {"enum": ["junior", "mid", "senior"]},
    "enum-mixed": {"enum": [1, "two", None, {"three": 3}]},
    "const": {"const": {"fixed": [1, 2]}},
    "integer-range": {"type": "integer", "minimum": 10, "maximum": 12},
    "integer-exclusive-draft6": {"type": "integer", "exclusiveMinimum": 5,
                                 "exclusiveMaximum": 7},
    "integer-exclusive-draft4": {"$schema": "http://json-schema.org/draft-04/schema#",
                                 "type": "integer", "minimum": 5, "exclusiveMinimum": True,
                                 "maximum": 7, "exclusiveMaximum": True},
    "integer-multiple": {"type": "integer", "minimum": 101, "maximum": 140, "multipleOf": 7},
    "number-multiple-decimal": {"type": "number", "minimum": 0.1, "maximum": 0.3,
                                "multipleOf": 0.01},
    "number-tight-exclusive": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "number-negative": {"type": "number", "maximum": -1000.5},
    "string-lengths": {"type": "string", "minLength": 40, "maxLength": 45},
    "string-short": {"type": "string", "maxLength": 3},
    "string-exact": {"type": "string", "minLength": 7, "maxLength": 7},
    "pattern-code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"},
    "pattern-alternation": {"type": "string", "pattern": "^(GBP|EUR|USD)$"},
    "pattern-unanchored": {"type": "string", "pattern": "[0-9]+kg"},
    "pattern-with-length": {"type": "string", "pattern": "^[a-z]+$", "minLength": 12},
    "format-date": {"type": "string", "format": "date"},
    "format-date-time": {"type": "string", "format": "date-time"},
    "format-time": {"type": "string", "format": "time"},
    "format-email": {"type": "string", "format": "email"},
    "format-uri": {"type": "string", "format": "uri"},
    "format-uuid": {"type": "string", "format": "uuid"},
    "format-ipv4": {"type": "string", "format": "ipv4"},
    "format-ipv6": {"type": "string", "format": "ipv6"},
    "format-hostname": {"type": "string", "format": "hostname"},
    "format-duration": {"type": "string", "format": "duration"},
    "job": JOB,
    "object-no-type": {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
    "object-required-unknown": {"type": "object", "required": ["x", "y"]},
    "object-additional-schema": {"type": "object", "additionalProperties": {"type": "integer"},
                                 "minProperties": 3},
    "object-pattern-properties": {"type": "object", "patternProperties": {
        "^s_": {"type": "string"}, "^n_": {"type": "number"}}, "additionalProperties": False,
        "minProperties": 2},
    "object-max-properties": {"type": "object", "properties": {
        k: {"type": "string"} for k in "abcdef"}, "required": ["a"], "maxProperties": 2},
    "object-property-names": {"type": "object", "propertyNames": {"pattern": "^[a-z]{3}$"},
                              "minProperties": 2},
    "object-dependent-required": {"type": "object", "properties": {"a": {"type": "string"}},
                                  "required": ["a"], "dependentRequired": {"a": ["b"]}},
    "array-bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 5,
                     "maxItems": 6},
    "array-max-zero": {"type": "array", "items": {"type": "string"}, "maxItems": 0},
    "array-unique-enum": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                          "uniqueItems": True, "minItems": 3},
    "array-unique-booleans": {"type": "array", "items": {"type": "boolean"},
                              "uniqueItems": True, "minItems": 2},
    "array-tuple-draft7": {"$schema": "http://json-schema.org/draft-07/schema#",
                           "type": "array", "items": [{"type": "string"}, {"type": "integer"}],
                           "additionalItems": False},
    "array-prefix-items": {"type": "array", "prefixItems": [{"const": "x"}, {"type": "number"}],
                           "items": False},
    "array-contains": {"type": "array", "items": {"type": "integer"},
                       "contains": {"const": 42}, "minContains": 2},
    "array-no-items": {"type": "array", "minItems": 2},
    "ref-defs": {"$defs": {"skill": {"type": "object", "properties": {
        "name": {"type": "string"}, "years": {"type": "integer", "minimum": 0}},
        "required": ["name", "years"], "additionalProperties": False}},
        "type": "object", "properties": {"skills": {"type": "array",
                                                    "items": {"$ref": "#/$defs/skill"}}},
        "required": ["skills"]},
    "ref-definitions": {"definitions": {"money": {"type": "number", "minimum": 0}},
                        "type": "object", "properties": {"pay": {"$ref": "#/definitions/money"}},
                        "required": ["pay"]},
    "ref-with-siblings": {"$defs": {"base": {"type": "string"}},
                          "$ref": "#/$defs/base", "minLength": 30},
    "ref-recursive-tree": {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array",
                                                 "items": {"$ref": "#/$defs/node"}}},
        "required": ["name", "children"], "additionalProperties": False}},
        "$ref": "#/$defs/node"},
    "ref-recursive-root": {"type": "object", "properties": {
        "value": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["value", "next"]},
    "any-of-nullable": {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}]},
    "one-of-overlapping": {"oneOf": [{"type": "integer", "multipleOf": 3},
                                     {"type": "integer", "multipleOf": 5}]},
    "one-of-objects": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "a": {"type": "string"}},
         "required": ["kind", "a"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "b"}, "b": {"type": "integer"}},
         "required": ["kind", "b"], "additionalProperties": False}]},
    "all-of-merge": {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5}},
         "required": ["a"]},
        {"properties": {"a": {"maximum": 6}, "b": {"enum": ["x", "y"]}}, "required": ["b"]}]},
    "all-of-numbers": {"allOf": [{"type": "number", "minimum": 3},
                                 {"type": "integer", "maximum": 4}]},
    "if-then-else": {"type": "object", "properties": {"kind": {"enum": ["a", "b"]},
                                                      "n": {"type": "integer"}},
                     "required": ["kind", "n"],
                     "if": {"properties": {"kind": {"const": "a"}}},
                     "then": {"properties": {"n": {"minimum": 100}}},
                     "else": {"properties": {"n": {"maximum": -100}}}},
    "not": {"type": "integer", "not": {"const": 1}, "minimum": 1, "maximum": 2},
    "openai-strict-nested": {
        "type": "object", "additionalProperties": False, "required": ["summary", "items"],
        "properties": {
            "summary": {"type": "string"},
            "items": {"type": "array", "items": {
                "type": "object", "additionalProperties": False,
                "required": ["name", "score", "tags", "note"],
                "properties": {"name": {"type": "string"},
                               "score": {"type": "number", "minimum": 0, "maximum": 1},
                               "tags": {"type": "array", "items": {"type": "string"}},
                               "note": {"type": ["string", "null"]}}}}}},
    "pydantic-style": {
        "$defs": {"Level": {"enum": ["junior", "senior"], "title": "Level", "type": "string"}},
        "properties": {"name": {"title": "Name", "type": "string"},
                       "level": {"$ref": "#/$defs/Level"},
                       "email": {"anyOf": [{"type": "string", "format": "email"},
                                           {"type": "null"}], "default": None}},
        "required": ["name", "level"], "title": "Candidate", "type": "object"},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_instance_is_valid(name: str) -> None:
    """The generated instance validates against the schema, formats included."""
    schema = SCHEMAS[name]
    value = generate_instance(schema, seed=name, hint="Senior Python Developer at Acme in Leeds")
    assert is_valid(value, schema), json.dumps(value)[:500]


@pytest.mark.parametrize("seed", range(12))
def test_instances_valid_across_seeds(seed: int) -> None:
    """Every schema of the set stays valid whatever the seed."""
    bad = [name for name, schema in SCHEMAS.items()
           if not is_valid(generate_instance(schema, seed=seed), schema)]
    assert bad == []


def test_generation_is_deterministic() -> None:
    """The same schema, seed and hint give the same instance."""
    a = generate_instance(JOB, seed=3, hint="Data Engineer in Bristol")
    b = generate_instance(JOB, seed=3, hint="Data Engineer in Bristol")
    assert a == b


def test_seeds_vary_instances() -> None:
    """Different seeds give different instances of a free-form schema."""
    values = {json.dumps(generate_instance(JOB, seed=s)) for s in range(6)}
    assert len(values) > 1


def test_values_follow_property_names_and_prompt() -> None:
    """Property names and the prompt make values plausible (title, company, place, salary)."""
    value = generate_instance(JOB, seed=0, hint="Extract: Senior Python Developer at Acme "
                                                "in Leeds, paying well")
    assert value["title"] == "Senior Python Developer"
    assert value["company"] == "Acme"
    assert value["location"] == "Leeds"
    assert 10_000 < value["salary_min"] < 200_000
    assert "Python" in value["skills"]


def test_unsatisfiable_schema_returns_best_effort() -> None:
    """A schema nothing satisfies still returns a value instead of raising."""
    schema = {"type": "integer", "minimum": 5, "maximum": 4}
    value = generate_instance(schema, seed=1)
    assert not is_valid(value, schema)


@pytest.mark.parametrize("pattern", [r"^[A-Z]{2}\d{2}$", r"^(ab|cd)+$", r"^\w+@\w+\.com$",
                                     r"^[^,;]{3,8}$", r"^(x)\1y$", r"^\s?\S+$"])
def test_pattern_strings_match(pattern: str) -> None:
    """Strings generated for a regular expression match it."""
    text = string_for_pattern(pattern, seed=1)
    assert text is not None and re.search(pattern, text)


def test_pattern_unsupported_falls_back() -> None:
    """A pattern Python cannot parse gives None so the caller can fall back."""
    assert string_for_pattern(r"^\p{L}+$", seed=1) is None


def test_strict_schema_accepts_compliant_schema() -> None:
    """A schema following OpenAI's strict rules passes the check."""
    assert strict_schema_problem(JOB) is None
    assert strict_schema_problem(SCHEMAS["openai-strict-nested"]) is None


@pytest.mark.parametrize(("schema", "fragment"), [
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
     "In context=(), 'additionalProperties' is required to be supplied and to be false."),
    ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
      "required": ["a"], "additionalProperties": False}, "Missing 'b'."),
    ({"type": "object", "properties": {"x": {"type": "object", "properties": {}}},
      "required": ["x"], "additionalProperties": False},
     "In context=('properties', 'x'), 'additionalProperties'"),
    ({"type": "array", "items": {"type": "string"}}, "schema must be a JSON Schema of"),
])
def test_strict_schema_problems(schema: dict[str, object], fragment: str) -> None:
    """Schemas that OpenAI's strict mode rejects are named with its wording."""
    problem = strict_schema_problem(schema)
    assert problem is not None and fragment in problem


def _random_schema(rng: random.Random, depth: int = 0) -> dict[str, object]:
    """A random schema from the keywords structured output uses."""
    kinds = ["string", "integer", "number", "boolean", "enum", "nullable"]
    if depth < 3:
        kinds += ["object", "object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        s: dict[str, object] = {"type": "string"}
        extra = rng.choice(["", "format", "pattern", "length"])
        if extra == "format":
            s["format"] = rng.choice(["date", "date-time", "email", "uri", "uuid"])
        elif extra == "pattern":
            s["pattern"] = rng.choice(["^[a-z]{3,6}$", "^[A-Z]\\d{2}$", "^(yes|no)$"])
        elif extra == "length":
            lo = rng.randint(0, 20)
            s.update(minLength=lo, maxLength=lo + rng.randint(0, 10))
        return s
    if kind in ("integer", "number"):
        s = {"type": kind}
        if rng.random() < 0.6:
            lo = rng.randint(-50, 50)
            s.update(minimum=lo, maximum=lo + rng.randint(0, 40))
        if rng.random() < 0.3:
            s["multipleOf"] = rng.choice([2, 5, 0.5] if kind == "number" else [2, 3, 5])
            s.pop("maximum", None)
        return s
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["a", "b", "c", "d", 1, 2.5, None], rng.randint(1, 4))}
    if kind == "nullable":
        return {"type": [rng.choice(["string", "integer", "number"]), "null"]}
    if kind == "anyOf":
        return {"anyOf": [_random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if kind == "array":
        s = {"type": "array", "items": _random_schema(rng, depth + 1)}
        if rng.random() < 0.5:
            lo = rng.randint(0, 3)
            s.update(minItems=lo, maxItems=lo + rng.randint(0, 3))
        return s
    names = rng.sample(["name", "title", "company", "salary", "score", "email", "skills",
                        "summary", "id", "level", "city", "count"], rng.randint(1, 5))
    props = {n: _random_schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props,
            "required": [n for n in names if rng.random() < 0.7],
            "additionalProperties": rng.choice([False, True, {"type": "string"}])}


@pytest.mark.parametrize("block", range(4))
def test_random_schemas_are_satisfied(block: int) -> None:
    """Instances of 200 seeded random schemas per block all validate."""
    failures = []
    for k in range(200):
        rng = random.Random(block * 1000 + k)
        schema = _random_schema(rng)
        value = generate_instance(schema, seed=k)
        if not is_valid(value, schema):
            failures.append((schema, value))
    assert failures == []
