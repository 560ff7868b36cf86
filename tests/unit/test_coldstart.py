"""What a handler module's import does, in a fresh interpreter: what it loads, and in Lambda
the garbage collector paused while it loads (``usage_limits.coldstart``)."""

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
print(json.dumps({"collections": len(collections), "enabled": gc.isenabled(),
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
def test_importing_a_handler_loads_no_powertools_or_aws_sdk(function: str) -> None:
    """No handler's import loads Powertools, boto3 or botocore (its first request may)."""
    modules = import_handler(function, in_lambda=True)["modules"]
    loaded = {m.split(".")[0] for m in modules}
    assert not loaded & {"aws_lambda_powertools", "boto3", "botocore"}


def test_in_lambda_the_collector_is_paused_while_a_handler_module_loads() -> None:
    """Inside Lambda no collection runs while the module loads FastAPI, the layers and its
    routes; then the collector is on again, with what the import made frozen."""
    result = import_handler("embeddings", in_lambda=True)
    assert result["collections"] == 0
    assert result["enabled"]
    assert result["frozen"] > 10_000


def test_outside_lambda_the_collector_is_left_alone() -> None:
    """Tests and local servers import handler modules with the collector as it was."""
    result = import_handler("embeddings", in_lambda=False)
    assert result["collections"] > 10
    assert result["enabled"]
    assert result["frozen"] == 0


def test_resume_without_pause_changes_nothing() -> None:
    """``resume`` only undoes its own ``pause`` (here, outside Lambda, there was none)."""
    import gc

    from usage_limits import coldstart

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    assert coldstart.resume() is False
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen
