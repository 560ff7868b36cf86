"""The fleet harness (bench/fleet.py --quick) keeps every invariant while faults are injected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from local.redis_servers import Engine

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run_fleet(tmp_path: Path, *args: str) -> dict[str, Any]:
    """Run the quick preset in its own interpreter and return its summary."""
    out = tmp_path / "fleet"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet.py"), "--quick",
                           "--no-plots", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    summary["_stdout"] = proc.stdout[-4000:] + proc.stderr[-2000:]
    summary["_rc"] = proc.returncode
    return summary


def fault(summary: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in summary["faults"] if f["fault"] == name)


@pytest.fixture(scope="module")
def standalone(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run on a standalone server of the engine, with every cheap fault."""
    return run_fleet(tmp_path_factory.mktemp(f"standalone-{engine.name}"))


def test_every_invariant_holds(standalone: dict[str, Any]) -> None:
    """No overspend, ledger equals successful work, providers within limits, deadlines kept,
    paid credit conserved exactly, and the conservation auditor finds the books balanced."""
    assert standalone["invariants"] == {"no_overspend": True, "ledger_equals_work": True,
                                        "providers_within_limit": True,
                                        "deadlines_kept": True,
                                        "credit_conserved": True,
                                        "books_balance": True}, standalone["_stdout"]
    assert standalone["books"]["users"] > 0 and standalone["books"]["divergences"] == []
    assert standalone["_rc"] == 0


def test_credit_was_drawn_under_operator_changes_and_dynamodb_faults(
        standalone: dict[str, Any]) -> None:
    """Grants were drawn from, every operator change was made (support refunds included),
    and the DynamoDB faults met calls of the run."""
    credit = standalone["credit"]
    assert credit["charges_that_drew"] > 0 and credit["drawn"] > 0
    assert {e["change"] for e in credit["operator"]} >= {"grant", "plan", "void", "suspend",
                                                          "lift", "refund"}
    assert all(e["outcome"] in ("done", "not_found") for e in credit["operator"])
    hit = {f["fault"]: f["calls_hit"] for f in standalone["faults"] if "calls_hit" in f}
    assert set(hit) == {"dynamo-down", "dynamo-conflict", "dynamo-throttle", "dynamo-lost"}
    assert sum(hit.values()) > 0


def test_budgets_were_really_exhausted(standalone: dict[str, Any]) -> None:
    """The plan is small enough that some requests were refused with budget_exceeded."""
    codes = [c for r in standalone["routes"].values() for c in r["codes"]]
    assert "budget_exceeded" in codes
    assert standalone["ledger"]["ledger_events"] > 0


def test_redis_restart_fails_closed_then_recovers(standalone: dict[str, Any]) -> None:
    """While Redis is down requests get 503 limiter_unavailable; successes follow its return."""
    f = fault(standalone, "redis-restart")
    assert f["errors"].get("limiter_unavailable", 0) > 0
    assert f["recover_s"] is not None


def test_script_flush_costs_nothing(standalone: dict[str, Any]) -> None:
    """After SCRIPT FLUSH the scripts are reloaded (NOSCRIPT -> EVAL) with no error."""
    f = fault(standalone, "script-flush")
    assert "limiter_unavailable" not in f["errors"]
    assert f["recover_s"] is not None


def test_slow_redis_recovers(standalone: dict[str, Any]) -> None:
    """A Redis stalled past the client timeout is survived, and requests succeed afterwards."""
    assert fault(standalone, "redis-slow")["recover_s"] is not None


def test_upstream_storms_are_refunded_and_recovered(standalone: dict[str, Any]) -> None:
    """5xx, 429 and latency storms give 502/503 answers (refunded) and the fleet recovers."""
    assert fault(standalone, "upstream-5xx")["errors"].get("provider_error", 0) > 0
    assert standalone["providers"]["llm"]["emulator_429"] > 0
    for name in ("upstream-5xx", "upstream-429", "upstream-latency"):
        assert fault(standalone, name)["recover_s"] is not None, name


def test_killed_lease_holder_frees_its_slot(standalone: dict[str, Any]) -> None:
    """A SIGKILLed Lambda's search lease stops counting within lease_s of the kill."""
    f = fault(standalone, "kill-lease-holder")
    assert f["slot_back_after_kill_s"] is not None
    assert 0 < f["slot_back_after_kill_s"] <= f["lease_s"]
    assert standalone["after_run"]["leaked_lease_live_at_end"] == 0


@pytest.mark.cluster
@pytest.mark.engine_only("valkey8")
def test_cluster_with_failover_keeps_every_invariant(tmp_path: Path) -> None:
    """On a 3-master cluster with replicas, a restart and a primary failover break nothing.

    On Valkey 8 (what production runs) only: what is checked is the fleet's code (redis-py's
    cluster client following the promoted replica, the scripts reloaded there), and both
    engines speak the same cluster protocol; the ledger and throttle tests run on both
    engines' clusters, and the fleet's standalone run on both engines.
    """
    summary = run_fleet(tmp_path, "--cluster",
                        "--faults", "redis-restart,script-flush,upstream-5xx,failover")
    assert all(summary["invariants"].values()), summary["_stdout"]
    assert fault(summary, "failover")["recover_s"] is not None
