"""The SAM CLI on template.yaml: `sam validate --lint` and an offline `sam build`.

The SAM CLI lives in its own venv, .tools (`make tools`), because aws-sam-cli pins boto3
and botocore versions that must not replace the project's. `sam build` needs neither docker
nor AWS credentials: every function and layer is built by its own Makefile, and the
dependency layer downloads arm64 wheels from the package index.

The built artifacts are then run the way Lambda would see them: each function's folder plus
the layers and nothing else on ``sys.path`` (the dependency layer re-installed for this
machine's CPU, since the arm64 wheels cannot load here).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from local.redis_servers import RedisServer
from local.template import functions

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template.yaml"
TOOLS_BIN = ROOT / ".tools" / "bin"
SPECS = functions(TEMPLATE)
LAYERS = ("DepsLayer", "UsageLimitsLayer", "ProvidersLayer")
OFFLINE_ENV = {"SAM_CLI_TELEMETRY": "0", "AWS_EC2_METADATA_DISABLED": "true",
               "AWS_DEFAULT_REGION": "us-east-1"}


def tool(name: str) -> Path:
    """A program from the tools venv; fails with the fix when the venv is missing."""
    path = TOOLS_BIN / name
    if not path.exists():
        pytest.fail(f"{path} not found: run `make tools` (the SAM CLI and cfn-lint live in "
                    ".tools, apart from .venv)")
    return path


def run(args: list[str | Path], *, timeout: float = 120, cwd: Path = ROOT,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure the assertion shows its output."""
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **OFFLINE_ENV, **(env or {})})
    assert proc.returncode == 0, (f"{' '.join(map(str, args))} exited {proc.returncode}\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """template.yaml built by `sam build` into a temporary folder."""
    out = tmp_path_factory.mktemp("sam")
    # --no-cached: nothing is written into the work tree (a cached build keeps .aws-sam/).
    run([tool("sam"), "build", "--template-file", TEMPLATE, "--build-dir", out / "build",
         "--no-cached", "--parallel"], timeout=600)
    return out / "build"


@pytest.fixture(scope="module")
def host_deps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dependency layer installed for this machine's CPU and Python, by its Makefile."""
    out = tmp_path_factory.mktemp("deps-host")
    run(["make", "-s", "-C", ROOT / "layers/deps", "build-DepsLayer", f"ARTIFACTS_DIR={out}",
         f"PLATFORM=manylinux2014_{platform.machine()}",
         f"PYTHON_VERSION={sys.version_info.major}.{sys.version_info.minor}",
         f"PYTHON={sys.executable}", "PY312=false"], timeout=300)
    return out / "python"


def run_isolated(code: str, path: list[Path], env: dict[str, str]) -> str:
    """Run ``code`` in a Python that sees only ``path`` and the standard library."""
    prelude = f"import sys; sys.path[:0] = {[str(p) for p in path]!r}\n"
    proc = run([sys.executable, "-I", "-S", "-c", prelude + code], cwd=Path("/"),
               env={"PATH": os.environ.get("PATH", ""), **env}, timeout=60)
    return proc.stdout


def lambda_path(built: Path, host_deps: Path, logical_id: str) -> list[Path]:
    """What Lambda puts on sys.path: the function's code, then the layers' python/."""
    return [built / logical_id, built / "UsageLimitsLayer" / "python",
            built / "ProvidersLayer" / "python", host_deps]


def test_sam_validate_lint() -> None:
    """`sam validate --lint` accepts template.yaml."""
    proc = run([tool("sam"), "validate", "--lint", "--template-file", TEMPLATE])
    assert "is a valid SAM Template" in proc.stdout + proc.stderr


def test_cfn_lint_from_tools_venv() -> None:
    """The tools venv's cfn-lint (the one `make validate` runs) reports nothing."""
    run([tool("cfn-lint"), TEMPLATE])


@pytest.mark.slow
def test_sam_build_makes_every_artifact(built: Path) -> None:
    """`sam build` leaves each function's code and each layer's python/ folder."""
    for spec in SPECS:
        code = built / spec.logical_id
        assert (code / "app.py").is_file(), spec.logical_id
        assert not (code / "Makefile").exists()
    for layer in LAYERS:
        assert (built / layer / "python").is_dir(), layer
    assert "CodeUri: StructuredFunction" in (built / "template.yaml").read_text()


@pytest.mark.slow
def test_built_layers_hold_the_right_code(built: Path) -> None:
    """The layers ship the library with its Lua, the provider clients and arm64 wheels only."""
    lua = sorted(p.name for p in (ROOT / "layers/usage_limits/usage_limits/lua").glob("*.lua"))
    built_lua = built / "UsageLimitsLayer/python/usage_limits/lua"
    assert lua and sorted(p.name for p in built_lua.glob("*.lua")) == lua
    providers = built / "ProvidersLayer/python/atto_providers"
    assert (providers / "__init__.py").is_file()
    shipped = {p.name for p in providers.rglob("*")}
    assert not {n for n in shipped if "emulator" in n or n.startswith(("test_", "fake"))}
    deps = built / "DepsLayer/python"
    for package in ("fastapi", "mangum", "redis", "pydantic", "aws_lambda_powertools", "httpx",
                    "jsonschema"):
        assert (deps / package).is_dir(), package
    assert not (deps / "boto3").exists() and not (deps / "botocore").exists()
    native = list(deps.rglob("*.so"))
    assert native and all("aarch64" in p.name for p in native), [p.name for p in native]


@pytest.mark.slow
@pytest.mark.parametrize("logical_id", [s.logical_id for s in SPECS])
def test_built_function_imports_with_only_its_layers(logical_id: str, built: Path,
                                                     host_deps: Path) -> None:
    """Each built function imports its handler from its own code and the layers alone."""
    env = {"ATTO_ENV": "dev", "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
    out = run_isolated("import app; print(app.handler.__qualname__, "
                       "type(app.app).__name__)",
                       lambda_path(built, host_deps, logical_id), env)
    assert out.strip() == "lambda_handler.<locals>.handler FastAPI"


HANDLER_CALL = """
import json, time
import app

class Context:
    function_name = "UsageFunction"
    memory_limit_in_mb = 512
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:atto"
    aws_request_id = "0b5f3c52-6d2c-4e0b-9d7a-1c2e3f4a5b6c"
    _end = time.monotonic() + 10

    def get_remaining_time_in_millis(self):
        return int((self._end - time.monotonic()) * 1000)

event = json.load(open(EVENT_PATH))
result = app.handler(event, Context())
print(json.dumps({"status": result["statusCode"], "body": json.loads(result["body"])}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("logical_id", "event", "status"), [
    ("UsageFunction", "usage", 200),
    ("StructuredFunction", "structured_no_identity", 401),
    ("StructuredFunction", "structured_bad_input", 422),
])
def test_built_function_answers_its_event(logical_id: str, event: str, status: int,
                                          built: Path, host_deps: Path) -> None:
    """Built handlers answer API Gateway events with Redis reachable and no provider call."""
    with RedisServer() as server:
        env = {"ATTO_ENV": "dev", "REDIS_URL": server.url, "REDIS_AUTH": "none",
               "REDIS_CLUSTER": "false", "AWS_REGION": "us-east-1",
               "AWS_DEFAULT_REGION": "us-east-1", "LLM_BASE_URL": "http://127.0.0.1:9/v1"}
        code = HANDLER_CALL.replace("EVENT_PATH", repr(str(ROOT / "events" / f"{event}.json")))
        out = run_isolated(code, lambda_path(built, host_deps, logical_id), env)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["status"] in ((400, 422) if status == 422 else (status,)), result
    if status == 200:
        assert result["body"]["user_id"] == "user-123"
    else:
        expected = "unauthorized" if status == 401 else "invalid_request"
        assert result["body"]["error"]["code"] == expected
