"""A caller's JSON Schema regexes, checked in linear time (RE2) instead of by backtracking.

A structured answer is validated against the caller's schema, and its ``pattern`` and
``patternProperties`` regexes come from the caller. Python's ``re`` backtracks: with a
pattern such as ``^(a+)+$`` and an answer the prompt steers (``"a" * 40 + "b"``) one check
takes 4x longer for every two characters, far past any deadline, on the event loop (nothing
else runs, no refund), and ``re`` holds the GIL, so a worker thread would not help either.

The choice: every caller regex runs on RE2 (``google-re2``, manylinux wheels for x86_64 and
aarch64, CPython 3.11 and 3.12), whose matching time is linear in the text. The ways a
caller regex reaches a regex engine during validation are all replaced with RE2:

- ``pattern`` (also under ``propertyNames``) and ``patternProperties``: keyword functions of
  our own, registered with ``jsonschema.validators.extend`` (public API);
- ``additionalProperties``, which skips names that match a ``patternProperties`` key;
- ``unevaluatedProperties`` looks at ``patternProperties`` through jsonschema's internals with
  ``re``; a schema that has both is refused (the combination is rare, and refusing it keeps
  ``re`` away from caller regexes without patching jsonschema).

A regex RE2 cannot run (backreferences such as ``(a)\\1``, lookaround such as ``(?=a)``, a
repetition over 1000, a program over RE2's memory budget) is refused when the request is
validated, with a 422 that names it, before any provider call. RE2 follows the syntax of
Perl/Python for everything else; like ECMA-262, which JSON Schema names, ``\\w`` and ``\\d``
are ASCII.

The RE2 keywords only help while every part of the schema is validated by our classes, and
jsonschema switches class by itself in two ways, both closed here:

- a subschema that names a draft in ``$schema`` is validated with that draft's stock class
  (``evolve`` calls ``validator_for``), whose keywords use ``re``: ``$schema`` is allowed at
  the root only (an object anywhere else with a string ``$schema`` is refused), and the root
  is validated without it once its draft has chosen our class, so a ``$ref: "#"`` to the
  root stays on RE2 too;
- a ``$ref``, ``$dynamicRef`` or ``$recursiveRef`` may reach the drafts' own meta-schemas,
  which jsonschema adds to every registry, and from there (``$dynamicRef: "#meta"``) come
  back into the caller's schema with the stock class: the validator resolves references in
  a registry that holds the caller's schema and nothing else.

``format`` is not asserted on answers (no format checker is used), so ``format: regex``
compiles nothing; the meta-schema check of a request (``check_schema``) leaves the
``regex`` format to RE2 as well, instead of jsonschema's ``re.compile``.

Compiled regexes are cached (``functools.lru_cache``), so a schema's regexes are compiled
once per execution environment.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

#: Compiled caller regexes kept per execution environment.
CACHE_SIZE = 256
#: RE2's memory budget for one compiled regex (its default, 8 MiB): a larger one is refused.
MAX_PROGRAM_BYTES = 8 << 20


class UnsupportedPattern(ValueError):
    """A regex of the schema, or a part holding regexes, that cannot be checked in linear
    time; ``str`` says which."""


@functools.lru_cache(maxsize=CACHE_SIZE)
def compiled(pattern: str) -> Any:
    """The RE2 program of ``pattern``.

    Raises:
        UnsupportedPattern: RE2 cannot compile it (its message names the regex and why).
    """
    import re2

    options = re2.Options()
    options.log_errors = False
    options.max_mem = MAX_PROGRAM_BYTES
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise UnsupportedPattern(
            f"regex {pattern[:100]!r} is not supported: {reason} (regexes are matched in "
            "linear time, without backreferences or lookaround)") from None


def search(pattern: str, text: str) -> bool:
    """Whether ``pattern`` matches anywhere in ``text`` (as JSON Schema's ``pattern``)."""
    return compiled(pattern).search(text) is not None


def check_schema_patterns(schema: Any) -> None:
    """Refuse a schema whose regexes cannot all be checked in linear time.

    Raises:
        UnsupportedPattern: a ``pattern`` or ``patternProperties`` key RE2 cannot run;
            ``unevaluatedProperties`` in a schema that also has ``patternProperties``; a
            ``$schema`` anywhere but at the root, or one that names no draft jsonschema has.
    """
    draft_of(schema)
    has_pattern_properties = has_unevaluated = False
    for node in _schemas(schema):
        if node is not schema and isinstance(node.get("$schema"), str):
            raise UnsupportedPattern(
                "$schema is allowed only at the root of the schema (a subschema naming a "
                f"draft, here {node['$schema'][:100]!r}, would be validated without the "
                "linear-time regex checks)")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            compiled(pattern)
        keyed = node.get("patternProperties")
        if isinstance(keyed, dict):
            has_pattern_properties = True
            for key in keyed:
                compiled(key)
        if "unevaluatedProperties" in node:
            has_unevaluated = True
    if has_pattern_properties and has_unevaluated:
        raise UnsupportedPattern("a schema with patternProperties cannot also use "
                                 "unevaluatedProperties")


def draft_of(schema: Any) -> Any:
    """The stock jsonschema validator class of the draft ``schema`` names (the latest if none).

    Raises:
        UnsupportedPattern: ``$schema`` is not a string, or names no draft jsonschema has
            (jsonschema would fall back to the latest draft with a warning).
    """
    from jsonschema import validators

    if not isinstance(schema, dict) or "$schema" not in schema:
        return validators.validator_for(True)  # the latest draft
    dialect = schema["$schema"]
    found = validators.validator_for(schema, default=None) if isinstance(dialect, str) else None
    if found is None:
        raise UnsupportedPattern(f"$schema {str(dialect)[:100]!r} names no JSON Schema draft "
                                 "this service knows (draft 3 to 2020-12)")
    return found


def check_schema(schema: dict[str, Any]) -> None:
    """Check ``schema`` against its draft's meta-schema, no caller regex compiled by ``re``.

    The meta-schemas say ``format: regex`` of every ``pattern`` and ``patternProperties``
    key, and jsonschema's checker of that format is ``re.compile``: it is left out here,
    because ``check_schema_patterns`` compiles each of those regexes with RE2.

    Raises:
        jsonschema.SchemaError: the schema breaks its meta-schema.
        UnsupportedPattern: its ``$schema`` names no known draft.
    """
    import copy

    base = draft_of(schema)
    checker = copy.copy(base.FORMAT_CHECKER)
    checker.checkers = {name: check for name, check in base.FORMAT_CHECKER.checkers.items()
                        if name != "regex"}
    base.check_schema(schema, format_checker=checker)


def validator_for(schema: dict[str, Any], registry: Any) -> Any:
    """A jsonschema validator of ``schema`` whose regex keywords run on RE2, in every part.

    Its references resolve in ``registry`` plus the schema itself, never in the drafts'
    meta-schemas (see the module's docstring), and the root's ``$schema`` is dropped once it
    has chosen the draft, so no part of the schema is validated by a stock class.

    Args:
        schema: the caller's schema.
        registry: the ``referencing.Registry`` of other resources (an empty one: none).

    Raises:
        UnsupportedPattern: the schema fails ``check_schema_patterns`` (called again here,
            so no caller of this function can skip it).
    """
    import referencing.jsonschema

    check_schema_patterns(schema)
    base = draft_of(schema)
    root = {key: value for key, value in schema.items() if key != "$schema"}
    specification = referencing.jsonschema.specification_with(
        base.ID_OF(base.META_SCHEMA), default=referencing.Specification.OPAQUE)
    # ``_resolver`` (jsonschema's own keyword for a prepared resolver): with ``registry=``
    # alone, jsonschema would add every meta-schema to it.
    resolver = registry.resolver_with_root(specification.create_resource(root))
    return _linear(base)(root, _resolver=resolver)


@functools.cache
def _linear(base: Any) -> Any:
    """``base`` (a jsonschema validator class) with its regex keywords on RE2."""
    import jsonschema

    return jsonschema.validators.extend(base, {
        "pattern": _pattern, "patternProperties": _pattern_properties,
        "additionalProperties": _additional_properties})


def _pattern(validator: Any, pattern: Any, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not search(pattern, instance):
        yield ValidationError(f"{instance[:100]!r} does not match {pattern[:100]!r}")


def _pattern_properties(validator: Any, keyed: Any, instance: Any,
                        schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in keyed.items():
        for name, value in instance.items():
            if search(pattern, name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _additional_properties(validator: Any, extra_schema: Any, instance: Any,
                           schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = sorted((name for name in instance if name not in properties
                     and not any(search(p, name) for p in patterns)), key=str)
    if validator.is_type(extra_schema, "object"):
        for name in extras:
            yield from validator.descend(instance[name], extra_schema, path=name)
    elif not extra_schema and extras:
        shown = ", ".join(repr(name[:100]) for name in extras[:20])
        yield ValidationError(f"additional properties are not allowed ({shown})")


def _schemas(value: Any) -> Iterator[dict[str, Any]]:
    """Every object inside ``value`` (iteratively, so a deep schema cannot overflow)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
