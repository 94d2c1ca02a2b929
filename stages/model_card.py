"""The promoted adapter's ``README.md`` model card (Hugging Face format): the inputs gathered from the campaign's
stage manifests, rendered by :func:`evaluation.model_card.render_card`. No stage of its own: ``promoted_model``
calls :func:`write_model_card`."""

from __future__ import annotations

import json
from pathlib import Path

from campaigns.spec import CampaignSpec

COST_STAGES = ("teacher_generations", "distillation_set", "tokenized_dataset", "student_adapter", "evaluation")


def _latest(storage, campaign: str, stage: str) -> dict:
    p = storage.campaign_dir(campaign) / stage / "LATEST.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _lineage(spec: CampaignSpec, m: dict) -> dict:
    """Where the adapter's data came from: prompts, teacher, the filters' drops, replay and decontamination
    (``m``: the stages' manifests)."""
    t, dist = spec.teacher, m["distillation_set"]
    return {
        "prompts": {
            "source": spec.data.source,
            "train": m["prompts"].get("train_rows"),
            "heldout": m["prompts"].get("heldout_rows"),
        },
        "teacher": {
            "backend": t.backend,
            "model": t.model,
            "base_url": t.base_url,
            "generations": m["teacher_generations"].get("rows"),
        },
        **({"teachers": _teachers(spec, m["teacher_generations"])} if spec.several_teachers else {}),
        "filters": {k: v for k, v in (dist.get("filter_counts") or {}).items() if v},
        "rows": dist.get("rows"),
        "replay": dist.get("replay"),
        "decontamination": dist.get("decontamination"),
    }


def _teachers(spec: CampaignSpec, generations: dict) -> list[dict]:
    """Several teachers: each one's name, categories, backend, model, endpoint and rows."""
    rows = generations.get("teachers") or {}
    return [
        {
            "name": e.name,
            "categories": e.categories,
            "backend": e.backend,
            "model": e.model,
            "base_url": e.base_url,
            "generations": (rows.get(e.name) or {}).get("rows"),
        }
        for e in spec.teachers
    ]


def card_info(spec: CampaignSpec, storage, evaluation: dict, adapter: dict, promotion: dict | None = None) -> dict:
    from evaluation.model_card import spec_facts, teacher_intervals

    m = {st: _latest(storage, spec.name, st) for st in ("prompts", "teacher_generations", "distillation_set")}
    m["student_adapter"], m["evaluation"] = adapter, evaluation
    base_card = Path(adapter["base_model_path"]) / "model_card.json"
    base_card = json.loads(base_card.read_text()) if base_card.exists() else None
    tr, sm = spec.training, adapter.get("summary") or {}
    gate = json.loads(Path(evaluation["gate_path"]).read_text())
    st = spec.evaluation.statistics
    items = evaluation.get("items_path")
    stages = {
        s: float(sum(x.get("usd") or 0.0 for x in (m.get(s) or {}).get("cost_lines") or []))
        for s in COST_STAGES
        if s in m or s == "tokenized_dataset"
    }
    return {
        "campaign": spec.name,
        "description": spec.description,
        "candidate_key": adapter["key"],
        "base_model": spec.student.base_model,
        "base_model_card": base_card,
        **spec_facts(spec, base_card),  # the hub id, suites' scorers, datasets
        "promotion": promotion,  # promoted_at, run_id
        "lineage": _lineage(spec, m),
        "recipe": {
            "lora": spec.student.lora.model_dump(include={"r", "alpha", "target_modules"}),
            "steps": sm.get("steps"),
            "learning_rate": tr.learning_rate,
            "effective_batch": tr.effective_batch,
            "max_seq_len": tr.max_seq_len,
            "loss": tr.distillation.loss,
            "selection": sm.get("selection"),
        },
        "gate": gate,
        "teacher_intervals": teacher_intervals(items, st.confidence, st.resamples, st.seed) if items else {},
        "cost": {"stages": stages, "total_usd": sum(stages.values())},
    }


def write_model_card(
    spec: CampaignSpec, storage, evaluation: dict, adapter: dict, adapter_dir: Path, promotion: dict | None = None
) -> Path:
    from evaluation.model_card import render_card
    from evaluation.promotion import portable_json

    path = Path(adapter_dir) / "README.md"
    info = portable_json(
        card_info(spec, storage, evaluation, adapter, promotion), [storage.root_path(), spec.project_dir]
    )
    path.write_text(render_card(info))
    return path
