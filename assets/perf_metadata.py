"""Dagster metadata for a training run's profile: trace link, per-rank breakdown, verdict, diagnostics.

The trainer writes ``<stage dir>/profile/report.json`` (see ``training/profiling.py``); the
training asset adds ``profile_metadata(stage_dir)`` to its materialization metadata, so the UI
shows, next to the loss curve numbers, where the step time went and what to do about it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dagster import MetadataValue


def _diagnostics_md(index: list[dict]) -> str:
    lines = ["| node | host | command | status | note |", "|---:|---|---|---|---|"]
    for node in index:
        for c in node["commands"]:
            lines.append(f"| {node['node']} | {node['host']} | `{c['command']}` | {c['status']} | {c['note'] or ''} |")
    return "\n".join(lines)


def profile_metadata(stage_dir: str | Path) -> dict[str, Any]:
    """Metadata entries from ``<stage_dir>/profile/report.json``; empty when the run wrote none."""
    from stages.student_adapter import triage_table

    p = Path(stage_dir) / "profile" / "report.json"
    if not p.exists():
        return {}
    report = json.loads(p.read_text())
    md: dict[str, Any] = {}
    if report.get("diagnostics"):
        md["diagnostics"] = MetadataValue.md(_diagnostics_md(report["diagnostics"]))
        md["diagnostics_summary"] = report["diagnostics_summary"]
    if report.get("distributed_env"):
        md["distributed_env"] = MetadataValue.json(report["distributed_env"])
    if not report.get("profiling_enabled"):
        return md
    md["profile_traces"] = MetadataValue.path(str(Path(report["profile_dir"]) / "traces"))
    if report.get("upload_url"):
        md["profile_traces_s3"] = MetadataValue.url(report["upload_url"])
    t = report.get("triage") or {}
    if t.get("verdict") is None:
        md["triage_verdict"] = "no profiled step"
        md["triage_reason"] = t.get("reason", "no trace")
        return md
    md |= {
        "triage_verdict": t["verdict"],
        "triage_reason": t["reason"],
        "triage_fixes": MetadataValue.md("\n".join(f"- {f}" for f in t["fixes"])),
        "triage_per_rank": MetadataValue.md(triage_table(t)),
        "triage_decision_path": MetadataValue.md("\n".join(f"{i + 1}. {x}" for i, x in enumerate(t["decision_path"]))),
        "topology_advice": MetadataValue.md(t["topology_advice"]),
        "step_ms": float(t["step_ms"]),
        "straggler_spread": float(t["straggler_spread"]),
    }
    for part, frac in t["fractions"].items():
        md[f"step_fraction_{part}"] = float(frac)
    if report.get("notes"):
        md["profile_notes"] = MetadataValue.md("\n".join(f"- {n}" for n in report["notes"]))
    return md
