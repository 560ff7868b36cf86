"""Web search through the Tavily API (``POST {SEARCH_BASE_URL}/search``).

Settings: ``SEARCH_BASE_URL`` (default ``https://api.tavily.com``; locally the emulator's
``/tavily``), the key from ``SEARCH_SECRET_ARN`` (a plain string or ``{"api_key": ...}``)
or ``SEARCH_API_KEY``, sent as ``Authorization: Bearer`` and never logged. The provider is
named ``search``: every instance of every function shares one throttle, with default
limits ``SEARCH_RATE=5/s`` (the template's ``SearchRate``), ``SEARCH_BURST=2`` and no
``SEARCH_CONCURRENCY`` cap. An upstream 429 pauses search for every instance for its
Retry-After and the call is retried within the request's deadline (``ProviderClient``).

Tavily's Development keys allow 100 requests per minute (1.67/s), a third of the default
``SEARCH_RATE=5/s``: with such a key set ``SEARCH_RATE=100/m`` (Production keys allow
1,000/min). Tavily's 432 (the plan's credits are spent) and 433 (the pay-as-you-go limit is
reached) are quota refusals: not retried, 503 ``provider_quota_exceeded``, counted as
``UpstreamQuota``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from usage_limits.web.errors import ProviderError

from .base import ProviderClient
from .secrets import provider_secret

DEFAULT_BASE_URL = "https://api.tavily.com"
#: Characters of a result's snippet kept.
MAX_SNIPPET_CHARS = 1500


@dataclass(frozen=True)
class SearchResult:
    """One web result.

    Attributes:
        title: the page's title.
        url: the page's address (http or https).
        content: the provider's snippet of the page, at most ``MAX_SNIPPET_CHARS``.
        score: the provider's relevance score (higher is better), or None.
    """

    title: str
    url: str
    content: str
    score: float | None = None


class SearchClient(ProviderClient):
    """Tavily web search."""

    name: ClassVar[str] = "search"
    default_rate: ClassVar[str] = "5/s"
    default_burst: ClassVar[int] = 2
    #: 432: the plan's credits are used up; 433: the pay-as-you-go limit is reached.
    quota_statuses: ClassVar[frozenset[int]] = frozenset({432, 433})

    def __init__(self, *, env: Mapping[str, str] | None = None, redis: Any = None) -> None:
        env = os.environ if env is None else env
        super().__init__(env.get("SEARCH_BASE_URL") or DEFAULT_BASE_URL, env=env, redis=redis)

    def _headers(self) -> dict[str, str]:
        key = provider_secret(self.name, self.env).get("api_key", "")
        if not key:
            raise ProviderError("credentials for the search provider are not configured",
                                provider=self.name)
        return {"Authorization": f"Bearer {key}"}

    async def search(self, query: str, *, max_results: int = 5,
                     include_domains: Sequence[str] = ()) -> list[SearchResult]:
        """The provider's results for ``query``, best first, without duplicate URLs.

        Args:
            query: what to search for (at most 400 characters are sent).
            max_results: 1..20.
            include_domains: restrict results to these domains.

        Raises:
            ProviderError: the provider failed or answered something unusable (502).
            ProviderBusy: no ``search`` slot, or no end to its 429s, within the deadline.
        """
        body: dict[str, Any] = {"query": query[:400], "max_results": max(1, min(20, max_results)),
                                "search_depth": "basic", "include_answer": False,
                                "include_raw_content": False, "include_images": False}
        if include_domains:
            body["include_domains"] = list(include_domains)
        data = await self.request("POST", "/search", json=body, headers=self._headers())
        rows = data.get("results") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise ProviderError("the search provider sent no results list", provider=self.name)
        results: list[SearchResult] = []
        seen: set[str] = set()
        for row in rows:
            if not isinstance(row, dict):
                continue
            url, title = row.get("url"), row.get("title")
            if not isinstance(url, str) or len(url) > 2048 or not url.lower().startswith(
                    ("http://", "https://")):
                continue
            if url in seen:
                continue
            seen.add(url)
            content = row.get("content")
            score = row.get("score")
            results.append(SearchResult(
                title=(title.strip() if isinstance(title, str) else "")[:300] or url[:300],
                url=url,
                content=(content.strip() if isinstance(content, str) else "")[:MAX_SNIPPET_CHARS],
                score=float(score) if isinstance(score, int | float)
                and not isinstance(score, bool) else None))
        return results


_client: SearchClient | None = None


def search_client() -> SearchClient:
    """The process's search client (settings read once)."""
    global _client
    if _client is None:
        _client = SearchClient()
    return _client
