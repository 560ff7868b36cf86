"""OpenAI-compatible chat completions (structured output) and embeddings.

Any server that speaks the OpenAI API works: OpenAI, Ollama, vLLM, or the offline
emulator. ``LLM_BASE_URL`` (default ``https://api.openai.com/v1``), ``LLM_MODEL``,
``LLM_EMBEDDING_MODEL``, and the key from ``LLM_SECRET_ARN`` or ``LLM_API_KEY``.

A caller may name another model only if the deployment offers it: ``LLM_MODELS`` and
``LLM_EMBEDDING_MODELS`` (comma-separated; by default only the default model), since a
route's price in tokens does not depend on the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from usage_limits.web.errors import InvalidRequest, ProviderError

from .base import ProviderClient
from .patterns import UnsupportedPattern, check_schema_patterns, validator_for
from .secrets import provider_secret

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_MODEL = "gpt-4o-mini"
DEFAULT_EMBEDDING_MODEL = "text-embedding-3-small"
SYSTEM_PROMPT = ("You answer with a single JSON value that is valid for the given JSON Schema. "
                 "Do not add commentary.")


@dataclass(frozen=True)
class Completion:
    """A structured answer: ``data`` is valid for the requested schema."""

    data: Any
    model: str
    prompt_tokens: int
    completion_tokens: int


class LLMClient(ProviderClient):
    """Chat completions with ``response_format: json_schema``, and embeddings."""

    name = "llm"
    default_rate = "20/s"
    default_burst = 2

    def __init__(self, *, env: Mapping[str, str] | None = None, redis: Any = None) -> None:
        env = os.environ if env is None else env
        super().__init__(env.get("LLM_BASE_URL", DEFAULT_BASE_URL), env=env, redis=redis)
        self.model = env.get("LLM_MODEL", DEFAULT_MODEL)
        self.embedding_model = env.get("LLM_EMBEDDING_MODEL", DEFAULT_EMBEDDING_MODEL)
        self.models = _offered(env.get("LLM_MODELS", ""), self.model)
        self.embedding_models = _offered(env.get("LLM_EMBEDDING_MODELS", ""),
                                         self.embedding_model)

    def _headers(self) -> dict[str, str]:
        key = provider_secret(self.name, self.env).get("api_key", "")
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def structured(self, prompt: str, schema: dict[str, Any], *,
                         model: str | None = None) -> Completion:
        """Ask for a JSON value valid for ``schema``; the answer is checked before it returns.

        Raises:
            InvalidRequest: the schema has a regex that cannot be checked in linear time
                (refused before the provider is called).
            ProviderError: the provider failed, or its answer is not valid for the schema.
            ProviderBusy: no provider slot within the deadline.
        """
        try:
            check_schema_patterns(schema)
        except UnsupportedPattern as exc:
            raise InvalidRequest(f"the schema cannot be checked: {exc}") from exc
        body = {
            "model": _choose(model, self.model, self.models),
            "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": prompt}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "result", "schema": schema}},
        }
        data = await self.request("POST", "/chat/completions", json=body, headers=self._headers())
        try:
            content = data["choices"][0]["message"]["content"]
            value = json.loads(content)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ProviderError("the llm provider sent no usable answer",
                                provider=self.name) from exc
        _check(value, schema)
        usage = data.get("usage") or {}
        return Completion(value, str(data.get("model") or body["model"]),
                          int(usage.get("prompt_tokens", 0)),
                          int(usage.get("completion_tokens", 0)))

    async def embed(self, texts: list[str], *, model: str | None = None,
                    dimensions: int | None = None) -> tuple[list[list[float]], str, int]:
        """Embeddings of ``texts`` in order: (vectors, model, prompt tokens).

        Raises:
            ProviderError: the provider failed or answered with the wrong number of vectors.
            ProviderBusy: no provider slot within the deadline.
        """
        body: dict[str, Any] = {"model": _choose(model, self.embedding_model,
                                                 self.embedding_models), "input": texts}
        if dimensions:
            body["dimensions"] = dimensions
        data = await self.request("POST", "/embeddings", json=body, headers=self._headers())
        try:
            rows = sorted(data["data"], key=lambda row: row["index"])
            vectors = [list(map(float, row["embedding"])) for row in rows]
        except (KeyError, TypeError, ValueError) as exc:
            raise ProviderError("the llm provider sent malformed embeddings",
                                provider=self.name) from exc
        if len(vectors) != len(texts):
            raise ProviderError("the llm provider sent the wrong number of embeddings",
                                provider=self.name)
        tokens = int((data.get("usage") or {}).get("prompt_tokens", 0))
        return vectors, str(data.get("model") or body["model"]), tokens


def _offered(listed: str, default: str) -> frozenset[str]:
    return frozenset({default, *(m.strip() for m in listed.split(",") if m.strip())})


def _choose(model: str | None, default: str, offered: frozenset[str]) -> str:
    """The model to call: the default, or an offered one the caller named.

    Raises:
        InvalidRequest: the caller named a model this deployment does not offer.
    """
    if model is None:
        return default
    if model not in offered:
        raise InvalidRequest(f"model {model[:100]!r} is not offered here; choose one of "
                             f"{sorted(offered)}", models=sorted(offered))
    return model


def _check(value: Any, schema: dict[str, Any]) -> None:
    """Raise ProviderError unless ``value`` is valid for the caller's ``schema``.

    The schema is the caller's: an empty ``referencing.Registry`` keeps every ``$ref`` to a
    URL unresolved. jsonschema's default registry downloads such references, which would let
    a request make this function send GET requests anywhere it can reach. The schema's
    regexes run on RE2, in linear time (see ``atto_providers.patterns``).
    """
    import jsonschema
    from referencing import Registry
    from referencing.exceptions import Unresolvable

    validator = validator_for(schema, Registry())
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except (Unresolvable, RecursionError) as exc:
        raise ProviderError("the schema's references cannot be resolved or never end",
                            provider="llm") from exc
    if error is not None:
        raise ProviderError("the llm provider's answer does not match the schema",
                            provider="llm", reason=error.message[:200]) from error


_client: LLMClient | None = None


def llm_client() -> LLMClient:
    """The process's LLM client (settings read once)."""
    global _client
    if _client is None:
        _client = LLMClient()
    return _client
