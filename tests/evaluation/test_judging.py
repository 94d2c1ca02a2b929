"""The evaluation stage's judgement of stored answers (evaluation/judging.py): verdict, report files, manifest, and
a new threshold re-judging the same answers under a new key."""

import json

from campaign_orchestrator.stage_dir import StageDir
from campaigns.loader import load_campaign_file
from campaigns.paths import shipped_campaigns_dir
from evaluation.judging import answers_manifest, judge_stage, judging_key
from evaluation.suite import write_item_rows

ITEMS = 60


def _rows(suite: str, model: str, right: int) -> list[dict]:
    return [
        {
            "suite": suite,
            "model": model,
            "item_id": f"{suite}-{i}",
            "category": "c",
            "prompt": f"p{i}",
            "reference": "abc",
            "output": "abc" if i < right else "xyz",
            "score": 1.0 if i < right else 0.0,
            "latency_s": 0.01,
            "error": None,
        }
        for i in range(ITEMS)
    ]


def _spec(min_score: float = 0.8):
    spec = load_campaign_file(shipped_campaigns_dir() / "demo.yaml")
    ev = spec.evaluation
    return spec.model_copy(
        update={
            "evaluation": ev.model_copy(
                update={
                    "gate": ev.gate.model_copy(update={"min_score": min_score}),
                    "statistics": ev.statistics.model_copy(update={"resamples": 500}),
                }
            )
        }
    )


def _answers(spec, tmp_path) -> dict:
    rows = []
    for x in spec.evaluation.suites:  # the candidate answers 57 of 60, the base 30
        rows += _rows(x.name, "candidate", 57) + _rows(x.name, "base", 30)
    path = write_item_rows(rows, tmp_path / "items.parquet")
    return answers_manifest(path, len(rows), "cand1", 12.0, None, None, {"candidate": "float32"}, None)


def test_stored_answers_are_judged_into_a_report_and_a_new_floor_rejudges_them_under_a_new_key(tmp_path):
    spec = _spec()
    items = _answers(spec, tmp_path)
    assert items["cost_lines"] == [] and items["compute_dtype"] == {"candidate": "float32"} and items["rows"] == 360
    binary = {"cipher": True, "format": True, "harness_cipher": None}
    k = judging_key(spec, "items1")
    m = judge_stage(spec, StageDir(tmp_path, "demo", "evaluation", k), items, "items1", binary, "cand1")
    assert (m["verdict"], m["candidate_key"], m["items_key"]) == ("GO", "cand1", "items1")
    assert m["scores"]["candidate"]["cipher"] == 57 / 60 and m["scores"]["base"]["cipher"] == 0.5
    gate = json.loads(open(m["gate_path"]).read())
    assert gate["verdict"] == "GO" and open(m["report_path"]).read() == gate["markdown"]
    assert "cand1" in gate["markdown"]

    strict = _spec(min_score=0.99)  # the same answers under a floor the candidate misses: judged again, elsewhere
    k2 = judging_key(strict, "items1")
    assert k2 != k and judging_key(_spec(), "items1") == k
    m2 = judge_stage(strict, StageDir(tmp_path, "demo", "evaluation", k2), items, "items1", binary, "cand1")
    assert m2["verdict"] == "NO-GO" and any("min_score" in r for r in m2["reasons"])
