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
    """The gate's verdict as the check's result, for people: each suite's verdict and scores in percent, then each
    of its rules (``<suite> · <rule>``) with what was measured, its threshold and its result, in the units of
    ``evaluation/report.py``'s rule table, and why the gate failed when it did (the rules that did not pass)."""
    verdict, rules = report["verdict"], stage.gate_rules(report)
    md: dict = {"verdict": verdict}
    if report["reasons"]:
        md["reasons"] = MetadataValue.md("\n".join(f"- {r}" for r in report["reasons"]))
    for s in report["suites"]:
        md[s["suite"]] = f"{s['verdict']}" + (" (advisory suite)" if s.get("tier") == "advisory" else "")
        md[s["suite"]] += f" · {stage.gate_scores(s)}"
        for r in (r for r in rules if r["suite"] == s["suite"]):
            result = r["result"] + (" (advisory)" if r["advisory"] else "")
            md[f"{s['suite']} · {r['rule']}"] = f"{r['measured']} · threshold {r['threshold']} · {result}"
    md["candidate_key"] = report.get("candidate_key", "")
    if evaluation_key:
        md["evaluation_key"] = evaluation_key
    blocking = [r for r in rules if not r["advisory"]]
    failed = [f"{r['suite']} {r['rule']}" for r in blocking if r["result"] != "PASS"]
    passed = f"{len(blocking) - len(failed)} of {len(blocking)} blocking rules pass"
    return AssetCheckResult(
        check_name=GATE_CHECK,
        passed=verdict == "GO",
        severity=AssetCheckSeverity.ERROR,
        metadata=md,
        description=f"{verdict}: {passed}" + (f" (not: {', '.join(failed)})" if failed else ""),
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
        md = evaluation_metadata(m, report, out.cached, out.notes["answers_reused"])
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


def evaluation_metadata(m: dict, report: dict, reused: bool, answers_reused: bool | None = None) -> dict:
    """The judgement's manifest and report as Dagster metadata. ``reused``: the judgement was stored already;
    ``answers_reused`` (default: as ``reused``): the answers were, so how they were made (counts generated, Ray
    shards, the harness's share) was this run's work only when they were not."""
    answers_reused = reused if answers_reused is None else answers_reused
    md = base_metadata(m, reused, None if reused or not answers_reused else "re-judged stored answers") | {
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
    for role, by_suite in m["scores"].items():
        for suite, score in by_suite.items():
            if score is not None:
                md[f"{suite}_{role}_score"] = score
    for suite, ratio in (m.get("student_teacher_ratio") or {}).items():
        if ratio is not None:
            md[f"{suite}_student_teacher_ratio"] = ratio
    if m.get("billing_note"):
        md["billing_note"] = m["billing_note"]
    if answers_reused:
        return md
    if m.get("answers"):  # per role: generated in this run, found in the generation cache
        md["answers"] = MetadataValue.json(m["answers"])
    if m.get("ray_shards"):  # execution.executor ray: shards done/total per model and answer length
        md["ray_shards"] = MetadataValue.json(m["ray_shards"])
    md |= {k: m[k] for k in ("lm_eval_seconds", "lm_eval_usd") if k in m}
    return md
