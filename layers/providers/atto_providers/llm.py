"""OpenAI-compatible chat completions (structured output) and embeddings.

Any server that speaks the OpenAI API works: OpenAI, Ollama, vLLM, or the offline
emulator. ``LLM_BASE_URL`` (default ``https://api.openai.com/v1``), ``LLM_MODEL``,
``LLM_EMBEDDING_MODEL``, and the key from ``LLM_SECRET_ARN`` or ``LLM_API_KEY``.

A caller may name another model only if the deployment offers it: ``LLM_MODELS`` and
``LLM_EMBEDDING_MODELS`` (comma-separated; by default only the default model), since a
route's price in tokens does not depend on the model.

Structured output asks for strict mode (``json_schema.strict: true``, a guaranteed valid
answer) whenever the caller's schema fits it (``atto_providers.strict``), else for the
plain mode; the answer is validated against the caller's schema either way, and
``Completion.strict`` says which mode was used. A strict request the provider rejects for
its schema is sent once more without strict mode. The provider's answer is read as the
SDK reads it: ``finish_reason`` ``length`` is 502 ``output_truncated``, ``content_filter``
is 422 ``content_filtered`` and a ``refusal`` is 422 ``model_refused``; a 400 about the
caller's schema is 422 ``schema_rejected`` with the provider's reason (all refunded).

OpenAI's rate limits are per model, so the throttle is per model too (``LLM_THROTTLE_BY``
``model``, the default: each model has its own ``LLM_RATE`` and its own 429 pause, so a
429 of the embedding model does not hold chat back), or ``provider`` for one throttle of
every model (a server whose limit is shared).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from usage_limits.exceptions import InvalidArgument
from usage_limits.web.errors import (
    ApiError,
    ContentFiltered,
    InvalidRequest,
    ModelRefused,
    OutputTruncated,
    ProviderError,
    SchemaRejected,
)

from .base import MAX_REASON_CHARS, ProviderClient, UpstreamFault
from .patterns import UnsupportedPattern, check_schema_patterns, validator_for
from .secrets import provider_secret
from .strict import strict_schema

log = logging.getLogger("atto_providers")

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_MODEL = "gpt-4o-mini"
DEFAULT_EMBEDDING_MODEL = "text-embedding-3-small"
#: ``LLM_THROTTLE_BY`` values: one throttle per model, or one for the provider.
THROTTLE_BY = ("model", "provider")
SYSTEM_PROMPT = ("You answer with a single JSON value that is valid for the given JSON Schema. "
                 "Do not add commentary.")


@dataclass(frozen=True)
class Completion:
    """A structured answer: ``data`` is valid for the requested schema.

    Attributes:
        data: the answer, valid for the caller's schema.
        model: the model that answered (as the provider names it: a dated snapshot).
        prompt_tokens, completion_tokens: the provider's count (0 when it sent none).
        strict: whether strict mode was used (the schema fit it).
        strict_rejected: the provider's reason when it refused the schema in strict mode
            and this answer was asked without it (``strict`` is then False); else None.
    """

    data: Any
    model: str
    prompt_tokens: int
    completion_tokens: int
    strict: bool = False
    strict_rejected: str | None = None


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
        self.throttle_by = (env.get("LLM_THROTTLE_BY", "").strip().lower() or "model")
        if self.throttle_by not in THROTTLE_BY:
            raise InvalidArgument(f"LLM_THROTTLE_BY={self.throttle_by!r} must be one of "
                                  f"{', '.join(THROTTLE_BY)}")

    def _throttle_key(self, model: str) -> str | None:
        """The throttle a call of ``model`` takes its slot from (``LLM_THROTTLE_BY``)."""
        return model if self.throttle_by == "model" else None

    def caller_error(self, fault: UpstreamFault) -> ApiError | None:
        """A 400 about the schema of ``response_format``: the caller's to fix (422)."""
        param = fault.param or ""
        if fault.status == 400 and (fault.code == "invalid_json_schema" or (
                param.startswith("response_format") and "schema" in fault.message.lower())):
            return SchemaRejected(f"the {self.name} provider rejected the schema; tokens "
                                  "refunded", reason=fault.message or None, provider=self.name)
        return None

    def _headers(self) -> dict[str, str]:
        key = provider_secret(self.name, self.env).get("api_key", "")
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def structured(self, prompt: str, schema: dict[str, Any], *,
                         model: str | None = None) -> Completion:
        """Ask for a JSON value valid for ``schema``; the answer is checked before it returns.

        Raises:
            InvalidRequest: the schema has a regex that cannot be checked in linear time
                (refused before the provider is called).
            SchemaRejected: the provider refused the caller's schema (422, its reason).
            OutputTruncated, ContentFiltered, ModelRefused: the answer was cut at the
                output limit, filtered, or refused (see ``_answer``).
            ProviderError: the provider failed, or its answer is not valid for the schema.
            ProviderQuotaExceeded: the provider's account is out of quota.
            ProviderBusy: no provider slot within the deadline.
        """
        try:
            check_schema_patterns(schema)
        except UnsupportedPattern as exc:
            raise InvalidRequest(f"the schema cannot be checked: {exc}") from exc
        chosen = _choose(model, self.model, self.models)
        strict = strict_schema(schema)
        rejected: str | None = None
        try:
            data = await self._complete(prompt, chosen, strict or schema, strict is not None)
        except SchemaRejected as exc:
            if strict is None:
                raise
            # Strict mode's subset as the provider has it now may be narrower than ours:
            # the caller's schema as it is, without the guarantee, is still worth a try.
            # Its answer is validated like any other, so one served is charged like any
            # other; the answer says strict mode was refused (docs/api.md).
            log.warning("the llm provider rejected a strict schema; asking without strict")
            strict = None
            rejected = str(exc.extra.get("reason") or exc.message)
            data = await self._complete(prompt, chosen, schema, False)
        value = _answer(data)
        _check(value, schema)
        usage = data.get("usage")
        if not isinstance(usage, dict):
            log.warning("the llm provider's answer has no usage; counted as 0 tokens")
            usage = {}
        return Completion(value, str(data.get("model") or chosen),
                          int(usage.get("prompt_tokens") or 0),
                          int(usage.get("completion_tokens") or 0), strict is not None,
                          rejected)

    async def _complete(self, prompt: str, model: str, schema: dict[str, Any],
                        strict: bool) -> Any:
        """One chat completion asking for ``schema`` (in strict mode or not)."""
        body = {
            "model": model,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": prompt}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "result", "schema": schema,
                                                "strict": strict}},
        }
        return await self.request("POST", "/chat/completions", json=body,
                                  headers=self._headers(), throttle_key=self._throttle_key(model))

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
        data = await self.request("POST", "/embeddings", json=body, headers=self._headers(),
                                  throttle_key=self._throttle_key(body["model"]))
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


def _answer(data: Any) -> Any:
    """The JSON value of the first choice, read as the OpenAI SDK reads it.

    Raises:
        OutputTruncated: ``finish_reason`` is ``length`` (the output limit cut it).
        ContentFiltered: ``finish_reason`` is ``content_filter``.
        ModelRefused: the message is a ``refusal``.
        ProviderError: no choice, no content, or content that is not JSON.
    """
    try:
        choice = data["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ProviderError("the llm provider sent no usable answer", provider="llm") from exc
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    if finish == "length":
        # no "tokens refunded" here: a 502's message ends with errors.REFUNDED already
        raise OutputTruncated("the answer reached the model's output limit before it was "
                              "complete", provider="llm")
    if finish == "content_filter":
        raise ContentFiltered("the provider's content filter stopped the answer; tokens "
                              "refunded", provider="llm")
    refusal = message.get("refusal") if isinstance(message, dict) else None
    if isinstance(refusal, str) and refusal:
        raise ModelRefused("the model declined to answer; tokens refunded",
                           refusal=refusal[:MAX_REASON_CHARS], provider="llm")
    try:
        return json.loads(message["content"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProviderError("the llm provider sent no usable answer", provider="llm") from exc


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
