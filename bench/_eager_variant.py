"""The eager variant of a handler, for bench/cold_start.py: everything created at import.

This is what a handler looks like when it does not care about cold start: FastAPI, the
Powertools Logger, Metrics and Tracer, and a Secrets Manager client are all imported and
created at module level, and only then is the function's own ``app`` imported. The
function's code is the same as in the lazy variant; only this preamble differs.

Run with the function's code directory first on ``sys.path`` (as Lambda's task root is),
so that ``app`` is that function's ``app.py``; every attribute of ``app`` (the handler
named in template.yaml) is reachable from here. Tracer() needs ``aws-xray-sdk``.
"""

from __future__ import annotations

from typing import Any

import boto3
import fastapi  # noqa: F401  (imported for its cost, as an eager handler would)
from aws_lambda_powertools import Logger, Metrics, Tracer

logger = Logger()
metrics = Metrics()
tracer = Tracer()
secrets = boto3.client("secretsmanager", region_name="us-east-1")

import app  # noqa: E402  (the function's own module, after the preamble)


def __getattr__(name: str) -> Any:
    """``_eager_variant.handler`` is ``app.handler`` (whatever the template names)."""
    return getattr(app, name)
