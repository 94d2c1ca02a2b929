"""evaluation: candidate (base + adapter) and base answer the same suite items with the same
settings (``stages/evaluation.py``); the gate is a blocking asset check on this asset (:func:`gate`), so NO-GO or
INCONCLUSIVE stops promotion in the same run.

The check is a step of its own after the evaluation's materialization: it reads the judgement the
evaluation step wrote (``gate.json``, through the manifest the evaluation materialized) and fails
its own step on anything but GO (the evaluation step succeeds), so the steps downstream
(``promoted_model``, ``campaign_cost``) are skipped. Its evaluation is stored after the materialization it judges and
names it as its target.
"""

import json

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetIn,
    MetadataValue,
    Output,
    asset,
    asset_check,
)

from assets.common import base_metadata, dagster_failures, for_people, key, model_deps, stage_context, tag_run
from campaigns.spec import CampaignSpec
from resources.k8s.kuberay_launcher import KubeRayJobLauncher
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from resources.teacher import TeacherResource
from stages import evaluation as stage
from stages.evaluation import approve_hint  # noqa: F401 - re-exported for the promoted_model asset

GATE_CHECK = "gate"
GATE_DESCRIPTION = (
    "Promotion gate: floors, regression vs base on paired intervals, per-category regression, empty "
    "outputs, latency, serving errors."
)


def gate_check_result(report: dict, evaluation_key: str | None = None) -> AssetCheckResult:
    verdict = report["verdict"]
    md = {
        "verdict": verdict,
        "candidate_key": report.get("candidate_key", ""),
        "reasons": MetadataValue.md("\n".join(f"- {r}" for r in report["reasons"]) or "- every rule passes"),
    }
    if evaluation_key:
        md["evaluation_key"] = evaluation_key
    for s in report["suites"]:
        o = s["overall"]
        nan = float("nan")
        md[f"{s['suite']}_candidate"] = s["candidate"]["score"] if s["candidate"]["score"] is not None else nan
        md[f"{s['suite']}_base"] = s["base"]["score"] if s["base"]["score"] is not None else nan
        md[f"{s['suite']}_delta_lo"] = o["delta"]["lo"]
        md[f"{s['suite']}_delta_hi"] = o["delta"]["hi"]
        md[f"{s['suite']}_verdict"] = s["verdict"]
    return AssetCheckResult(
        check_name=GATE_CHECK,
        passed=verdict == "GO",
        severity=AssetCheckSeverity.ERROR,
        metadata=md,
        description=f"Gate verdict {verdict}",
    )


def build(spec: CampaignSpec):
    ev = spec.evaluation
    refs, where = stage.models_read(spec), stage.where_models_answer(spec)

    @asset(
        key=key(spec, "evaluation"),
        group_name=spec.name,
        kinds={"pytorch", "parquet"},
        ins={"prompts": AssetIn(key(spec, "prompts")), "adapter": AssetIn(key(spec, "student_adapter"))},
        deps=model_deps(*refs),
        description=f"Candidate and base answer the same items of {len(ev.suites)} suite(s) {where}; "
        "the blocking `gate` check decides promotion.",
    )
    def evaluation(
        context: AssetExecutionContext,
        prompts: dict,
        adapter: dict,
        storage: ArtifactStore,
        pricing: PricingResource,
        teacher: TeacherResource,
        kuberay: KubeRayJobLauncher,
    ):
        ctx = stage_context(context, storage, pricing, teacher, kuberay=kuberay)
        with dagster_failures():
            out = stage.run(spec, {"prompts": prompts, "adapter": adapter}, ctx)
        m, report = out.manifest, out.notes["report"]
        md = evaluation_metadata(m, report, out.cached)
        if "mlflow_runs_tagged" in out.notes:  # the training run's verdict (stages/tracking.py)
            md["mlflow_runs_tagged"] = out.notes["mlflow_runs_tagged"]
        tag_run(context, verdict=report["verdict"])  # the runs list shows the verdict (assets/common.py)
        return Output(m, metadata=for_people(md))

    return evaluation


def gate(spec: CampaignSpec):
    """The blocking ``gate`` check of the campaign's evaluation: its own step, run after the evaluation's
    materialization, judging what that step wrote (the verdict in its ``gate.json``)."""

    @asset_check(asset=key(spec, "evaluation"), name=GATE_CHECK, blocking=True, description=GATE_DESCRIPTION)
    def gate_check(evaluation: dict) -> AssetCheckResult:
        with open(evaluation["gate_path"]) as f:
            report = json.load(f)
        return gate_check_result(report, evaluation["key"])

    return gate_check


def evaluation_metadata(m: dict, report: dict, cached: bool) -> dict:
    """The judgement's manifest and report as Dagster metadata."""
    md = base_metadata(m, cached) | {
        "verdict": report["verdict"],
        "report": MetadataValue.md(report["markdown"]),
        "items": MetadataValue.path(m["items_path"]),
        "candidate_key": m["candidate_key"],
        "statistics": report["method"],
        "requires_human_review": m["requires_human_review"],
    }
    if report.get("diagnosis", {}).get("causes"):  # why, beside the verdict (evaluation/diagnosis.py)
        md["diagnosis"] = MetadataValue.md(report["diagnosis"]["markdown"])
    if m.get("compute_dtype"):
        md["compute_dtype"] = MetadataValue.json(m["compute_dtype"])
    if m.get("answers"):  # per role: generated in this run, found in the generation cache
        md["answers"] = MetadataValue.json(m["answers"])
    if m.get("ray_shards"):  # execution.engine ray: shards done/total per model and answer length
        md["ray_shards"] = MetadataValue.json(m["ray_shards"])
    md |= {k: m[k] for k in ("lm_eval_seconds", "lm_eval_usd") if k in m}
    for role, by_suite in m["scores"].items():
        for suite, score in by_suite.items():
            if score is not None:
                md[f"{suite}_{role}_score"] = score
    for suite, ratio in (m.get("student_teacher_ratio") or {}).items():
        if ratio is not None:
            md[f"{suite}_student_teacher_ratio"] = ratio
    if m.get("cost_unknown"):
        md |= {"cost_usd": m["cost_unknown"], "spent_this_run_usd": "0 (cached)" if cached else m["cost_unknown"]}
    if m.get("billing_note"):
        md["billing_note"] = m["billing_note"]
    return md
