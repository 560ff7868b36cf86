"""OpenAI-compatible chat completions and embeddings (family ``llm``).

``POST /v1/chat/completions`` answers a ``chat.completion`` (or a stream of
``chat.completion.chunk`` events with ``stream: true``). With ``response_format``
``json_schema`` the content is a JSON instance valid for the schema; with ``json_object``
a small JSON object; otherwise text. ``strict: true`` schemas are checked against the two
rules OpenAI enforces (``additionalProperties: false`` on every object, every property
required) and rejected with OpenAI's 400 otherwise. Forced tool calls (``tools`` with
``tool_choice``) get arguments valid for the function's parameters.

``POST /v1/embeddings`` answers unit vectors built by feature hashing of the words, so
texts that share words are close; ``dimensions`` truncates and renormalises the same
vector, like the ``text-embedding-3`` models. Vectors have the model's own length unless
``dimensions`` is given: 3072 for ``text-embedding-3-large``, else 1536.

As the real API does, a chat answer names the dated snapshot of an alias it was asked for
(``gpt-4o-mini`` answers ``gpt-4o-mini-2024-07-18``); an embeddings answer names the model
as asked. ``fail_next`` kinds ``refusal``, ``length``, ``content_filter`` and
``nonconforming`` shape the next chat answer (a 200) instead of its content.
"""

from __future__ import annotations

import base64
import json
import math
import random
import re
import struct
import time
from functools import lru_cache
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .dialects import ApiFault
from .gate import request_json
from .schema_instances import generate_instance
from .state import EmulatorState
from .text import digest, estimate_tokens, keywords, rng_for, stable_int

DEFAULT_DIMENSIONS = 1536
#: Vector length of the models whose own is not ``DEFAULT_DIMENSIONS``.
MODEL_DIMENSIONS = {"text-embedding-3-large": 3072}
MAX_DIMENSIONS = 3072
#: The snapshot each chat alias answers with (OpenAI's model list).
SNAPSHOTS = {"gpt-4o-mini": "gpt-4o-mini-2024-07-18", "gpt-4o": "gpt-4o-2024-08-06",
             "gpt-4.1": "gpt-4.1-2025-04-14", "gpt-4.1-mini": "gpt-4.1-mini-2025-04-14",
             "gpt-4.1-nano": "gpt-4.1-nano-2025-04-14"}
REFUSAL = "I'm sorry, but I can't help with that request."
MAX_INPUTS = 2048
_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


# -- auth and cost ---------------------------------------------------------------------

async def openai_auth(request: Request) -> ApiFault | None:
    """401 unless ``Authorization: Bearer <key>`` (any non-empty key)."""
    header = request.headers.get("authorization", "")
    if not header:
        return ApiFault(401, "You didn't provide an API key. You need to provide your API key "
                             "in an Authorization header using Bearer auth (i.e. Authorization: "
                             "Bearer YOUR_KEY).", kind="auth", details={"code": None})
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return ApiFault(401, "Incorrect API key provided. You can find your API key at "
                             "https://platform.openai.com/account/api-keys.", kind="auth")
    return None


async def chat_cost(request: Request) -> int:
    """Tokens a chat request reserves: the prompt estimate plus ``max_tokens``."""
    body = await request_json(request)
    if not isinstance(body, dict):
        return 0
    prompt = _prompt_tokens(body.get("messages") or [], body.get("response_format"))
    limit = body.get("max_completion_tokens", body.get("max_tokens")) or 0
    return prompt + (int(limit) if isinstance(limit, int) else 0)


async def embeddings_cost(request: Request) -> int:
    """Tokens an embeddings request uses."""
    body = await request_json(request)
    try:
        return sum(estimate_tokens(t) for t in _inputs(body.get("input")))
    except (ApiFault, AttributeError):
        return 0


# -- chat completions ------------------------------------------------------------------

async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    emu: EmulatorState = request.app.state.emulator
    body = await request_json(request)
    if not isinstance(body, dict):
        raise ApiFault(400, "The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiFault(400, "you must provide a model parameter", details={"param": "model"})
    messages = _check_messages(body.get("messages"))
    n = body.get("n", 1)
    if not isinstance(n, int) or not 1 <= n <= 128:
        raise ApiFault(400, f"Invalid value for 'n': {n!r}.", details={"param": "n"})
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ApiFault(400, f"Invalid 'max_tokens': {limit!r}.", details={"param": "max_tokens"})
    fmt = body.get("response_format")
    schema = _response_schema(fmt, messages)
    prompt_text = "\n".join(_text_of(m) for m in messages)
    user_text = next((_text_of(m) for m in reversed(messages) if m.get("role") == "user"),
                     prompt_text)
    seed = digest(model, json.dumps(messages, sort_keys=True, default=str),
                  json.dumps(fmt, sort_keys=True, default=str))
    tool = _forced_tool(body, messages)
    forced = getattr(request.state, "forced_kind", "")

    choices = []
    completion_tokens = 0
    for index in range(n):
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None,
                                   "annotations": []}
        finish = "stop"
        if tool is not None:
            name, parameters = tool
            args = generate_instance(parameters, seed=(seed, index, name), hint=user_text)
            arguments = json.dumps(args, separators=(",", ":"), ensure_ascii=False)
            message["tool_calls"] = [{"id": f"call_{digest(seed, index).hex()[:24]}",
                                      "type": "function",
                                      "function": {"name": name, "arguments": arguments}}]
            tokens = estimate_tokens(arguments)
            finish = "tool_calls"
        else:
            content = _content(fmt, schema, user_text, model, (seed, index))
            if forced == "nonconforming":
                content = _nonconforming(schema)
            tokens = estimate_tokens(content)
            if limit is not None and tokens > limit:
                content, tokens, finish = content[:limit * 4], limit, "length"
            if forced == "length":
                content, tokens, finish = content[:max(1, len(content) // 2)], tokens, "length"
            elif forced == "content_filter":
                content, finish = None, "content_filter"
            elif forced == "refusal":
                content, tokens = None, estimate_tokens(REFUSAL)
                message["refusal"] = REFUSAL
            message["content"] = content
        completion_tokens += tokens
        choices.append({"index": index, "message": message, "logprobs": None,
                        "finish_reason": finish})

    prompt_tokens = _prompt_tokens(messages, fmt)
    fam = emu.families["llm"]
    fam.prompt_tokens += prompt_tokens
    fam.completion_tokens += completion_tokens
    completion = {
        "id": f"chatcmpl-{digest(seed, emu.next_id()).hex()[:29]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": SNAPSHOTS.get(model, model),
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                  "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                                "accepted_prediction_tokens": 0,
                                                "rejected_prediction_tokens": 0}},
        "service_tier": "default",
        "system_fingerprint": "fp_emulator",
    }
    headers = {"x-request-id": f"req_{digest(seed, emu.sequence).hex()[:32]}",
               "openai-processing-ms": "1"}
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(completion, include_usage),
                                 media_type="text/event-stream", headers=headers)
    return JSONResponse(completion, headers=headers)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise ApiFault(400, "Missing required parameter: 'messages'.",
                       details={"param": "messages", "code": "missing_required_parameter"})
    if not messages:
        raise ApiFault(400, "Invalid 'messages': empty array. Expected an array with minimum "
                            "length 1, but got an empty array instead.",
                       details={"param": "messages", "code": "empty_array"})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ApiFault(400, f"Invalid value for 'messages[{i}].role'.",
                           details={"param": f"messages[{i}].role", "code": "invalid_value"})
        content = m.get("content")
        if content is None and not m.get("tool_calls") and m.get("role") != "assistant":
            raise ApiFault(400, f"Missing required parameter: 'messages[{i}].content'.",
                           details={"param": f"messages[{i}].content",
                                    "code": "missing_required_parameter"})
    return messages


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _prompt_tokens(messages: list[Any], fmt: Any) -> int:
    total = 3
    for m in messages:
        if isinstance(m, dict):
            total += 4 + estimate_tokens(_text_of(m))
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        total += estimate_tokens(json.dumps((fmt.get("json_schema") or {}).get("schema", {})))
    return total


def _response_schema(fmt: Any, messages: list[Any]) -> Any:
    """The schema to answer with (``None`` for text), after OpenAI's request checks."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise ApiFault(400, f"Invalid value: {kind!r}. Supported values are: 'json_object', "
                            "'json_schema', and 'text'.",
                       details={"param": "response_format.type", "code": "invalid_value"})
    if fmt["type"] == "json_object":
        if not any("json" in _text_of(m).lower() for m in messages):
            raise ApiFault(400, "'messages' must contain the word 'json' in some form, to use "
                                "'response_format' of type 'json_object'.",
                           details={"param": "messages"})
        return None
    if fmt["type"] == "text":
        return None
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiFault(400, "Missing required parameter: 'response_format.json_schema'.",
                       details={"param": "response_format.json_schema",
                                "code": "missing_required_parameter"})
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ApiFault(400, "Invalid 'response_format.json_schema.name': string does not match "
                            "pattern. Expected a string that matches the pattern "
                            "'^[a-zA-Z0-9_-]+$'.",
                       details={"param": "response_format.json_schema.name",
                                "code": "invalid_value"})
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise ApiFault(400, f"Invalid schema for response_format '{name}': schema must be a "
                            "JSON object.", details={"param": "response_format",
                                                     "code": "invalid_json_schema"})
    if spec.get("strict") is True:
        problem = strict_schema_problem(schema)
        if problem:
            raise ApiFault(400, f"Invalid schema for response_format '{name}': {problem}",
                           details={"param": "response_format", "code": "invalid_json_schema"})
    return schema


def strict_schema_problem(schema: Any) -> str | None:
    """Why OpenAI's strict mode would reject ``schema``, or ``None``.

    Checks the rules that reject most schemas in practice: the root is an object, every
    object sets ``additionalProperties: false`` and lists every property in ``required``.
    """
    if not isinstance(schema, dict) or schema.get("type") != "object":
        got = schema.get("type") if isinstance(schema, dict) else type(schema).__name__
        return f"schema must be a JSON Schema of 'type: \"object\"', got 'type: \"{got}\"'."
    return _strict_walk(schema, ())


def _strict_walk(node: Any, path: tuple[str, ...]) -> str | None:
    if not isinstance(node, dict):
        return None
    types = node.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or \
        "properties" in node
    if is_object:
        if node.get("additionalProperties") is not False:
            return (f"In context={path!r}, 'additionalProperties' is required to be supplied "
                    "and to be false.")
        required = node.get("required") or []
        for key in node.get("properties") or {}:
            if key not in required:
                return (f"In context={path!r}, 'required' is required to be supplied and to be "
                        f"an array including every key in properties. Missing '{key}'.")
    for key, sub in (node.get("properties") or {}).items():
        found = _strict_walk(sub, path + ("properties", key))
        if found:
            return found
    if isinstance(node.get("items"), dict):
        found = _strict_walk(node["items"], path + ("items",))
        if found:
            return found
    for keyword in ("anyOf", "allOf"):
        for i, sub in enumerate(node.get(keyword) or []):
            found = _strict_walk(sub, path + (keyword, str(i)))
            if found:
                return found
    for keyword in ("$defs", "definitions"):
        for name, sub in (node.get(keyword) or {}).items():
            found = _strict_walk(sub, path + (keyword, name))
            if found:
                return found
    return None


def _forced_tool(body: dict[str, Any], messages: list[Any]) -> tuple[str, Any] | None:
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)
             and t.get("type") == "function" and isinstance(t.get("function"), dict)]
    choice = body.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    by_name = {t["function"].get("name"): t["function"] for t in tools}
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in by_name:
            raise ApiFault(400, f"Invalid value for 'tool_choice': no function named {name!r} "
                                "was specified in the 'tools' parameter.",
                           details={"param": "tool_choice"})
        function = by_name[name]
    elif choice == "required" or (choice == "auto" and messages[-1].get("role") != "tool"):
        function = tools[0]["function"]
    else:
        return None
    return str(function.get("name")), function.get("parameters") or {"type": "object"}


def _content(fmt: Any, schema: Any, user_text: str, model: str, seed: object) -> str:
    kind = fmt.get("type") if isinstance(fmt, dict) else "text"
    if kind == "json_schema":
        value = generate_instance(schema, seed=seed, hint=user_text)
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    words = keywords(user_text, 6)
    topic = ", ".join(words) if words else "your request"
    rng = rng_for("reply", seed)
    if kind == "json_object":
        return json.dumps({"answer": f"An emulated answer about {topic}.",
                           "topics": words[:3], "confidence": round(rng.uniform(0.6, 0.95), 2)},
                          separators=(",", ":"))
    return (f"This is an emulated reply from {model} about {topic}. "
            f"It is deterministic (variant {stable_int(seed) % 1000}).")


def _nonconforming(schema: Any) -> str:
    """JSON of a type the schema's root does not allow (anything fits a schema with none)."""
    root = schema.get("type") if isinstance(schema, dict) else None
    return "[]" if root == "object" or (isinstance(root, list) and "object" in root
                                        and "array" not in root) else '{"unexpected": true}'


def _stream(completion: dict[str, Any], include_usage: bool):  # type: ignore[no-untyped-def]
    base = {k: completion[k] for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"

    def event(choices: list[Any], **extra: Any) -> str:
        return "data: " + json.dumps({**base, "choices": choices, **extra}) + "\n\n"

    for choice in completion["choices"]:
        i, message = choice["index"], choice["message"]
        yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
        if message.get("tool_calls"):
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            yield event([{"index": i, "delta": {"tool_calls": calls}, "logprobs": None,
                          "finish_reason": None}])
        content = message.get("content") or ""
        for start in range(0, len(content), 16):
            yield event([{"index": i, "delta": {"content": content[start:start + 16]},
                          "logprobs": None, "finish_reason": None}])
        yield event([{"index": i, "delta": {}, "logprobs": None,
                      "finish_reason": choice["finish_reason"]}])
    if include_usage:
        yield event([], usage=completion["usage"])
    yield "data: [DONE]\n\n"


# -- embeddings ------------------------------------------------------------------------

async def embeddings(request: Request) -> Response:
    """``POST /v1/embeddings``."""
    emu: EmulatorState = request.app.state.emulator
    body = await request_json(request)
    if not isinstance(body, dict):
        raise ApiFault(400, "The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiFault(400, "you must provide a model parameter", details={"param": "model"})
    texts = _inputs(body.get("input"))
    dims = body.get("dimensions", MODEL_DIMENSIONS.get(model, DEFAULT_DIMENSIONS))
    if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= MAX_DIMENSIONS:
        raise ApiFault(400, f"Invalid value for 'dimensions': {dims!r}. It must be an integer "
                            f"between 1 and {MAX_DIMENSIONS}.", details={"param": "dimensions"})
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiFault(400, f"Invalid value for 'encoding_format': {encoding!r}. Supported "
                            "values are: 'float' and 'base64'.",
                       details={"param": "encoding_format"})
    data = []
    tokens = 0
    for index, text in enumerate(texts):
        vector = embed_text(text, dims)
        tokens += estimate_tokens(text)
        if encoding == "base64":
            packed: Any = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
        else:
            packed = vector
        data.append({"object": "embedding", "index": index, "embedding": packed})
    emu.families["llm"].prompt_tokens += tokens
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _inputs(raw: Any) -> list[str]:
    """The texts of an ``input``: a string, strings, a token array or token arrays."""
    invalid = ApiFault(400, "'$.input' is invalid. Please check the API reference: "
                            "https://platform.openai.com/docs/api-reference.",
                       details={"param": "input"})
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        items = [" ".join(map(str, raw))]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise invalid
    if len(items) > MAX_INPUTS:
        raise invalid
    texts = []
    for item in items:
        if isinstance(item, list) and item and all(isinstance(t, int) for t in item):
            texts.append(" ".join(map(str, item)))
        elif isinstance(item, str) and item:
            texts.append(item)
        else:
            raise invalid
    return texts


def embed_text(text: str, dims: int = DEFAULT_DIMENSIONS) -> list[float]:
    """A deterministic unit vector: hashed word features plus a whole-text feature.

    The first ``k`` components do not depend on ``dims``, so a shorter vector is the
    longer one truncated and renormalised.
    """
    words = re.findall(r"\w+", text.lower())
    features = [(w, 1.0) for w in words] + [("\x00" + text, 0.35)]
    acc = [0.0] * dims
    for feature, weight in features:
        for i, x in enumerate(_feature_vector(feature, dims)):
            acc[i] += weight * x
    norm = math.sqrt(sum(x * x for x in acc)) or 1.0
    return [round(x / norm, 8) for x in acc]


@lru_cache(maxsize=20_000)
def _feature_vector(feature: str, dims: int) -> tuple[float, ...]:
    rng = random.Random(digest("embedding", feature))
    return tuple(rng.gauss(0.0, 1.0) for _ in range(dims))


async def models(request: Request) -> Response:
    """``GET /v1/models`` (not metered): a fixed list."""
    names = ("gpt-4o-mini", "gpt-4o", "gpt-4.1-mini", "text-embedding-3-small",
             "text-embedding-3-large")
    return JSONResponse({"object": "list", "data": [
        {"id": n, "object": "model", "created": 1700000000, "owned_by": "emulator"}
        for n in names]})
