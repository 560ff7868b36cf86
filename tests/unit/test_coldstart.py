"""What a handler module's import does, in a fresh interpreter: what it loads, and in Lambda
the garbage collector paused and model builds deferred while it loads
(``usage_limits.coldstart``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
FUNCTIONS = sorted(p.name for p in (ROOT / "functions").iterdir() if (p / "app.py").exists())

#: Imports a handler module with a collector callback in place, then reports. "while
#: loading": collections from the start of FastAPI's import (the module's first heavy one)
#: until the module has made its handler. "frozen": objects the import froze (CPython 3.12
#: starts with a few hundred of its own in the permanent generation; 3.11 with none).
IMPORT_HANDLER = """
import gc, json, sys
collections = []
frozen_at_start = gc.get_freeze_count()

def loading():
    return "fastapi" in sys.modules and not hasattr(sys.modules.get("app"), "handler")

gc.callbacks.append(lambda phase, info: phase == "start" and loading() and collections.append(1))
import app
from fastapi.openapi.models import OpenAPI
print(json.dumps({"collections": len(collections), "enabled": gc.isenabled(),
                  "openapi_built": OpenAPI.__pydantic_complete__,
                  "frozen": gc.get_freeze_count() - frozen_at_start,
                  "modules": sorted(sys.modules)}))
"""


def import_handler(function: str, *, in_lambda: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ATTO_"))}
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / "layers" / p)
                                        for p in ("usage_limits", "providers"))
    env["ATTO_ENV"] = "local"
    if in_lambda:
        env["AWS_LAMBDA_FUNCTION_NAME"] = f"{function}-function"
    out = subprocess.run([sys.executable, "-c", IMPORT_HANDLER], cwd=ROOT / "functions" / function,
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("function", FUNCTIONS)
def test_importing_a_handler_loads_no_pydantic_v1_powertools_or_aws_sdk(function: str) -> None:
    """Building the routes no longer imports pydantic.v1 (FastAPI's check for v1 models),
    and no handler's import loads Powertools, boto3 or botocore."""
    modules = import_handler(function, in_lambda=True)["modules"]
    assert "pydantic.v1" not in modules
    loaded = {m.split(".")[0] for m in modules}
    assert not loaded & {"aws_lambda_powertools", "boto3", "botocore"}


def test_in_lambda_the_collector_is_paused_while_a_handler_module_loads() -> None:
    """Inside Lambda no collection runs while the module loads FastAPI, the layers and its
    routes; then the collector is on again, with what the import made frozen."""
    result = import_handler("embeddings", in_lambda=True)
    assert result["collections"] == 0
    assert result["enabled"]
    assert result["frozen"] > 10_000
    assert not result["openapi_built"]


#: In Lambda: FastAPI's models deferred by the import, then the app still answers an invalid
#: body (validation errors) and still writes its OpenAPI document; models made after the
#: import are built at once.
DEFERRED_MODELS = """
import json, time
from pathlib import Path
import app
from fastapi.openapi import models
from pydantic import BaseModel
deferred = not models.OpenAPI.__pydantic_complete__

class Later(BaseModel):
    x: int

class Context:
    function_name, aws_request_id, memory_limit_in_mb = "f", "r", 512
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:f"
    def get_remaining_time_in_millis(self):
        return 10_000

event = json.loads(Path(EVENT).read_text())
event["body"] = json.dumps({"input": []})
event["headers"]["content-length"] = str(len(event["body"]))
answer = app.handler(event, Context())
print(json.dumps({"deferred": deferred, "later_built": Later.__pydantic_complete__,
                  "status": answer["statusCode"],
                  "code": json.loads(answer["body"])["error"]["code"],
                  "paths": sorted(app.app.openapi()["paths"])}))
"""


def test_in_lambda_models_made_while_loading_are_built_on_first_use() -> None:
    """FastAPI's OpenAPI models are not built by the import, the app still validates
    requests and writes its OpenAPI document, and later models are built at once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ATTO_"))}
    env.update({"PYTHONPATH": os.pathsep.join(str(ROOT / "layers" / p)
                                              for p in ("usage_limits", "providers")),
                "ATTO_ENV": "local", "AWS_LAMBDA_FUNCTION_NAME": "embeddings-function",
                "REDIS_URL": "redis://127.0.0.1:1"})
    code = DEFERRED_MODELS.replace("EVENT", repr(str(ROOT / "events" / "embeddings.json")))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "functions" / "embeddings",
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.splitlines()[-1])
    assert result == {"deferred": True, "later_built": True, "status": 422,
                      "code": "invalid_request", "paths": ["/v1/embeddings"]}


def test_outside_lambda_the_collector_is_left_alone() -> None:
    """Tests and local servers import handler modules with the collector as it was."""
    result = import_handler("embeddings", in_lambda=False)
    assert result["collections"] > 10
    assert result["enabled"]
    assert result["frozen"] == 0
    assert result["openapi_built"]


def test_resume_without_pause_changes_nothing() -> None:
    """``resume`` only undoes its own ``pause`` (here, outside Lambda, there was none)."""
    import gc

    from usage_limits import coldstart

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    assert coldstart.resume() is False
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen


def test_pydantic_v1_models_are_still_refused() -> None:
    """Once pydantic.v1 is loaded, a route with a v1 model is refused, as FastAPI does."""
    code = """
import warnings
from usage_limits.web import create_app
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from pydantic import v1
class Old(v1.BaseModel):
    name: str
app = create_app("v1")
try:
    @app.post("/old")
    async def old(body: Old) -> dict:
        return {}
except Exception as exc:
    print(type(exc).__name__)
else:
    print("accepted")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "layers" / "usage_limits")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.split() == ["PydanticV1NotSupportedError"]


#: The pins of the deps layer, as Lambda runs them.
PINS = {line.split("==")[0].lower(): line.split("==")[1].strip()
        for line in (ROOT / "layers" / "deps" / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.lstrip().startswith("#")}


def test_the_private_names_the_cold_start_sets_exist_in_the_pinned_versions() -> None:
    """The installed FastAPI and pydantic are the deps layer's pins (FastAPI 0.165.0, pydantic
    2.13.5), and both still have the private names the cold start sets: an upgrade that
    removes or renames one fails here, not silently as a slower cold start."""
    import fastapi
    import pydantic
    from fastapi._compat import shared
    from pydantic._internal._config import config_defaults

    assert (fastapi.__version__, pydantic.VERSION) == (PINS["fastapi"], PINS["pydantic"]) == (
        "0.165.0", "2.13.5"), "the pins moved: check the two private names below, then this test"
    assert callable(getattr(shared, "is_pydantic_v1_model_class", None)), (
        f"FastAPI {fastapi.__version__} has no fastapi._compat.shared."
        "is_pydantic_v1_model_class: usage_limits/web/app.py no longer keeps FastAPI from "
        "importing pydantic.v1")
    assert config_defaults.get("defer_build") is False, (
        f"pydantic {pydantic.VERSION}'s config_defaults has no defer_build (False): "
        "usage_limits/coldstart.py no longer defers FastAPI's models")
