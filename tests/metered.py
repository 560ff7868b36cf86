"""A small metered app for the web-layer tests: charged routes, a failing one, and usage."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from mangum import Mangum

from usage_limits.web import create_app, current_user, require_tokens, settings
from usage_limits.web.runtime import get_budget


def metered_app(title: str, *, ok: str = "/ok", cost: int = 5) -> FastAPI:
    """An app whose routes charge ``cost`` tokens of the configured plan.

    Args:
        title: The app's title.
        ok: The path of the route that succeeds (POST, answers ``{"ok": true}``).
        cost: What ``ok`` and ``/fails`` charge.

    Returns:
        The app: POST ``ok``; POST ``/fails``, a 502 ``provider_error`` (its charge is
        refunded); GET ``/used``, what the caller has used of the plan's first window.
        A test adds routes of its own before wrapping it with ``handler``.
    """
    app = create_app(title)

    @app.post(ok, dependencies=[Depends(require_tokens(cost=cost))])
    async def succeeds() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/fails", dependencies=[Depends(require_tokens(cost=cost))])
    async def fails() -> JSONResponse:
        return JSONResponse({"error": {"code": "provider_error", "message": "x"}},
                            status_code=502)

    @app.get("/used")
    async def used(user: str = Depends(current_user)) -> dict[str, int]:
        report = await get_budget(settings().plan).usage(user)
        return {"used": report.windows[0].used}

    return app


def handler(app: FastAPI) -> Any:
    """``app`` behind Mangum, as a function's Lambda handler (no lifespan)."""
    return Mangum(app, lifespan="off")
