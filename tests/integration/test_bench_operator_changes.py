"""The operator-changes benchmark's short preset: credit conserved, every 503 explained and
truthful, at no changes and at a high change rate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from local.credit_load import MAY_BE_CHARGED, NOTHING_CHARGED

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_conserves_credit_and_explains_every_503(tmp_path: Path) -> None:
    """``bench/operator_changes.py --quick`` with no changes and 5 changes/s: every phase
    conserves credit, every 503 names its step and says one of the guard's messages, and
    none says "nothing was charged" for a charge DynamoDB holds."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "bench/operator_changes.py", "--quick",
                           "--processes", "3", "--seconds", "3", "--rates", "0,5",
                           "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "causes of 503" in proc.stdout
    baseline, changing = json.loads(out.read_text())
    assert baseline["changes"] == 0 and changing["changes"] > 0
    for row in (baseline, changing):
        assert row["served"] > 0
        assert row["per_grant"] and row["copy_matches"]
        assert row["untrue_messages"] == 0
        assert "unexplained" not in row["causes"]
        assert set(row["messages"]) <= {NOTHING_CHARGED, MAY_BE_CHARGED}
        assert row["requests"] == row["served"] + row["rejected"] + row["unavailable"]
