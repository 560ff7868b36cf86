"""``lambda_handler(app)``: the Lambda entry point of a function, Mangum around the app.

Mangum decodes the event before the app runs; an event it cannot decode (a body marked
``isBase64Encoded`` that is not base64) would fail the invocation, which API Gateway turns
into a bare 500. Here it gets the public 400 ``invalid_request`` instead; nothing was
charged, since the app never ran.

Making the handler ends the module's initialisation: the garbage collector, paused by
``usage_limits.coldstart`` while the module was imported, runs again from here on.
"""

from __future__ import annotations

import binascii
import json
from collections.abc import Callable
from typing import Any


def lambda_handler(app: Any) -> Callable[[dict[str, Any], Any], dict[str, Any]]:
    """Wrap an ASGI ``app`` for API Gateway HTTP API (payload v2) events."""
    from mangum import Mangum

    from .. import coldstart, snapstart

    snapstart.install()  # under SnapStart: nothing made before the snapshot is shared
    mangum = Mangum(app, lifespan="off")
    coldstart.resume()  # the module is made: the collector runs again (see coldstart)

    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        try:
            return mangum(event, context)
        except (binascii.Error, UnicodeDecodeError):
            return {"statusCode": 400, "isBase64Encoded": False,
                    "headers": {"content-type": "application/json"},
                    "body": json.dumps({"error": {
                        "code": "invalid_request",
                        "message": "the request body could not be decoded"}})}

    return handler
