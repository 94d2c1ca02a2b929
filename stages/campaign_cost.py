"""campaign_cost: what this campaign's result cost, from the cost ledger, next to the planner's estimates, with the
campaign's dashboard (a static HTML page). The spend of a run the gate blocked is in the ledger too (every stage
records its lines as it completes); ``campaign run`` reports it with the same :func:`stages.pricing.cost_report`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from campaigns.spec import CampaignSpec
from stages.outcome import Outcome
from stages.pricing import cost_report, dollars, team_dir

# Where the cost dashboards of an artifact root are served: `campaign dashboard --serve` records the URL it serves
# them at (``<root>/dashboards/served_at.json``) and serves there again by default, so the links in campaign_cost's
# metadata follow the port it serves on; before it first served, its default port. The ``pricing`` resource's
# ``dashboard_url`` overrides both (another web server serving ``<root>/dashboards/``).
DASHBOARD_PORT = 8765
SERVED_AT = "served_at.json"

STAGES = ("teacher_generations", "distillation_set", "tokenized_dataset", "student_adapter", "evaluation")
# Not in the graph of a fully on-policy campaign (training.distillation.on_policy.teacher_generations: none).
TEACHER_STAGES = ("teacher_generations", "distillation_set", "tokenized_dataset")


def upstream(spec: CampaignSpec) -> list[str]:
    """The stages whose manifests the report reads (a fully on-policy campaign has no teacher stages)."""
    return [s for s in STAGES if not (spec.training.distillation.skips_teacher and s in TEACHER_STAGES)]


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """The run's cost report (``inputs``: one manifest per upstream stage, and the sweep's), stored in the ledger,
    written beside the refreshed dashboards; its manifest is keyed by the run."""
    r = cost_report(ctx.pricing, spec, ctx.store.root_path(), ctx.run_id, inputs, log=ctx.log.warning)
    return Outcome({"key": ctx.run_id, "path": r["report_path"], **r}, False)


def result_line(report: dict) -> str:
    """The result for people: verdict, score, cost and what this run spent, e.g. ``GO · cipher 90.0% (base 0.0%) ·
    result $0.012 · spent in this run $0.011``."""

    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    unknown = " (+ unknown)" if report.get("unknown_costs") else ""
    return (
        f"{report.get('verdict') or 'not evaluated'} · {report.get('primary_suite') or 'score'} "
        f"{pct(report.get('candidate_score'))} (base {pct(report.get('base_score'))}) · result "
        f"{dollars(report.get('total_usd'))}{unknown} · spent in this run "
        f"{dollars(report.get('spent_this_run_usd'))}"
    )


def _served_at(root: Path) -> Path:
    return Path(root) / team_dir() / SERVED_AT


def dashboards_url(root: Path) -> str:
    """The URL the cost dashboards of the artifact root ``root`` are served at: where ``campaign dashboard --serve``
    last served them (:func:`record_dashboards_url`), else where it serves them by default."""
    try:
        return str(json.loads(_served_at(root).read_text())["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"http://127.0.0.1:{DASHBOARD_PORT}"


def dashboards_port(root: Path) -> int:
    """The port ``campaign dashboard --serve`` serves at without ``--port``: the one it last served at (so the links
    already shown in the UI open again), else :data:`DASHBOARD_PORT`."""
    from urllib.parse import urlsplit

    return urlsplit(dashboards_url(root)).port or DASHBOARD_PORT


def record_dashboards_url(root: Path, url: str) -> str | None:
    """Record that the dashboards of ``root`` are served at ``url`` (the links campaign_cost's metadata makes from
    now on point there); the URL recorded before, if any."""
    before = dashboards_url(root) if _served_at(root).exists() else None
    p = _served_at(root)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid(), "since": time.time()}))
    os.replace(tmp, p)
    return before
