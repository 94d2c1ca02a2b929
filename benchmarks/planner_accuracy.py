"""The planner's per-device memory and time estimates against what the campaign's last run measured
(prints JSON).

For each campaign named: the latest cost report ``ARTIFACTS/<campaign>/campaign_cost/<run id>.json``
(written by every ``campaign run``, GO or not, with the plan of the campaign as run: same catalog, same
constants). Memory: planned total per device against the training process's measured peak (RSS on a
CPU, allocator peak on a GPU), error = planned / measured - 1, target within +-30%. Time: each stage's
estimate against its wall seconds, and the sum over stages, target ratio actual / estimate within
[0.5, 2]. The host's load average is printed beside them: time on a shared box is not the planner's
error alone.

Usage: python benchmarks/planner_accuracy.py [--artifacts artifacts] [smollm2 demo ...]
Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

MEMORY_TOLERANCE = 0.30
TIME_RATIO = (0.5, 2.0)


def latest_report(artifacts: Path, campaign: str) -> dict:
    reports = sorted((artifacts / campaign / "campaign_cost").glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not reports:
        raise SystemExit(
            f"no cost report for campaign {campaign!r} under {artifacts / campaign / 'campaign_cost'}: "
            f"run `campaign run {campaign}` first (a NO-GO run writes none)"
        )
    return json.loads(reports[-1].read_text())


def accuracy(report: dict) -> dict:
    planned, measured = report.get("plan_memory_gb"), report.get("actual_peak_memory_gb")
    mem_err = None if not (planned and measured) else planned / measured - 1
    stages, est_total, act_total = [], 0.0, 0.0
    for p in report["plan_vs_actual"]:
        est, act = p["estimated_seconds"], p["actual_seconds"]
        if est and act:
            est_total, act_total = est_total + est, act_total + act
        stages.append(
            {
                "stage": p["stage"],
                "estimated_s": est,
                "actual_s": act,
                "ratio": round(act / est, 3) if est and act else None,
            }
        )
    ratios = [s["ratio"] for s in stages if s["ratio"] is not None]
    total = round(act_total / est_total, 3) if est_total else None
    return {
        "campaign": report["campaign"],
        "verdict": report.get("verdict"),
        "memory": {
            "planned_gb": planned,
            "measured_peak_gb": measured,
            "error": None if mem_err is None else round(mem_err, 3),
            "within_30pct": mem_err is not None and abs(mem_err) <= MEMORY_TOLERANCE,
        },
        "time": {
            "stages": stages,
            "estimated_s": round(est_total, 1),
            "actual_s": round(act_total, 1),
            "ratio": total,
            "within_2x": bool(ratios) and all(TIME_RATIO[0] <= r <= TIME_RATIO[1] for r in [*ratios, total]),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("campaigns", nargs="*", default=["smollm2", "demo"])
    ap.add_argument("--artifacts", default="artifacts")
    a = ap.parse_args(argv)
    rows = [accuracy(latest_report(Path(a.artifacts), c)) for c in a.campaigns]
    ok = all(r["memory"]["within_30pct"] and r["time"]["within_2x"] for r in rows)
    print(
        json.dumps(
            {"benchmark": "planner_accuracy", "load_average": os.getloadavg(), "campaigns": rows, "pass": ok}, indent=2
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
