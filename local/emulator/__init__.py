"""Offline emulator of Atto Cloud's paid upstream providers.

One HTTP server (Starlette on uvicorn, one process, so counters are exact) speaks:

- ``/v1/chat/completions``, ``/v1/embeddings`` (OpenAI; family ``llm``);
- ``/adzuna/v1/api/jobs/{country}/{search/{page},histogram,history}`` (``salary``);
- ``/tavily/search`` and ``/brave/res/v1/web/search`` (``search``);
- ``/pages/...`` job-listing pages, redirects, big and slow bodies (``pages``);
- ``/_emulator/{health,stats,config,reset}`` to observe and steer it.

Start it with ``python -m local.emulator --port 8100`` or, from Python,
``with EmulatorProcess(rate="5/s") as emu: ...``. Heavy modules (uvicorn, the app) load
only when a server starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import FAMILIES, ConfigError, EmulatorConfig, FamilyConfig, Rate
from .process import EmulatorProcess, EmulatorThread

#: The default runner: the emulator in a child process (``EmulatorProcess``).
Emulator = EmulatorProcess

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = [
    "FAMILIES",
    "ConfigError",
    "Emulator",
    "EmulatorConfig",
    "EmulatorProcess",
    "EmulatorThread",
    "FamilyConfig",
    "Rate",
    "create_app",
    "generate_instance",
]


def create_app(config: EmulatorConfig | None = None) -> Starlette:
    """The emulator's ASGI app (see ``local.emulator.app``)."""
    from .app import create_app as _create

    return _create(config)


def generate_instance(schema: Any, **kwargs: Any) -> Any:
    """A deterministic instance valid for ``schema`` (see ``schema_instances``)."""
    from .schema_instances import generate_instance as _generate

    return _generate(schema, **kwargs)
