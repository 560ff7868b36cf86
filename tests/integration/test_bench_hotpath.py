"""The hot-path benchmark's quick preset prints every row of its table, now and as it was."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ROWS = [
    r"reserve p50 / trivial EVALSHA p50, 10 events",
    r"reserve p50 / trivial EVALSHA p50, 100,000 events",
    r"Redis time per steady-state reservation, 10 events",
    r"Redis time per steady-state reservation, 100,000 events",
    r"guard beyond its reservation \(guarded - plain - reserve, p50\)",
    r"the same in CPU time of the calling thread \(p50\)",
    r"cold start lazy / eager, import \+ 1st call, median over handlers",
    r"the same in CPU time of the process",
    r"cold start as deployed, import \+ 1st call, median over handlers",
    r"1st call after a SnapStart restore, as deployed, median over handlers",
    r"warm request p50 as deployed, median over handlers",
]
RATIO = r"\d+\.\d\dx \(\d+ vs \d+ (µs|ms)\)"
MICROS = r"\d+\.\d µs"
GUARD = r"[+-]\d+ µs \(\d+ - \d+ - \d+\)"
MILLIS = r"\d+ ms"
CELL = {0: RATIO, 1: RATIO, 2: MICROS, 3: MICROS, 4: GUARD, 5: GUARD, 6: RATIO, 7: RATIO,
        8: MILLIS, 9: MILLIS, 10: r"\d+ µs"}


def test_quick_preset_prints_every_row_for_both_trees() -> None:
    """``bench/hotpath.py --quick`` prints each measure with a value for now and as it was."""
    proc = subprocess.run([sys.executable, "bench/hotpath.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert lines[0] == "| measure | now | as it was | now without hiredis | target |"
    body = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]
    assert len(body) == len(ROWS)
    for i, (pattern, cells) in enumerate(zip(ROWS, body, strict=True)):
        assert re.fullmatch(pattern, cells[0]), cells
        assert re.fullmatch(CELL[i], cells[1]), cells  # now
        assert re.fullmatch(CELL[i], cells[2]), cells  # as it was
        if i < 4:  # the ledger rows also run "now" without hiredis
            assert re.fullmatch(CELL[i], cells[3]), cells
    assert "hiredis: now yes, now-nohiredis no, was no" in proc.stdout
