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

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import serving
from tests.shown_answers import (
    Answer,
    answer_differences,
    answers,
    charge,
    charge_differences,
    comment_differences,
    first_json,
)

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
                    comment_differences(comment, first_json(body))
                    + charge_differences(comment, charged))]
    wrong = [r for r in results if r[1] != r[2]]
    assert wrong == [], "\n".join(f"{w}: documented {e}, got {g}: {o}" for w, e, g, o in wrong)
    assert shown_wrong == [], "\n".join(shown_wrong)
