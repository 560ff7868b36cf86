"""PNG plots of a fleet run (matplotlib, Agg backend)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import _fleet_check as check


def write(out: Path, stats: dict[str, Any], limits: dict[str, tuple[float, float]],
          ledger: dict[str, dict[str, Any]], plan: Any, ends: list[dict[str, Any]],
          t_start: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # 1. provider calls per second against the limit (count in the trailing per_s window)
    fig, axes = plt.subplots(len(limits), 1, figsize=(9, 2.4 * len(limits)), sharex=True)
    for ax, (family, (rate, per_s)) in zip(axes, limits.items(), strict=True):
        times = sorted(t - t_start for t in stats["families"][family].get("arrival_times", []))
        lo, ys = 0, []
        for hi, t in enumerate(times):
            while times[lo] <= t - per_s:
                lo += 1
            ys.append(hi - lo + 1)
        ax.step(times, ys, where="post", lw=0.8, label=f"calls in the last {per_s:g} s")
        ax.axhline(rate, color="red", ls="--", lw=1, label=f"limit {rate:g}/{per_s:g}s")
        ax.set_ylabel(family)
        ax.legend(loc="lower right", fontsize=7)
    axes[-1].set_xlabel("seconds since the fleet started")
    fig.suptitle("Provider calls (emulator arrivals) against the limit")
    fig.tight_layout()
    fig.savefig(out / "provider_rate.png", dpi=110)
    plt.close(fig)

    # 2. tokens in each window against the limit, for the busiest users
    busiest = sorted(ledger, key=lambda u: -sum(c for _, c in ledger[u]["events"].values()))[:3]
    fig, axes = plt.subplots(len(plan), 1, figsize=(9, 2.6 * len(plan)), sharex=True)
    axes = list(axes) if len(plan) > 1 else [axes]
    for ax, (limit, seconds) in zip(axes, plan, strict=True):
        for user in busiest:
            pts = sorted(ledger[user]["events"].values())
            xs, ys = [], []
            for i, (ms, _) in enumerate(pts):
                window = [(m, c) for m, c in pts[: i + 1] if m > ms - seconds * 1000]
                xs.append(ms / 1000 - t_start)
                ys.append(sum(c for _, c in window))
            ax.step(xs, ys, where="post", lw=0.9, label=user)
        ax.axhline(limit, color="red", ls="--", lw=1, label=f"limit {limit}/{seconds}s")
        ax.set_ylabel(f"tokens in {seconds}s")
        ax.legend(loc="lower right", fontsize=7)
    axes[-1].set_xlabel("seconds since the fleet started")
    fig.suptitle("Tokens charged (ledger, after refunds) against the budget")
    fig.tight_layout()
    fig.savefig(out / "budget_usage.png", dpi=110)
    plt.close(fig)

    # 3. latency percentiles per route (2xx answers)
    by: dict[str, list[float]] = defaultdict(list)
    for rec in ends:
        if 200 <= rec["status"] < 300:
            by[rec["route"]].append(rec["t1"] - rec["t0"])
    routes = sorted(by)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.25
    for k, p in enumerate((50, 90, 99)):
        vals = [check._pct(sorted(by[r]), p) or 0 for r in routes]
        ax.bar([i + (k - 1) * width for i in range(len(routes))], vals, width, label=f"p{p}")
    ax.set_xticks(range(len(routes)), routes, rotation=20, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Latency of successful invocations per route")
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)
