"""The emulator's ASGI application: every family's routes and the control endpoints."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route

from . import control, llm, pages, salary, search
from .config import EmulatorConfig
from .gate import gated
from .state import EmulatorState

#: Base URL suffix of each upstream API, relative to the emulator's URL.
PREFIXES = {"openai": "/v1", "adzuna": "/adzuna", "tavily": "/tavily", "brave": "/brave",
            "pages": "/pages"}


def _llm_routes(prefix: str) -> list[BaseRoute]:
    auth = llm.openai_auth
    return [
        Route(f"{prefix}/chat/completions", gated("llm", "openai", "chat.completions",
                                                  auth=auth, cost=llm.chat_cost)(
            llm.chat_completions), methods=["POST"]),
        Route(f"{prefix}/embeddings", gated("llm", "openai", "embeddings", auth=auth,
                                            cost=llm.embeddings_cost)(llm.embeddings),
              methods=["POST"]),
        Route(f"{prefix}/models", llm.models, methods=["GET"]),
    ]


def create_app(config: EmulatorConfig | None = None) -> Starlette:
    """A fresh emulator app with its own state (``app.state.emulator``)."""
    jobs = "/adzuna/v1/api/jobs/{country}"
    routes: list[BaseRoute] = [
        *_llm_routes("/v1"),
        *_llm_routes("/openai/v1"),
        Route(f"{jobs}/histogram", gated("salary", "adzuna", "histogram",
                                         auth=salary.adzuna_auth)(salary.histogram)),
        Route(f"{jobs}/search/{{page}}", gated("salary", "adzuna", "search",
                                               auth=salary.adzuna_auth)(salary.search)),
        Route(f"{jobs}/history", gated("salary", "adzuna", "history",
                                       auth=salary.adzuna_auth)(salary.history)),
        Route("/tavily/search", gated("search", "tavily", "tavily.search",
                                      auth=search.tavily_auth)(search.tavily_search),
              methods=["POST"]),
        Route("/brave/res/v1/web/search", gated("search", "brave", "brave.web",
                                                auth=search.brave_auth)(search.brave_search)),
        Route("/pages/job/{slug}", gated("pages", "html", "job")(pages.job_page)),
        Route("/pages/article/{slug}", gated("pages", "html", "article")(pages.article_page)),
        Route("/pages/redirect", gated("pages", "html", "redirect")(pages.redirect)),
        Route("/pages/redirect/{n:int}", gated("pages", "html", "redirect")(
            pages.redirect_chain)),
        Route("/pages/big", gated("pages", "html", "big")(pages.big)),
        Route("/pages/slow", gated("pages", "html", "slow")(pages.slow)),
        Route("/pages/status/{code:int}", gated("pages", "html", "status")(pages.status_page)),
        Route("/pages/image/{name}", gated("pages", "html", "image")(pages.image)),
        Route("/_emulator/health", control.health),
        Route("/_emulator/stats", control.stats),
        Route("/_emulator/config", control.get_config, methods=["GET"]),
        Route("/_emulator/config", control.post_config, methods=["POST"]),
        Route("/_emulator/reset", control.reset, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.emulator = EmulatorState(config or EmulatorConfig())
    return app
