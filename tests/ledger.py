"""What a user has spent, read the way the local app reads it: through GET /v1/usage."""

from __future__ import annotations

import importlib

from local.lambda_events import http_event, invoke


def used(user: str) -> int:
    """Tokens ``user`` has spent in the plan's shortest window, as GET /v1/usage reports them."""
    handler = importlib.import_module("functions.usage.app").handler
    report = invoke(handler, http_event("GET", "/v1/usage", user=user))
    return int(report.body["windows"][0]["used"])
