"""The SAM CLI accepts template.yaml with and without its optional Cognito user pool.

`sam validate --lint` and the tools venv's cfn-lint run on a copy of the template whose
CreateUserPool default is set each way (the SAM CLI takes no parameter values here).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS_BIN = ROOT / ".tools" / "bin"
OFFLINE_ENV = {"SAM_CLI_TELEMETRY": "0", "AWS_EC2_METADATA_DISABLED": "true",
               "AWS_DEFAULT_REGION": "us-east-1"}


def template_with_user_pool(create: bool, folder: Path) -> Path:
    """A copy of template.yaml whose CreateUserPool default is ``create``."""
    text = (ROOT / "template.yaml").read_text()
    block = ('  CreateUserPool:\n    Type: String\n    AllowedValues: ["true", "false"]\n'
             '    Default: "false"\n')
    assert text.count(block) == 1
    path = folder / "template.yaml"
    default = f'    Default: "{str(create).lower()}"\n'
    path.write_text(text.replace(block, block.replace('    Default: "false"\n', default)))
    return path


def tool(name: str) -> Path:
    """A program from the tools venv; fails with the fix when the venv is missing."""
    path = TOOLS_BIN / name
    if not path.exists():
        pytest.fail(f"{path} not found: run `make tools`")
    return path


@pytest.mark.parametrize("create", [True, False])
def test_sam_validate_lint_with_and_without_the_user_pool(create: bool, tmp_path: Path) -> None:
    """`sam validate --lint` and cfn-lint accept the template whichever way CreateUserPool
    defaults."""
    path = template_with_user_pool(create, tmp_path)
    assert f'    Default: "{str(create).lower()}"' in path.read_text()
    outputs = []
    for args in ([tool("sam"), "validate", "--lint", "--template-file", path],
                 [tool("cfn-lint"), path]):
        proc = subprocess.run([str(a) for a in args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=180, env={**os.environ, **OFFLINE_ENV})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outputs.append(proc.stdout + proc.stderr)
    assert "is a valid SAM Template" in outputs[0]
