"""The evaluation stage's plain steps around the models' answers: what the answers' manifest records (cost lines,
answer counts, Ray shards, the harness's share), and the gate's judgement of stored answers (``gate.json``, the
reviewer's ``report.md`` and the stage manifest). No Dagster: ``assets/evaluation.py`` calls these and turns
their manifests into metadata.

The judgement has its own stage directory (``evaluation/<key>``, keyed by the answers and the gate policy), so a
changed threshold re-judges stored answers instead of generating them again.
"""

import json
from pathlib import Path

from campaign_orchestrator import content
from campaign_orchestrator.content import file_sha256
from campaigns.spec import CampaignSpec

JUDGING_VERSION = "evaluation/v3"
DIAGNOSIS_VERSION = "diagnosis/v1"  # the judgement carries the diagnosis (evaluation/diagnosis.py)


def approve_hint(campaign: str, candidate_key: str) -> str:
    return (
        f"`campaign approve {campaign} --candidate {candidate_key} --by <you>`, or launch job "
        f"`{campaign}_approve` from the Launchpad with `candidate_key: {candidate_key}`"
    )


def review_line(spec: CampaignSpec, verdict: str, candidate_key: str) -> str | None:
    if not spec.evaluation.requires_human_review:
        return None
    if verdict != "GO":
        return "**Human review required**, but the gate did not pass: there is nothing to approve."
    return (
        f"**Human review required.** Promotion waits for an approval of this exact candidate: "
        f"{approve_hint(spec.name, candidate_key)}."
    )


def _stage_key(*parts) -> str:
    """As ``assets.common.stage_key``: the stage's content key."""
    return content.stage_key(*parts)


def gate_policies(spec: CampaignSpec) -> tuple[dict, object]:
    """Each suite's ``GatePolicy`` and the campaign's ``StatsPolicy``."""
    from evaluation.gate import GatePolicy, StatsPolicy

    ev = spec.evaluation
    st = ev.statistics
    policies = {x.name: GatePolicy.from_mapping(ev.gate_for(x).model_dump()) for x in ev.suites}
    return policies, StatsPolicy(st.interval, st.confidence, st.resamples, st.seed)


def judging_key(spec: CampaignSpec, items_key: str) -> str:
    """The judgement's content key: the answers' key, every suite's gate policy and tier, the statistics, review."""
    ev = spec.evaluation
    policies, _ = gate_policies(spec)
    return _stage_key(
        JUDGING_VERSION,
        DIAGNOSIS_VERSION,
        items_key,
        {n: repr(p) for n, p in policies.items()},
        {x.name: x.tier for x in ev.suites},
        ev.statistics.model_dump(),
        ev.requires_human_review,
    )


def judge_answers(
    spec: CampaignSpec, items: dict, binary: dict[str, bool | None], candidate_key: str, conflicts: list | None = None
) -> dict:
    """The gate report of stored answers (``items``: the answers stage's manifest): per suite the paired
    comparison under its policy (``binary``: suite -> whether its scorer is binary, None for harness suites),
    the verdict, the Markdown, every role's scores, the diagnosis beside the verdict (``conflicts``: the
    distillation set's task/replay format conflicts) and the harness's agreement table."""
    from evaluation.diagnosis import campaign_diagnosis
    from evaluation.gate import combine
    from evaluation.report import build_report
    from evaluation.runner import BASE, CANDIDATE, SuiteGate, judge, scores
    from evaluation.suite import read_item_results

    ev = spec.evaluation
    policies, sp = gate_policies(spec)
    res = read_item_results(items["items_path"])
    reports = judge(res, [SuiteGate(x.name, policies[x.name], binary.get(x.name), x.tier) for x in ev.suites], sp)
    pairs = {x.name: (res[CANDIDATE][x.name], res[BASE][x.name]) for x in ev.suites}
    teacher_of = None
    if spec.several_teachers:  # each category's reference is the teacher that answers it
        cats = {it.category for by_suite in res.values() for items in by_suite.values() for it in items}
        teacher_of = {c: spec.teacher_for(c).name for c in sorted(cats)}
    doc = build_report(
        reports,
        pairs,
        sp,
        candidate_key,
        res.get("teacher"),
        review_line(spec, combine(reports), candidate_key),
        teacher_of,
    )
    doc["scores"] = scores(res)
    doc["diagnosis"] = campaign_diagnosis(spec, res, items.get("train_sample_path"), conflicts)  # why
    if doc["verdict"] != "GO" or doc["diagnosis"]["causes"]:
        doc["markdown"] += "\n\n" + doc["diagnosis"]["markdown"]
    if items.get("lm_eval"):  # the harness's aggregates beside the project's means
        from evaluation.harness import agreement_markdown

        doc["lm_eval"] = items["lm_eval"]
        doc["markdown"] += "\n\n" + agreement_markdown(items["lm_eval"])
    return doc


def write_judgement(doc: dict, out: Path) -> tuple[Path, Path]:
    """``gate.json`` and ``report.md`` in ``out``."""
    (out / "gate.json").write_text(json.dumps(doc, indent=2))
    (out / "report.md").write_text(doc["markdown"])
    return out / "gate.json", out / "report.md"


def judgement_manifest(
    spec: CampaignSpec, items: dict, items_key: str, candidate_key: str, doc: dict, gate: Path, report: Path
) -> dict:
    """The judgement stage's manifest: the verdict and scores, with the answers' cost and provenance carried over.
    The answers' stage is where they were spent: ``cost_lines_of`` names its production as the owner of the lines,
    so the ledger records them once, whichever judgement of the answers comes first, and a re-judgement (another
    gate policy) spends nothing while its result's cost still counts them (``costs/ledger.py``, "Carried lines")."""
    from campaign_orchestrator.costs.report import student_teacher_ratio

    ev, im = spec.evaluation, items
    return {
        "items_path": im["items_path"],
        "items_key": items_key,
        "items_sha256": im["items_sha256"],
        "gate_path": str(gate),
        "report_path": str(report),
        "verdict": doc["verdict"],
        "reasons": doc["reasons"],
        "scores": doc["scores"],
        "diagnosis": doc["diagnosis"]["causes"],
        "candidate_key": candidate_key,
        "requires_human_review": ev.requires_human_review,
        "wall_seconds": im["wall_seconds"],
        "cost_lines": im["cost_lines"],
        "cost_lines_of": carried_lines_owner(im, "evaluation_items"),
        **{k: im[k] for k in ("cost_unknown", "billed_hardware", "billing_note") if k in im},
        "student_teacher_ratio": {x.name: student_teacher_ratio(doc["scores"], x.name) for x in ev.suites},
        **({"teacher_reference": doc["teacher_reference"]} if doc.get("teacher_reference") else {}),
        "compute_dtype": im.get("compute_dtype", {}),
        "answers": im.get("answers", {}),
        **({"ray_shards": im["ray_shards"]} if "ray_shards" in im else {}),
    } | {k: im[k] for k in ("lm_eval_seconds", "lm_eval_usd") if k in im}


def carried_lines_owner(manifest: dict, stage: str) -> dict:
    """What a manifest that carries another stage output's ``cost_lines`` names as their owner (``cost_lines_of``):
    that output's stage, content key and production (``StageDir.commit`` gave it one)."""
    from campaign_orchestrator.costs.ledger import production_id

    return {"stage": stage, "key": manifest.get("key"), "production_id": production_id(manifest)}


def judge_stage(
    spec: CampaignSpec,
    sd,
    items: dict,
    items_key: str,
    binary: dict[str, bool | None],
    candidate_key: str,
    conflicts: list | None = None,
) -> dict:
    """Judge the stored answers of ``candidate_key`` into the stage directory ``sd`` (a ``StageDir``) unless it
    is complete; its manifest (``conflicts``: as :func:`judge_answers`)."""
    if not sd.is_complete():
        doc = judge_answers(spec, items, binary, candidate_key, conflicts)
        gate, report = write_judgement(doc, sd.ensure())
        sd.commit(judgement_manifest(spec, items, items_key, candidate_key, doc, gate, report))
    return sd.manifest()


def tally(counts: dict, role: str, st) -> None:
    """Add a generation call's answers (``GenerationStats``: generated, cache hits) to ``counts[role]``."""
    seen = counts.setdefault(role, {"generated": 0, "from_cache": 0})
    seen["generated"] += st.generated
    seen["from_cache"] += st.cache_hits


def answer_counts(dtypes: dict, spend: dict | None) -> dict:
    """role -> answers generated in this run and found in the generation cache (distinct prompts per suite
    length): the base answered once across candidates, a context-distillation teacher's bare prompts taken from
    the base's answers; with several teachers also ``teacher <name>``, each on its own categories."""
    out = dict(dtypes.get("_answers", {}))
    if spend and spend.get("answers"):
        out["teacher"] = spend["answers"]
    for name, counts in ((spend or {}).get("teachers") or {}).items():  # several teachers: each on its categories
        out[f"teacher {name}"] = counts
    return out


def ray_manifest(dtypes: dict, spend: dict | None) -> dict:
    """``ray_shards``: shards done/total of each model's answers on Ray (none with engine local)."""
    if "_ray" not in dtypes and not (spend and spend.get("ray")):
        return {}
    teacher = {
        f"teacher@{i}": f"{r['shards_done']}/{r['shards_total']}" for i, r in enumerate((spend or {}).get("ray", []))
    }
    return {"ray_shards": dtypes.get("_ray", {}) | teacher}


def harness_manifest(run, bill: dict | None) -> dict:
    """The harness's share of the evaluation (already inside its wall time and cost line): its agreement
    table, seconds and their price at the billed hardware (``bill``'s ``lm_eval`` part; None: not run locally)."""
    if run is None:
        return {}
    usd = bill["parts_usd"]["lm_eval"] if bill else 0.0
    return {"lm_eval": run.as_dict(), "lm_eval_seconds": run.wall_seconds, "lm_eval_usd": usd}


def answers_manifest(
    items_path: Path,
    rows: int,
    candidate_key: str,
    wall: float,
    bill: dict | None,
    spend: dict | None,
    dtypes: dict,
    harness_run,
) -> dict:
    """The answers stage's manifest: where the answers are, what they cost (the local models' ``bill`` at the
    hardware they ran on, None through an endpoint; the teacher's ``spend``), each role's compute dtype and
    answer counts, the Ray shards and the harness's share."""
    lines = (bill["lines"] if bill else []) + (spend["lines"] if spend else [])
    note = bill and bill["billing_note"]
    extra = {"billed_hardware": bill["billed_hardware"], **({"billing_note": note} if note else {})} if bill else {}
    if spend and spend["unknown"]:
        extra["cost_unknown"] = "unknown: scoring the teacher, whose teacher.price is `unpriced`"
    return (
        {
            "items_path": str(items_path),
            "items_sha256": file_sha256(items_path),
            "rows": rows,
            "candidate_key": candidate_key,
            "wall_seconds": wall,
            "cost_lines": lines,
            **extra,
            "compute_dtype": {k: v for k, v in dtypes.items() if not k.startswith("_")},
            "answers": answer_counts(dtypes, spend),
        }
        | harness_manifest(harness_run, bill)
        | ray_manifest(dtypes, spend)
    )
