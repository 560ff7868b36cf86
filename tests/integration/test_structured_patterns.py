"""A caller's JSON Schema regexes are matched in linear time: a backtracking pattern cannot
hold the event loop, and a regex that cannot be matched that way is refused before any
charge. Handlers run through Mangum with the real redis-server and a loopback LLM stub."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from local.lambda_events import http_event, invoke
from local.redis_servers import RedisServer
from tests.httpstub import HttpStub, chat_reply
from tests.ledger import used

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.conftest import StartEnvironment

ROOT = Path(__file__).resolve().parents[2]
structured = importlib.import_module("functions.structured.app")

#: Backtracking needs about 2**40 steps for this answer (hours); RE2 needs 41.
EVIL = "^(a+)+$"
ANSWER = "a" * 40 + "b"
#: Seconds the child process gets: the linear check takes milliseconds, the backtracking
#: one would take hours, so the bound decides nothing but which of the two ran.
CHILD_LIMIT_S = 60


def check_in_child(value: Any, schema: dict[str, Any]) -> str:
    """Run ``llm._check(value, schema)`` in a child process; its outcome's class name."""
    code = ("import json, sys\n"
            "from atto_providers.llm import _check\n"
            "value, schema = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
            "try:\n    _check(value, schema)\n    print('valid')\n"
            "except Exception as exc:\n    print(type(exc).__name__)\n")
    path = ":".join(str(ROOT / p) for p in (".", "layers/usage_limits", "layers/providers"))
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(value), json.dumps(schema)],
                              capture_output=True, text=True, timeout=CHILD_LIMIT_S,
                              env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"}, check=True)
    except subprocess.TimeoutExpired:
        return "still running"
    return done.stdout.strip()


def test_backtracking_pattern_is_checked_in_linear_time() -> None:
    """``^(a+)+$`` against 40 a's and a b is found invalid at once, not after hours."""
    assert check_in_child(ANSWER, {"type": "string", "pattern": EVIL}) == "ProviderError"


def test_backtracking_property_pattern_is_checked_in_linear_time() -> None:
    """A backtracking ``patternProperties`` key with ``additionalProperties: false`` too."""
    schema = {"type": "object", "patternProperties": {EVIL: {"type": "integer"}},
              "additionalProperties": False}
    assert check_in_child({ANSWER: 1}, schema) == "ProviderError"
    assert check_in_child({"aaa": 1}, schema) == "valid"


@pytest.fixture
def stub_llm(lambda_env: StartEnvironment, redis_server: RedisServer,
             request: pytest.FixtureRequest) -> Iterator[HttpStub]:
    """The structured function's environment with a loopback LLM answering ``param``."""
    with HttpStub([chat_reply(json.dumps(request.param))]) as stub:
        lambda_env({"REDIS_URL": redis_server.url, "ATTO_BUDGET": "100/1h",
                    "LLM_BASE_URL": stub.url, "LLM_API_KEY": "k", "LLM_RATE": "1000/s"},
                   unset=("ATTO_ENV", "LLM_SECRET_ARN"))
        yield stub


def ask(user: str, schema: dict[str, Any]) -> Any:
    return invoke(structured.handler, http_event("POST", "/v1/structured", user=user,
                                                 body={"prompt": "answer", "schema": schema}))


@pytest.mark.parametrize("stub_llm", [ANSWER], indirect=True)
def test_steered_answer_is_a_refunded_502(stub_llm: HttpStub) -> None:
    """An answer that would make ``^(a+)+$`` backtrack is a 502 at once, and refunded."""
    user = uuid.uuid4().hex
    res = ask(user, {"type": "string", "pattern": EVIL})
    assert res.status == 502
    assert res.body["error"]["code"] == "provider_error"
    assert used(user) == 0


@pytest.mark.parametrize("stub_llm", ["abc-123"], indirect=True)
def test_matching_answer_passes(stub_llm: HttpStub) -> None:
    """An answer that matches an ordinary pattern is returned and charged."""
    user = uuid.uuid4().hex
    res = ask(user, {"type": "string", "pattern": r"^[a-z]+-\d+$"})
    assert res.status == 200, res.body
    assert res.body["data"] == "abc-123"
    assert used(user) == 8


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": r"^(a)\1$"},
    {"type": "string", "pattern": "^(?=a)a$"},
    {"type": "object", "patternProperties": {"(x{1000}){1000}": {}}},
    {"type": "object", "patternProperties": {"^a": {}}, "unevaluatedProperties": False},
])
@pytest.mark.parametrize("stub_llm", ["a"], indirect=True)
def test_regex_that_cannot_be_linear_is_refused_before_any_charge(
        stub_llm: HttpStub, schema: dict[str, Any]) -> None:
    """A regex RE2 cannot run is a 422 naming it; nothing is charged, no provider called."""
    user = uuid.uuid4().hex
    res = ask(user, schema)
    assert res.status == 422, res.body
    assert "regex" in json.dumps(res.body) or "unevaluatedProperties" in json.dumps(res.body)
    assert stub_llm.seen == []
    assert used(user) == 0


# A generated corpus of nested schemas: whatever mixes of drafts, identifiers and references
# a caller sends, no caller regex reaches Python's ``re`` (jsonschema's keywords call ``re``
# through the module attribute ``re`` of these modules; a tripwire stands in for it).

#: The caller regexes of the corpus: none is a meta-schema's own pattern.
CORPUS_PATTERNS = (EVIL, "^(a|aa)+$", "(x+x+)+y", "^[a-z]+$", "a")
DRAFT_URIS = ("https://json-schema.org/draft/2020-12/schema",
              "https://json-schema.org/draft/2019-09/schema",
              "http://json-schema.org/draft-07/schema#", "http://json-schema.org/draft-06/schema#",
              "http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-03/schema#")
REFERENCES = ("#", "#/$defs/x", "#/definitions/x", "#meta", "#/properties/a", "#/$defs",
              "https://json-schema.org/draft/2020-12/schema",
              "https://json-schema.org/draft/2020-12/schema#meta",
              "https://json-schema.org/draft/2020-12/meta/validation", "urn:x")
TEXT = "a" * 24 + "b"


class CallerRegexOnRe(Exception):
    """A caller regex was handed to Python's backtracking ``re``."""


class Tripwire:
    """Python's ``re`` for jsonschema's modules, refusing the corpus's caller regexes."""

    def __init__(self) -> None:
        import re

        self.real, self.hits = re, []

    def _guard(self, pattern: Any) -> None:
        if isinstance(pattern, str) and pattern in CORPUS_PATTERNS:
            self.hits.append(pattern)
            raise CallerRegexOnRe(pattern)

    def search(self, pattern: Any, *args: Any, **kwargs: Any) -> Any:
        self._guard(pattern)
        return self.real.search(pattern, *args, **kwargs)

    def compile(self, pattern: Any, *args: Any, **kwargs: Any) -> Any:
        self._guard(pattern)
        return self.real.compile(pattern, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def corpus_schemas() -> Any:
    """Nested schemas mixing every keyword that holds a regex, a subschema or a reference."""
    from hypothesis import strategies as st

    patterns = st.sampled_from(CORPUS_PATTERNS)
    refs = st.sampled_from(REFERENCES)
    leaf = st.one_of(st.booleans(), st.fixed_dictionaries({}, optional={
        "pattern": patterns, "type": st.sampled_from(["string", "object", "array"]),
        "format": st.just("regex"), "$schema": st.sampled_from(DRAFT_URIS)}))

    def node(children: Any) -> Any:
        return st.fixed_dictionaries({}, optional={
            "$schema": st.sampled_from(DRAFT_URIS), "$id": st.sampled_from(["urn:x", "urn:y"]),
            "$ref": refs, "$dynamicRef": refs, "$recursiveRef": st.just("#"),
            "$dynamicAnchor": st.just("meta"), "$recursiveAnchor": st.booleans(),
            "pattern": patterns, "format": st.just("regex"),
            "patternProperties": st.dictionaries(patterns, children, max_size=2),
            "propertyNames": children, "additionalProperties": children,
            "unevaluatedProperties": children,
            "properties": st.dictionaries(st.sampled_from(["a", TEXT]), children, max_size=2),
            "$defs": st.fixed_dictionaries({"x": children}),
            "definitions": st.fixed_dictionaries({"x": children}),
            "allOf": st.lists(children, min_size=1, max_size=2),
            "anyOf": st.lists(children, min_size=1, max_size=2),
            "items": children, "prefixItems": st.lists(children, min_size=1, max_size=2),
            "contains": children, "not": children, "if": children, "then": children,
            "dependentSchemas": st.fixed_dictionaries({"a": children}),
            "extends": children})

    return st.recursive(leaf, node, max_leaves=12).filter(lambda s: isinstance(s, dict))


def corpus_values() -> Any:
    """Answers whose strings and names would make the corpus's regexes backtrack."""
    from hypothesis import strategies as st

    texts = st.sampled_from([TEXT, "aaaa", "x" * 24 + "y", ""])
    return st.recursive(texts | st.none(), lambda c: st.lists(c, max_size=3)
                        | st.dictionaries(st.sampled_from(["a", TEXT]), c, max_size=3),
                        max_leaves=8)


def refused_or_checked(schema: dict[str, Any], value: Any) -> str:
    """What the request model and the answer check do with ``schema``, under the tripwire."""
    import jsonschema
    from pydantic import ValidationError

    from atto_providers.llm import _check
    from usage_limits.web.errors import ProviderError

    tripwire = Tripwire()
    modules = [jsonschema._keywords, jsonschema._legacy_keywords, jsonschema._utils,
               jsonschema._format]
    with pytest.MonkeyPatch.context() as patch:
        for module in modules:
            patch.setattr(module, "re", tripwire)
        try:
            body = structured.StructuredIn(prompt="answer", schema=schema)
        except ValidationError:
            outcome = "refused"
        else:
            try:
                _check(value, body.json_schema)
                outcome = "valid"
            except ProviderError:
                outcome = "invalid"
    assert tripwire.hits == [], f"caller regexes reached re: {tripwire.hits}"
    return outcome


def test_generated_schemas_never_run_a_caller_regex_on_re() -> None:
    """Over generated nested schemas, each is refused or checked with no caller regex on ``re``."""
    from hypothesis import event, given

    @given(schema=corpus_schemas(), value=corpus_values())
    def check(schema: dict[str, Any], value: Any) -> None:
        event(refused_or_checked(schema, value))

    check()


@pytest.mark.parametrize("schema", [
    {"$schema": DRAFT_URIS[0], "properties": {"a": {"$ref": "#/$defs/x"}},
     "$defs": {"x": {"$schema": DRAFT_URIS[0], "pattern": EVIL}}},
    {"$defs": {"x": {"$schema": "http://json-schema.org/draft-07/schema#", "pattern": EVIL}},
     "$ref": "#/$defs/x"},
    {"$dynamicAnchor": "meta", "pattern": EVIL,
     "properties": {"a": {"$dynamicRef": "https://json-schema.org/draft/2020-12/schema#meta"}}},
    {"$schema": "https://example.com/not-a-draft", "pattern": EVIL},
])
def test_named_bypasses_are_refused(schema: dict[str, Any]) -> None:
    """A subschema naming its draft, a meta-schema reference, an unknown draft: each a 422."""
    assert refused_or_checked(schema, {"a": TEXT}) == "refused"


@pytest.mark.parametrize("dialect", DRAFT_URIS)
def test_reference_to_a_root_naming_its_draft_stays_linear(dialect: str) -> None:
    """A root that names its draft and is referenced again (``$ref: "#"``) is checked on RE2."""
    schema = {"$schema": dialect, "type": ["object", "string"], "pattern": EVIL,
              "properties": {"a": {"$ref": "#"}}}
    assert refused_or_checked(schema, {"a": TEXT}) == "invalid"
    assert refused_or_checked(schema, {"a": "aaaa"}) == "valid"


@pytest.mark.parametrize("stub_llm", [{"a": TEXT}], indirect=True)
def test_subschema_naming_its_draft_is_refused_before_any_charge(stub_llm: HttpStub) -> None:
    """Over HTTP, ``$schema`` in a ``$defs`` entry is a 422: nothing charged, no provider call."""
    user = uuid.uuid4().hex
    res = ask(user, {"$schema": DRAFT_URIS[0], "properties": {"a": {"$ref": "#/$defs/x"}},
                     "$defs": {"x": {"$schema": DRAFT_URIS[0], "pattern": EVIL}}})
    assert res.status == 422, res.body
    assert "$schema" in json.dumps(res.body)
    assert stub_llm.seen == []
    assert used(user) == 0
