"""Strings that match a regular expression, for JSON Schema ``pattern``.

Walks the parse tree of Python's own regex parser (``re._parser``), which covers the
patterns schemas use in practice: literals, classes, ``\\d \\w \\s``, groups, alternation,
bounded and unbounded repeats, anchors and back-references. Anything it cannot handle
(look-arounds it cannot honour, syntax Python does not accept) gives ``None`` and the
caller falls back to plain text. Every result is checked with ``re.search``.
"""

from __future__ import annotations

import random
import re
import re._constants as _c  # Python 3.11+
import re._parser as _p
import string
from typing import Any

_PRINTABLE = string.ascii_letters + string.digits + " -_.,:;!?@#/"
_CATEGORY = {
    _c.CATEGORY_DIGIT: string.digits,
    _c.CATEGORY_NOT_DIGIT: string.ascii_letters + "-_ ",
    _c.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
    _c.CATEGORY_NOT_WORD: " -.,:;!?@#/",
    _c.CATEGORY_SPACE: " ",
    _c.CATEGORY_NOT_SPACE: string.ascii_letters + string.digits,
}


class _Unsupported(Exception):
    pass


def string_for_pattern(pattern: str, seed: object = 0, *, min_length: int = 0,
                       max_length: int | None = None, attempts: int = 24) -> str | None:
    """A string that ``re.search(pattern, ...)`` accepts, within the length bounds.

    Args:
        pattern: the regular expression (JSON Schema patterns are unanchored).
        seed: anything; the same seed gives the same string.
        min_length: shortest acceptable result.
        max_length: longest acceptable result, or ``None``.
        attempts: tries with longer repeats before giving up.

    Returns:
        The string, or ``None`` if no string was found within the bounds.
    """
    try:
        compiled = re.compile(pattern)
        tree = _p.parse(pattern)
    except (re.error, OverflowError, RecursionError):
        return None
    rng = random.Random(f"{pattern}\x1f{seed}")
    for attempt in range(attempts):
        # Grow unbounded repeats when results come out too short.
        extra = (attempt // 3) * max(1, min_length // 2)
        try:
            groups: dict[int, str] = {}
            text = _emit(tree, rng, extra, groups)
        except (_Unsupported, RecursionError):
            return None
        if len(text) < min_length and not _anchored_end(tree):
            # An unanchored tail accepts padding after the match.
            text += "x" * (min_length - len(text))
        if len(text) < min_length and not _anchored_start(tree):
            text = "x" * (min_length - len(text)) + text
        if (len(text) >= min_length and (max_length is None or len(text) <= max_length)
                and compiled.search(text)):
            return text
    return None


def _anchored_end(tree: Any) -> bool:
    items = list(tree)
    return bool(items) and items[-1][0] is _c.AT and items[-1][1] in (
        _c.AT_END, _c.AT_END_STRING)


def _anchored_start(tree: Any) -> bool:
    items = list(tree)
    return bool(items) and items[0][0] is _c.AT and items[0][1] in (
        _c.AT_BEGINNING, _c.AT_BEGINNING_STRING)


def _emit(tree: Any, rng: random.Random, extra: int, groups: dict[int, str]) -> str:
    out: list[str] = []
    for op, av in tree:
        out.append(_emit_one(op, av, rng, extra, groups))
    return "".join(out)


def _emit_one(op: Any, av: Any, rng: random.Random, extra: int, groups: dict[int, str]) -> str:
    if op is _c.LITERAL:
        return chr(av)
    if op is _c.NOT_LITERAL:
        return rng.choice([ch for ch in _PRINTABLE if ord(ch) != av])
    if op is _c.ANY:
        return rng.choice(string.ascii_letters)
    if op is _c.IN:
        return _emit_class(av, rng)
    if op is _c.BRANCH:
        return _emit(rng.choice(av[1]), rng, extra, groups)
    if op is _c.SUBPATTERN:
        group, _add, _del, sub = av
        text = _emit(sub, rng, extra, groups)
        if group is not None:
            groups[group] = text
        return text
    if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", _c.MAX_REPEAT)):
        low, high, sub = av
        upper = high if high is not _c.MAXREPEAT else low + 2 + extra
        upper = min(upper, low + 2 + extra)
        count = rng.randint(low, max(low, upper))
        return "".join(_emit(sub, rng, extra, groups) for _ in range(count))
    if op is _c.AT:
        return ""
    if op is _c.GROUPREF:
        return groups.get(av, "")
    if op is _c.CATEGORY:
        return rng.choice(_CATEGORY.get(av, string.ascii_letters))
    if op in (_c.ASSERT, _c.ASSERT_NOT):
        return ""  # look-arounds are not honoured; the final re.search decides
    if op is getattr(_c, "ATOMIC_GROUP", None):
        return _emit(av, rng, extra, groups)
    raise _Unsupported(str(op))


def _emit_class(items: Any, rng: random.Random) -> str:
    allowed: list[str] = []
    negate = False
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            allowed.append(chr(av))
        elif op is _c.RANGE:
            low, high = av
            span = range(low, min(high, low + 200) + 1)
            allowed.extend(chr(i) for i in span)
        elif op is _c.CATEGORY:
            allowed.extend(_CATEGORY.get(av, ""))
        else:
            raise _Unsupported(str(op))
    if negate:
        pool = [ch for ch in _PRINTABLE if ch not in set(allowed)]
        if not pool:
            raise _Unsupported("empty negated class")
        return rng.choice(pool)
    if not allowed:
        raise _Unsupported("empty class")
    # Prefer readable characters when the class offers them.
    readable = [ch for ch in allowed if ch in _PRINTABLE]
    return rng.choice(readable or allowed)
