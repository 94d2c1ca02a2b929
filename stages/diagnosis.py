"""The evaluation stage's diagnosis (no stage of its own): the candidate answers a sample of its training task
items (part of the evaluation stage, billed with it), and :func:`evaluation.diagnosis.campaign_diagnosis` says
why a candidate fails beside the gate's verdict (memorised, not learned, format drift, forgot, conflicting data)."""

from __future__ import annotations

from pathlib import Path

from campaigns.spec import CampaignSpec

TRAIN_SAMPLE = 40  # training task items the candidate answers: enough to tell 0% from 50% from 100%


def score_training_sample(spec: CampaignSpec, prompts: dict, models: dict, scorers: dict, out: Path, log) -> str | None:
    """The candidate's answers to the first ``TRAIN_SAMPLE`` training prompts (table order) of the primary suite's
    categories that carry a reference, scored by the primary suite's scorer, written to ``train_sample.parquet``
    (None: no such prompt, the prompts stage has no training table, or the primary suite is a harness suite)."""
    from campaign_orchestrator.dataset.prompts import read_prompt_table
    from evaluation.suite import run_suite, write_item_rows

    primary = spec.evaluation.suites[0]
    if primary.name not in scorers or not prompts.get("train_path"):  # a harness suite; no training table
        return None
    cats = set()
    if primary.source != "heldout":
        from evaluation.suite import load_items

        cats = {it["category"] for it in load_items(primary.source, [], spec.project_dir)}
    rows = [
        r
        for r in read_prompt_table(prompts["train_path"])
        if r.get("reference") is not None and (not cats or str(r.get("category") or "all") in cats)
    ][:TRAIN_SAMPLE]
    if not rows:
        return None
    items = [
        {
            "id": str(r["id"]),
            "prompt": r["prompt"],
            "reference": str(r["reference"]),
            "category": str(r.get("category") or "all"),
        }
        for r in rows
    ]
    _res, answered = run_suite(
        "train_sample", "candidate", items, models["candidate"](), scorers[primary.name], primary.max_new_tokens
    )
    log(f"diagnosis: the candidate answered {len(items)} of its training items for the memorisation check")
    return str(write_item_rows(answered, out / "train_sample.parquet"))


def distillation_conflicts(spec: CampaignSpec, storage) -> list:
    """The task/replay format conflicts the campaign's latest distillation set found (none without replay)."""
    if spec.data.replay is None:
        return []
    latest = storage.campaign_dir(spec.name) / "distillation_set" / "LATEST.json"
    if not latest.exists():
        return []
    import json

    return (json.loads(latest.read_text()).get("replay") or {}).get("conflicts") or []
