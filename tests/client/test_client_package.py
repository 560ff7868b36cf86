"""The client package stands alone: httpx is its only dependency, and it never imports the
server's code."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "client" / "atto_cloud_client"


def test_httpx_is_the_only_declared_dependency() -> None:
    """client/pyproject.toml declares httpx and nothing else."""
    project = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "atto-cloud-client"
    assert [d.split(">")[0].split("=")[0].strip() for d in project["dependencies"]] == ["httpx"]


def test_every_import_is_stdlib_httpx_or_the_package() -> None:
    """No module of the package imports anything but the standard library, httpx and
    itself (the server's layers least of all)."""
    allowed = set(sys.stdlib_module_names) | {"httpx", "__future__"}
    found = set()
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    assert found and found <= allowed, found - allowed


def test_importing_the_client_loads_no_server_code() -> None:
    """A fresh interpreter that imports the client has not loaded the layers or FastAPI."""
    code = ("import sys, atto_cloud_client, atto_cloud_client.testing; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('usage_limits', 'atto_providers', 'fastapi', 'redis', 'starlette')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT / "client").stdout
    assert out.strip() == "[]"
