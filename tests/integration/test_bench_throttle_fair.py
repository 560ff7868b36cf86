"""The fair-share benchmark's quick preset: both providers side by side, every user's row,
neither provider over its limit, and the light users' share restored by fair queuing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
USERS = ["heavy", "light1", "light2", "light3", "light4"]


def test_quick_preset_compares_fcfs_and_fair_shares() -> None:
    """``bench/throttle_fair.py --quick`` prints a row per user; no provider books more than
    its rate in any second, and the light users get more of the slots with fair queuing."""
    proc = subprocess.run([sys.executable, "bench/throttle_fair.py", "--quick", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == USERS
    result = json.loads(proc.stdout.splitlines()[-1])
    fcfs, fair = result["modes"]["fcfs"], result["modes"]["fair"]
    for mode in (fcfs, fair):
        assert mode["max_1s"] <= 10  # 10/s, burst 1, slots spaced 101.5 ms
        assert set(mode["users"]) == set(USERS)
    light = [user for user in USERS if user != "heavy"]
    assert sum(fair["users"][u]["share"] for u in light) > sum(
        fcfs["users"][u]["share"] for u in light)
