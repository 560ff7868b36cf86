"""What a document shows of an answer, compared with the answer the server gave, as a reader
compares them (``tests/integration/test_docs_examples.py`` runs the examples).

An output block's answers (``HTTP/1.1 ...``, header lines, a JSON body) are compared field
by field: every header shown with its value (only the seconds ``t=`` and ``Retry-After``
may differ), every field of the body with the same names and values, only ``VOLATILE`` ones
(ids, instants) free in value. A status comment's error code, the JSON fields it quotes and
the tokens it says the call costs are checked against that call's answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_HTTP_STATUS = re.compile(r"^HTTP/[\d.]+ ([1-5]\d\d)\b")

#: Body fields whose value differs on every run (ids, instants, seconds that tick): a
#: reader compares that they are there, not what they hold.
VOLATILE = frozenset({"request_id", "retry_after_s", "at", "resets_at", "changed_at",
                      "expires_at", "created_at", "from", "to", "since", "until"})
#: Header values that tick with the clock: ``t=<seconds>`` items and ``Retry-After``.
_TICKING = re.compile(r"(?<=[;\s]t=)\d+")


@dataclass(frozen=True)
class Answer:
    """One HTTP answer as a document shows it or the server gave it."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: object


def answers(text: str) -> list[Answer]:
    """Every ``HTTP/...`` answer in ``text`` (curl -i's output): its status, header lines
    and the JSON value its body starts with (None when it has none)."""
    found = []
    parts = re.split(r"(?m)^(?=HTTP/[\d.]+ [1-5]\d\d)", text)
    for part in parts:
        match = _HTTP_STATUS.match(part)
        if not match:
            continue
        head, _, rest = part.partition("\n\n") if "\r\n" not in part else \
            part.replace("\r\n", "\n").partition("\n\n")
        headers = tuple((name.strip().lower(), value.strip()) for name, sep, value in
                        (line.partition(":") for line in head.splitlines()[1:]) if sep)
        body: object = None
        rest = rest.lstrip()
        if rest.startswith(("{", "[")):
            body = json.JSONDecoder().raw_decode(rest)[0]
        found.append(Answer(int(match[1]), headers, body))
    return found


def differences(shown: object, got: object, where: str = "body") -> list[str]:
    """Where ``got`` differs from ``shown`` as a reader compares them (``VOLATILE``)."""
    if isinstance(shown, dict) and isinstance(got, dict):
        out = [f"{where}: shown {sorted(shown.keys() - got.keys())} missing, "
               f"{sorted(got.keys() - shown.keys())} not shown"] \
            if shown.keys() != got.keys() else []
        for key in shown.keys() & got.keys():
            if key in VOLATILE:
                if (shown[key] is None) != (got[key] is None):
                    out.append(f"{where}.{key}: shown {shown[key]!r}, got {got[key]!r}")
                continue
            out += differences(shown[key], got[key], f"{where}.{key}")
        return out
    if isinstance(shown, list) and isinstance(got, list) and len(shown) == len(got):
        return [d for n, (a, b) in enumerate(zip(shown, got, strict=True))
                for d in differences(a, b, f"{where}[{n}]")]
    return [] if shown == got else [f"{where}: shown {shown!r}, got {got!r}"]


def _holds(shown: object, got: object) -> bool:
    """``got`` has every field ``shown`` has, with its value (volatile ones: present)."""
    if isinstance(shown, dict):
        return isinstance(got, dict) and all(
            key in got and (key in VOLATILE or _holds(value, got[key]))
            for key, value in shown.items())
    if isinstance(shown, list):
        return isinstance(got, list) and len(shown) == len(got) and all(
            _holds(a, b) for a, b in zip(shown, got, strict=True))
    return shown == got


def _found(key: str, shown: object, body: object) -> bool:
    """Some object in ``body``, at any depth, has ``key`` holding ``shown``."""
    if isinstance(body, dict):
        if key in body and _holds(shown, body[key]):
            return True
        return any(_found(key, shown, v) for v in body.values())
    if isinstance(body, list):
        return any(_found(key, shown, v) for v in body)
    return False


_FIELD = re.compile(r'"(\w+)":\s*')
_CODE_AFTER_STATUS = re.compile(r"^[1-5]\d\d\s+([a-z]+(?:_[a-z]+)+)\b")


def comment_differences(comment: str, body: object) -> list[str]:
    """How ``body`` differs from what a status comment says of it: the error code named
    right after the status (``# refused: 422 invalid_request ...``), and each field quoted
    as JSON (``"credit": 492``), found at any depth with that value."""
    text = re.sub(r"^#\s*(?:[a-z ]+:\s*)?", "", comment)
    out = []
    if (code := _CODE_AFTER_STATUS.match(text)) and not (
            isinstance(body, dict) and isinstance(body.get("error"), dict)
            and body["error"].get("code") == code[1]):
        out.append(f"comment names {code[1]}, the answer is {body!r:.200}")
    position = 0
    while match := _FIELD.search(text, position):
        try:
            value, end = json.JSONDecoder().raw_decode(text, match.end())
        except ValueError:
            position = match.end()
            continue
        if match[1] not in VOLATILE and not _found(match[1], value, body):
            out.append(f'comment shows "{match[1]}": {json.dumps(value)}, the answer '
                       f"{body!r:.300}")
        position = end
    return out


_BEFORE = re.compile(r'(?m)^before "remaining":(\d+)$')
_FIRST_REMAINING = re.compile(r"(?im)^ratelimit:[^\r\n]*?;r=(\d+)")
_TOKENS_SAID = re.compile(r"(?:^|\(|charge of )(\d+) tokens?\b")


def charge(call: str) -> int | None:
    """The tokens one call cost its user (its ``$CALLS`` record): what the first window had
    left before it less its answer's ``r`` for that window; None when either is unknown (no
    user, no RateLimit fields)."""
    before, after = _BEFORE.search(call), _FIRST_REMAINING.findall(call)
    return int(before[1]) - int(after[-1]) if before and after else None


def charge_differences(comment: str, charged: int | None) -> list[str]:
    """How a call's charge differs from the tokens its status comment says it costs
    (``(2 tokens)``, ``a charge of 1 token``, ``8 tokens, ...``; ``nothing charged``: 0)."""
    text = re.sub(r"^#\s*(?:[a-z ]+:\s*)?[1-5]\d\d:?\s*", "", comment)
    said = _TOKENS_SAID.search(text)
    expected = int(said[1]) if said else 0 if "nothing charged" in text else None
    if expected is None or charged is None or expected == charged:
        return []
    return [f"comment says {expected} tokens, the RateLimit fields say {charged}: {comment}"]


def first_json(text: str) -> object:
    """The JSON value the first line starting with ``{`` or ``[`` begins (None: none)."""
    match = re.search(r"(?m)^[{\[]", text)
    if match is None:
        return None
    try:
        return json.JSONDecoder().raw_decode(text, match.start())[0]
    except ValueError:
        return None


def answer_differences(shown: list[Answer], got: list[Answer]) -> list[str]:
    """Each way the server's answers differ from those an output block shows."""
    if len(shown) != len(got):
        return [f"{len(shown)} answers shown, {len(got)} given"]
    out = []
    for n, (a, b) in enumerate(zip(shown, got, strict=True)):
        if a.status != b.status:
            out.append(f"answer {n}: shown status {a.status}, got {b.status}")
        given = dict(b.headers)
        for name, value in a.headers:
            if name not in given:
                out.append(f"answer {n}: header {name} shown, not given")
            elif name != "retry-after" and _TICKING.sub("N", value) != \
                    _TICKING.sub("N", given[name]):
                out.append(f"answer {n}: {name}: shown {value!r}, got {given[name]!r}")
        out += differences(a.body, b.body, f"answer {n} body")
    return out
