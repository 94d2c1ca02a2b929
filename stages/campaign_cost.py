"""campaign_cost: what this campaign's result cost, from the cost ledger, next to the planner's estimates, with the
campaign's dashboard (a static HTML page). The spend of a run the gate blocked is in the ledger too (every stage
records its lines as it completes); ``campaign run`` reports it with the same :func:`stages.pricing.cost_report`."""

from __future__ import annotations

from campaigns.spec import CampaignSpec
from stages.outcome import Outcome
from stages.pricing import cost_report, dollars

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
