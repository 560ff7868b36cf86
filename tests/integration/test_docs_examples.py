"""The README's and docs' examples, pasted in order on a fresh `make serve`, answer the
statuses the documents show, and the answers they show are the server's.

A curl example is a ``sh``/``bash`` block that runs ``curl``. Its expected statuses are its
comment lines that start with a status (``# 200: ...``, ``# refused: 422 ...``), one per
request, or else the output block right after it (``HTTP/1.1 200 OK`` lines and lines of
bare statuses such as ``200 200 200``). A client example is a ``python`` block that talks
to ``http://127.0.0.1:8000``; it must run to its end (exit status 0), as pasted. An operator
example is a ``sh`` block that runs ``atto-admin`` (or ``make admin ARGS=...``) with no URL,
as an operator types it next to a running ``make serve``: every command must succeed.

Where an output block shows answers (``HTTP/1.1 ...`` with headers and a JSON body), each is
compared with the server's, field by field as a reader compares them: every header shown
with its value (only the seconds ``t=`` and ``Retry-After`` may differ), and every field of
the body, nested ones too, with the same names and values (token counts, model, code,
message), only instants and ids may differ in value (``VOLATILE``) but must be there. A
status comment's error code, the JSON fields it quotes and the tokens it says the call
costs (``(2 tokens)``, ``nothing charged``) are checked against that call's answer; the cost
is what the user's first window had left before the call (``GET /v1/usage``, free) less
the answer's ``RateLimit`` ``r`` for it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import serving

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

#: Where the documents say the server and the emulator listen.
DOC_SERVER, DOC_EMULATOR = "http://127.0.0.1:8000", "http://127.0.0.1:8100"

_FENCE = re.compile(r"^```(\w*)\s*$")
_STATUS_COMMENT = re.compile(r"^#\s*(?:[a-z ]+:\s*)?([1-5]\d\d)\b")
_HTTP_STATUS = re.compile(r"^HTTP/[\d.]+ ([1-5]\d\d)\b")
_BARE_STATUSES = re.compile(r"^(?:[1-5]\d\d\s*)+$")

#: Runs the example with every curl call's final status appended to $STATUSES, what it
#: printed to $BODIES, and to $CALLS its arguments, what the user's first window had left
#: before it (asked of ``GET /v1/usage``, which is free, with the call's X-Atto-* headers)
#: and its answer's headers; each call's record ended by ``_CALL_END``.
_PRELUDE = r"""
curl() {
  local arg previous="" identity=() before=""
  for arg in "$@"; do
    if [ "$previous" = -H ]; then
      case "$arg" in [Xx]-[Aa]tto-*) identity+=(-H "$arg") ;; esac
    fi
    previous="$arg"
  done
  if [ ${#identity[@]} -gt 0 ]; then
    before=$(command curl -s "$SERVER/v1/usage" "${identity[@]}" \
      | grep -o '"remaining":[0-9]*' | head -n 1)
  fi
  command curl --dump-header "$HEADERS" "$@" | tee -a "$BODIES"
  local rc=${PIPESTATUS[0]}
  printf '\n\036\n' >> "$BODIES"
  { printf '%s\nbefore %s\n' "$*" "$before"; cat "$HEADERS"; printf '\n\036\n'; } >> "$CALLS"
  grep -a '^HTTP/' "$HEADERS" | tail -n 1 | cut -d' ' -f2 >> "$STATUSES"
  : > "$HEADERS"
  return $rc
}
"""
_CALL_END = "\n\x1e\n"


#: Runs an operator example: ``atto-admin`` and ``make admin ARGS=...`` as the Makefile
#: runs them (``python -m atto_admin``), stopping at the first command that fails.
_CLI_PRELUDE = r"""
atto-admin() { "$PYTHON" -m atto_admin "$@"; }
make() {
  if [ "$1" != admin ] || [ "${2%%=*}" != ARGS ]; then
    echo "not an admin example: make $*" >&2; return 2
  fi
  eval "atto-admin ${2#ARGS=}"
}
set -eo pipefail
"""


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


def _first_json(text: str) -> object:
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


@dataclass(frozen=True)
class Example:
    """One shell block that runs curl, and the statuses its document shows for it."""

    where: str
    script: str
    expected: tuple[int, ...]
    python: bool = False
    cli: bool = False
    shown: tuple[Answer, ...] = ()
    comments: tuple[str, ...] = ()


def documents() -> list[Path]:
    """The README, then each docs/ file in the order the README links them."""
    readme = ROOT / "README.md"
    linked = re.findall(r"\]\((docs/[\w-]+\.md)\)", readme.read_text(encoding="utf-8"))
    ordered = list(dict.fromkeys(linked))
    rest = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    return [readme, *(ROOT / name for name in ordered + [r for r in rest if r not in ordered])]


def _blocks(text: str) -> list[tuple[str, list[str], int]]:
    """Every fenced block: (language, lines, line number of its opening fence)."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        blocks.append((match[1], body, start))
        i += 1
    return blocks


def _status_comments(body: list[str]) -> list[str]:
    """Each status comment of a block, with the comment lines that continue it (a comment
    line that names no status, up to the next command), as one line."""
    comments: list[str] = []
    open_ = False
    for line in body:
        if _STATUS_COMMENT.match(line):
            comments.append(line)
            open_ = True
        elif open_ and line.startswith("#"):
            comments[-1] += " " + line.lstrip("#").strip()
        else:
            open_ = False
    return comments


def examples() -> list[Example]:
    """Every curl example of every document, in reading order."""
    found = []
    for document in documents():
        blocks = _blocks(document.read_text(encoding="utf-8"))
        for n, (language, body, line) in enumerate(blocks):
            where = f"{document.relative_to(ROOT)}:{line}"
            if language == "python" and any(DOC_SERVER in ln for ln in body):
                found.append(Example(where, "\n".join(body), (0,), python=True))
                continue
            if language in ("sh", "bash", "shell") and any(
                    re.match(r"\s*(atto-admin|make admin)\s", ln) for ln in body):
                found.append(Example(where, "\n".join(body), (0,), cli=True))
                continue
            if language not in ("sh", "bash", "shell") or not any(
                    re.search(r"(^|[\s;(])curl\s", ln) for ln in body):
                continue
            expected = [int(m[1]) for ln in body if (m := _STATUS_COMMENT.match(ln))]
            comments = _status_comments(body)
            shown: list[Answer] = []
            if not expected and n + 1 < len(blocks) and blocks[n + 1][0] == "":
                for out in blocks[n + 1][1]:
                    if match := _HTTP_STATUS.match(out):
                        expected.append(int(match[1]))
                    elif _BARE_STATUSES.match(out.strip()):
                        expected.extend(int(s) for s in out.split())
                shown = answers("\n".join(blocks[n + 1][1]))
            found.append(Example(where, "\n".join(body), tuple(expected), shown=tuple(shown),
                                 comments=tuple(comments)))
    return found


def test_every_example_shows_its_statuses() -> None:
    """Each curl example documents at least one status (a comment or an output block), and
    docs/operator.md's and docs/client.md's examples are among those run."""
    found = examples()
    assert len(found) >= 5
    assert [e.where for e in found if not e.expected] == []
    assert any(e.cli and e.where.startswith("docs/operator.md") for e in found)
    assert any(e.python and e.where.startswith("docs/client.md") for e in found)
    shown = [a for e in found if e.where.startswith("README.md") for a in e.shown]
    assert len(shown) >= 3 and all(isinstance(a.body, dict) for a in shown)


def test_examples_pasted_in_order_answer_as_documented() -> None:
    """On a fresh `make serve`, each example, run in document order, answers its statuses,
    and the answers its output block shows, field by field."""
    results, shown_wrong = [], []
    with serving.serve() as served, tempfile.TemporaryDirectory() as tmp:
        for example in examples():
            statuses, headers = Path(tmp, "statuses"), Path(tmp, "headers")
            bodies, calls = Path(tmp, "bodies"), Path(tmp, "calls")
            for file in (statuses, bodies, calls):
                file.write_text("")
            script = (example.script.replace(DOC_SERVER, served.url)
                      .replace(DOC_EMULATOR, served.emulator_url))
            if example.python:
                out = subprocess.run([sys.executable, "-c", script], cwd=tmp, text=True,
                                     capture_output=True, timeout=300)
                results.append((example.where, example.expected, (out.returncode,),
                                (out.stdout + out.stderr)[-600:]))
                continue
            if example.cli:
                env = {k: v for k, v in os.environ.items()
                       if k not in ("ATTO_ADMIN_URL", "ATTO_STACK")}
                env.update({"PYTHON": sys.executable, "PORT": served.url.rsplit(":", 1)[1],
                            "PYTHONPATH": os.pathsep.join(
                                [str(ROOT / "tools"), env.get("PYTHONPATH", "")]),
                            "STATUSES": str(statuses), "HEADERS": str(headers),
                            "BODIES": str(bodies), "CALLS": str(calls),
                            "SERVER": served.url})
                out = subprocess.run(["bash", "-c", _PRELUDE + _CLI_PRELUDE + script],
                                     cwd=tmp, text=True, capture_output=True, timeout=300,
                                     env=env)
                results.append((example.where, example.expected, (out.returncode,),
                                (out.stdout + out.stderr)[-600:]))
                continue
            out = subprocess.run(["bash", "-c", _PRELUDE + script], cwd=tmp, text=True,
                                 capture_output=True, timeout=300,
                                 env={**os.environ, "STATUSES": str(statuses),
                                      "HEADERS": str(headers), "BODIES": str(bodies),
                                      "CALLS": str(calls), "SERVER": served.url})
            got = tuple(int(s) for s in statuses.read_text().split())
            results.append((example.where, example.expected, got, out.stdout[-300:]))
            if example.shown:
                shown_wrong += [f"{example.where}: {d}" for d in answer_differences(
                    list(example.shown), answers(out.stdout))]
            charges = [charge(call) for call in calls.read_text().split(_CALL_END)]
            for comment, body, charged in zip(example.comments, bodies.read_text().split(
                    _CALL_END), charges, strict=False):
                shown_wrong += [f"{example.where}: {d}" for d in (
                    comment_differences(comment, _first_json(body))
                    + charge_differences(comment, charged))]
    wrong = [r for r in results if r[1] != r[2]]
    assert wrong == [], "\n".join(f"{w}: documented {e}, got {g}: {o}" for w, e, g, o in wrong)
    assert shown_wrong == [], "\n".join(shown_wrong)
