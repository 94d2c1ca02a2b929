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


def test_a_rejudgement_carries_the_answers_lines_without_billing_them_again(tmp_path):
    """The judgement names the answers' production as the owner of their cost lines: the ledger records them once,
    by the run that first judged them; a re-judgement (another floor) spends nothing, and the cost of its result
    still counts them. Also the other way round: judging the same answers again in the first run adds nothing."""
    from campaign_orchestrator.costs.ledger import Ledger

    spec = _spec()
    line = {"kind": "evaluation", "price_key": "cpu-2vcpu", "quantity": 0.01, "unit": "host-hour"}
    line |= {"unit_price": 0.0893, "usd": 0.000893}
    answers = StageDir(tmp_path, "demo", "evaluation_items", "items1").commit(
        _answers(spec, tmp_path) | {"cost_lines": [line]}
    )
    binary = {"cipher": True, "format": True, "harness_cipher": None}
    ledger = Ledger(tmp_path / "ledger.duckdb")

    def judged(s, run: str) -> tuple[dict, dict]:
        k = judging_key(s, "items1")
        m = judge_stage(s, StageDir(tmp_path, "demo", "evaluation", k), answers, "items1", binary, "cand1")
        assert m["cost_lines_of"]["production_id"] == answers["production_id"]
        rec = ledger.record_stage(campaign="demo", asset="evaluation", run_id=run, step_key="ev", manifest=m)
        return m, rec

    first, rec1 = judged(spec, "run1")
    assert rec1 == {
        "reused": False,
        "spent_usd": line["usd"],
        "production_usd": line["usd"],
        "produced_by": "run1",
        "lines_paid_by": "run1",
    }
    second, rec2 = judged(_spec(min_score=0.99), "run2")  # a new floor: re-judged, nothing spent
    assert second["key"] != first["key"] and second["verdict"] == "NO-GO"
    assert (rec2["reused"], rec2["spent_usd"], rec2["lines_paid_by"]) == (False, 0.0, "run1")
    assert ledger.spent("demo") == ledger.spent("demo", run_id="run1") == line["usd"]
    assert ledger.spent("demo", run_id="run2") == 0.0
    assert ledger.carried_from("demo", "run2") == {"evaluation": "run1"} and ledger.carried_from("demo", "run1") == {}
    for m in (first, second):  # the cost of either result: the answers' line, once
        lines = ledger.lineage_lines("demo", {"evaluation": m["key"]})
        assert [x["usd"] for x in lines] == [line["usd"]], m["key"]
    # the first floor again: its judgement is complete, a cache hit of run1's
    _, rec3 = judged(spec, "run3")
    assert (rec3["reused"], rec3["spent_usd"], rec3["produced_by"]) == (True, 0.0, "run1")
    assert ledger.spent("demo") == line["usd"]
