"""Cut, from OpenAI's published OpenAPI document, the components the contract tests use.

The whole document (openai/openai-openapi, ``openapi.json``) is 3.4 MB; the tests need the
request and response schemas of chat completions and embeddings, the error body, and what
they reference. Run it on a checkout of that repository to refresh the vendored copy:

    python tests/contracts/extract_openai.py /path/to/openapi.json <commit> \\
        > tests/contracts/openai-openapi.components.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

REPOSITORY = "openai/openai-openapi"
ROOTS = ("CreateChatCompletionRequest", "CreateChatCompletionResponse",
         "CreateEmbeddingRequest", "CreateEmbeddingResponse", "ErrorResponse")
PREFIX = "#/components/schemas/"


def references(node: Any) -> set[str]:
    """Every ``$ref`` below ``node``."""
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                found.add(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def extract(spec: dict[str, Any], commit: str) -> dict[str, Any]:
    """The ``ROOTS`` and every schema they reach, with where they came from."""
    schemas = spec["components"]["schemas"]
    seen: set[str] = set()
    stack = list(ROOTS)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for ref in references(schemas[name]):
            if not ref.startswith(PREFIX):
                raise ValueError(f"{name}: a reference outside the schemas: {ref}")
            stack.append(ref.removeprefix(PREFIX))
    return {"openapi": spec["openapi"], "info": spec["info"],
            "x-source": {"repository": REPOSITORY, "commit": commit, "file": "openapi.json",
                         "roots": list(ROOTS)},
            "components": {"schemas": {name: schemas[name] for name in sorted(seen)}}}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as source:
        document = json.load(source)
    json.dump(extract(document, sys.argv[2]), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
