"""The evaluation asset's diagnosis (no asset of its own): the candidate answers a sample of its training task
items (part of the evaluation stage, billed with it), and :mod:`evaluation.diagnosis` says why a candidate fails
beside the gate's verdict (memorised, not learned, format drift, forgot, conflicting data)."""

from __future__ import annotations

from pathlib import Path

from campaigns.spec import CampaignSpec

TRAIN_SAMPLE = 40  # training task items the candidate answers: enough to tell 0% from 50% from 100%


def score_training_sample(spec: CampaignSpec, prompts: dict, models: dict, scorers: dict, out: Path, log) -> str | None:
    """The candidate's answers to the first ``TRAIN_SAMPLE`` training prompts (table order) of the primary suite's
    categories that carry a reference, scored by the primary suite's scorer, written to ``train_sample.parquet``
    (None: no such prompt, or the primary suite is a harness suite)."""
    from campaign_orchestrator.dataset.prompts import read_prompt_table
    from evaluation.suite import run_suite, write_item_rows

    primary = spec.evaluation.suites[0]
    if primary.name not in scorers:
        return None
    cats = set()
    if primary.source != "heldout":
        from evaluation.suite import load_items

        cats = {it["category"] for it in load_items(primary.source, [], spec.project_dir)}
    rows = [r for r in read_prompt_table(prompts["train_path"]) if r.get("reference") is not None
            and (not cats or str(r.get("category") or "all") in cats)][:TRAIN_SAMPLE]
    if not rows:
        return None
    items = [{"id": str(r["id"]), "prompt": r["prompt"], "reference": str(r["reference"]),
              "category": str(r.get("category") or "all")} for r in rows]
    _res, answered = run_suite("train_sample", "candidate", items, models["candidate"](), scorers[primary.name],
                               primary.max_new_tokens)
    log(f"diagnosis: the candidate answered {len(items)} of its training items for the memorisation check")
    return str(write_item_rows(answered, out / "train_sample.parquet"))


def diagnosis(spec: CampaignSpec, res: dict, train_sample_path: str | None, storage=None) -> dict:
    """:func:`evaluation.diagnosis.diagnose` on the evaluation's results (``read_item_results``)."""
    from campaign_orchestrator.recipe_checks import regression_suites, teacher_is_base
    from evaluation.diagnosis import Context, SuiteItems, diagnose
    from evaluation.suite import read_item_results

    ev = spec.evaluation
    cand, base = res.get("candidate", {}), res.get("base", {})

    def items(name):
        return SuiteItems(name, cand.get(name, []), base.get(name, []), ev.gate_for(
            next(s for s in ev.suites if s.name == name)).max_regression_vs_base)

    primary = ev.suites[0].name
    guards = [items(n) for n in regression_suites(spec) if n in cand]
    sample = None
    if train_sample_path and Path(train_sample_path).exists():
        sample = read_item_results(train_sample_path).get("candidate", {}).get("train_sample")
    rp = spec.data.replay
    found = []
    if storage is not None and rp is not None:  # the distillation set's task/replay format conflicts
        latest = storage.campaign_dir(spec.name) / "distillation_set" / "LATEST.json"
        if latest.exists():
            import json

            found = (json.loads(latest.read_text()).get("replay") or {}).get("conflicts") or []
    ctx = Context(has_replay=rp is not None, teacher_is_base=teacher_is_base(spec),
                  replay_share=rp.share if rp is not None else None, conflicts=found)
    return diagnose(items(primary), guards, sample, ctx)
