"""POST /v1/embeddings: embedding vectors for a batch of texts.

Priced by size, 1 token per started 8,000 characters of input (all texts together):
providers bill embeddings by input tokens, not by text, so 64 short texts cost what one
text of the same total length costs, and 64 full texts cost 64 times one.
"""

from __future__ import annotations

import usage_limits.coldstart  # noqa: F401  (first: no GC while loading; see its docstring)

# isort: split
from typing import Annotated

from fastapi import Depends
from pydantic import BaseModel, ConfigDict, Field

from atto_providers.llm import llm_client
from usage_limits.web import METERED_RESPONSES, create_app, lambda_handler, require_tokens
from usage_limits.web.costs import per_started

app = create_app("Atto Cloud: embeddings")

#: Texts per request and characters per text (~2,000 tokens, well under every model's limit).
MAX_TEXTS = 64
MAX_TEXT_CHARS = 8_000
MAX_DIMENSIONS = 3_072

Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]


class EmbeddingsIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input: list[Text] = Field(min_length=1, max_length=MAX_TEXTS,
                              description=f"1 to {MAX_TEXTS} texts, each 1 to "
                                          f"{MAX_TEXT_CHARS} characters.")
    model: str | None = Field(default=None, min_length=1, max_length=100,
                              pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
                              description="Embedding model; the deployment's default if omitted.")
    dimensions: int | None = Field(default=None, ge=1, le=MAX_DIMENSIONS,
                                   description="Length of each vector, for models that can "
                                               "shorten theirs; the model's own if omitted.")


#: 1 token per started MAX_TEXT_CHARS characters of input: one text always costs 1.
COST = per_started(EmbeddingsIn, lambda body: sum(len(text) for text in body.input),
                   size=MAX_TEXT_CHARS, what="characters of input")


class Embedding(BaseModel):
    index: int = Field(ge=0, description="Position of the text in `input`.")
    embedding: list[float]


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int = Field(ge=0, description="Tokens the provider counted in the input.")


class EmbeddingsOut(BaseModel):
    data: list[Embedding] = Field(description="One vector per text, in input order.")
    model: str
    usage: EmbeddingsUsage


@app.post("/v1/embeddings", dependencies=[Depends(require_tokens(cost=COST))],
          responses=METERED_RESPONSES)
async def embeddings(body: EmbeddingsIn) -> EmbeddingsOut:
    """Embed every text of ``input``, in order."""
    vectors, model, tokens = await llm_client().embed(body.input, model=body.model,
                                                      dimensions=body.dimensions)
    return EmbeddingsOut(data=[Embedding(index=i, embedding=v) for i, v in enumerate(vectors)],
                         model=model, usage=EmbeddingsUsage(prompt_tokens=max(0, tokens)))


handler = lambda_handler(app)
