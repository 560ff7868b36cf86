"""The transfers benchmark's short preset: the DynamoDB calls of each request path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_counts_two_calls_a_request_and_four_after_a_stale_hint(
        tmp_path: Path) -> None:
    """``bench/transfers.py --quick``: a credit request makes two DynamoDB calls whether it
    succeeds or fails, a quota-only one two, and one planned from a stale hint four."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "bench/transfers.py", "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    calls = {row["path"]: (row["calls"], row["calls_max"]) for row in json.loads(out.read_text())}
    assert calls == {"credit, served": (2, 2), "credit, failed": (2, 2),
                     "quota only": (2, 2), "credit, stale hint": (4, 4)}
