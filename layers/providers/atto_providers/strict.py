"""Does a caller's JSON Schema fit OpenAI's strict structured outputs, and in what form?

With ``json_schema.strict: true`` the provider guarantees an answer valid for the schema,
but accepts only a subset of JSON Schema (OpenAI's "Supported schemas"): the root is an
object; every object lists its ``properties``, requires every one of them and sets
``additionalProperties: false``; arrays have one ``items`` schema; the keywords are
``type``, ``properties``, ``required``, ``additionalProperties``, ``items``, ``enum``,
``const``, ``anyOf``, ``$ref``/``$defs``, ``description``/``title``, the string keywords
``pattern`` and ``format`` (nine formats), the number keywords ``minimum``, ``maximum``,
``exclusiveMinimum``, ``exclusiveMaximum``, ``multipleOf`` and the array keywords
``minItems``/``maxItems``; at most 5000 properties, 10 levels of objects and 1000 enum
values.

``strict_schema`` gives the schema to send in strict mode, or None when the caller's
schema is outside that subset. One change is made, and it only narrows what the answer
may be, so a strict answer is always valid for the caller's schema: an object that lists
``properties`` and says nothing of others gets ``additionalProperties: false`` (a root
``$schema`` is dropped too). An optional property is never made required: that would force
the model to invent a value the caller allowed it to leave out; such a schema is sent
without strict mode. Either way the answer is validated against the caller's schema.
"""

from __future__ import annotations

import copy
from typing import Any

#: Keywords strict mode accepts on any schema.
_ALLOWED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum", "const",
    "anyOf", "$ref", "$defs", "definitions", "description", "title", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems",
    "maxItems"})
_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4",
                      "ipv6", "uuid"})
MAX_PROPERTIES = 5000
MAX_OBJECT_DEPTH = 10
MAX_ENUM_VALUES = 1000


class _NotStrict(Exception):
    """The schema is outside strict mode's subset."""


def strict_schema(schema: Any) -> dict[str, Any] | None:
    """``schema`` as strict mode takes it, or None when it does not fit strict mode.

    Args:
        schema: the caller's JSON Schema (never changed; a copy is returned).

    Returns:
        A copy with ``additionalProperties: false`` where it was left out, or None.
    """
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return None
    out = copy.deepcopy(schema)
    out.pop("$schema", None)
    counts = {"properties": 0, "enum": 0}
    try:
        _walk(out, 1, counts)
    except (_NotStrict, RecursionError):
        return None
    return out


def _walk(node: Any, depth: int, counts: dict[str, int]) -> None:
    """Check ``node`` (and below) against the subset; set ``additionalProperties: false``.

    Raises:
        _NotStrict: something is outside the subset.
    """
    if not isinstance(node, dict) or set(node) - _ALLOWED:
        raise _NotStrict
    if not ({"type", "anyOf", "$ref", "enum", "const"} & set(node)):
        raise _NotStrict  # an unconstrained schema ({}) is not accepted
    types = node.get("type")
    listed = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if types is not None and (not listed or not set(listed) <= _TYPES):
        raise _NotStrict
    if "format" in node and node["format"] not in _FORMATS:
        raise _NotStrict
    if "enum" in node:
        if not isinstance(node["enum"], list):
            raise _NotStrict
        counts["enum"] += len(node["enum"])
    if "object" in listed or "properties" in node:
        _object(node, depth, counts)
    if "items" in node:
        _walk(node["items"], depth, counts)
    elif "array" in listed:
        raise _NotStrict  # an array of anything
    for keyword in ("anyOf",):
        subs = node.get(keyword, [])
        if not isinstance(subs, list):
            raise _NotStrict
        for sub in subs:
            _walk(sub, depth, counts)
    for keyword in ("$defs", "definitions"):
        defs = node.get(keyword, {})
        if not isinstance(defs, dict):
            raise _NotStrict
        for sub in defs.values():
            _walk(sub, depth, counts)
    if counts["properties"] > MAX_PROPERTIES or counts["enum"] > MAX_ENUM_VALUES:
        raise _NotStrict


def _object(node: dict[str, Any], depth: int, counts: dict[str, int]) -> None:
    """The object rules: listed properties, all required, no others."""
    if depth > MAX_OBJECT_DEPTH:
        raise _NotStrict
    properties = node.get("properties")
    if not isinstance(properties, dict) or not properties:
        raise _NotStrict  # a free-form object (a map) cannot be strict
    required = node.get("required", [])
    if not isinstance(required, list) or set(properties) - set(required):
        raise _NotStrict
    if node.setdefault("additionalProperties", False) is not False:
        raise _NotStrict
    counts["properties"] += len(properties)
    for sub in properties.values():
        _walk(sub, depth + 1, counts)
