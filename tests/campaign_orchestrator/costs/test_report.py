"""Cost per result against hand-computed cases: split, $/M teacher tokens, $/1k accepted examples,
$/point at the gain's lower bound ("not meaningful" when it is <= 0), and lineage vs this run."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from campaign_orchestrator.costs.ledger import Ledger
from campaign_orchestrator.costs.report import (
    build_report,
    cost_per_result,
    gain_interval,
    paired_gain_interval,
    per_point_text,
    render_text,
)
from campaign_orchestrator.stage_dir import StageDir


def _line(kind, usd, qty, unit, status="completed", asset="x"):
    return {"kind": kind, "usd": usd, "quantity": qty, "unit": unit, "status": status, "asset": asset}


def test_cost_per_result_by_hand():
    lines = [
        _line("teacher", 0.60, 2.0, "host-hour"),
        _line("teacher", 0.10, 0.5, "host-hour", "interrupted"),
        _line("training", 3.00, 1.5, "gpu-hour"),
        _line("evaluation", 0.40, 0.2, "gpu-hour"),
    ]
    r = cost_per_result(
        lines,
        accepted_examples=700,
        teacher_tokens=1_400_000,
        gain={"mean": 0.25, "low": 0.10, "high": 0.40, "n": 200, "method": "m"},
        teacher_seconds=700.0,
        training_tokens=90_000,
        training_seconds=30.0,
    )
    assert r["total_usd"] == pytest.approx(4.10)
    assert (r["teacher_usd"], r["training_usd"], r["evaluation_usd"]) == pytest.approx((0.70, 3.00, 0.40))
    assert r["interrupted_usd"] == pytest.approx(0.10)
    assert r["usd_per_million_teacher_tokens"] == pytest.approx(0.70 / 1.4)  # $0.50
    assert r["usd_per_1k_accepted_examples"] == pytest.approx(0.70 * 1000 / 700)  # $1.00: the data's cost
    assert r["usd_per_point_gained_lcb"] == pytest.approx(4.10 / 10)  # lower bound 10 points
    assert r["usd_per_point_gained"] == pytest.approx(4.10 / 25)
    assert (r["gpu_hours"], r["host_hours"]) == pytest.approx((1.7, 2.5))
    assert (r["teacher_tokens_per_s"], r["training_tokens_per_s"]) == pytest.approx((2000.0, 3000.0))


def test_per_point_is_not_meaningful_when_the_lower_bound_is_not_positive():
    r = cost_per_result(
        [_line("training", 1.0, 1.0, "gpu-hour")],
        accepted_examples=0,
        teacher_tokens=0,
        gain={"mean": 0.05, "low": -0.01, "high": 0.11, "n": 50, "method": "m"},
    )
    assert r["usd_per_point_gained_lcb"] is None and r["usd_per_point_gained"] == pytest.approx(1.0 / 5)
    assert r["usd_per_1k_accepted_examples"] is None and r["usd_per_million_teacher_tokens"] is None
    assert "not meaningful" in r["per_point_note"] and "not meaningful" in per_point_text(r)


def _items(path, cand, base, extra=()):
    rows = [
        {"suite": "s", "model": m, "item_id": f"i{i}", "score": float(v)}
        for m, scores in (("candidate", cand), ("base", base))
        for i, v in enumerate(scores)
    ]
    pq.write_table(pa.Table.from_pylist(rows + list(extra)), path)
    return path


def test_paired_interval_by_hand(tmp_path):
    # diffs 1,0,1,0,1: mean 0.6, sd sqrt(0.3); t(0.975, 4) = 2.776445 → half-width 0.680093
    p = _items(
        tmp_path / "a.parquet",
        [1, 1, 1, 0, 1],
        [0, 1, 0, 0, 0],
        extra=[
            {"suite": "s", "model": "candidate", "item_id": "only-cand", "score": 1.0},
            {"suite": "s", "model": "base", "item_id": "i9", "score": None},
            {"suite": "other", "model": "base", "item_id": "i0", "score": 1.0},
        ],
    )
    g = paired_gain_interval(p, "s")
    assert g["n"] == 5 and g["mean"] == pytest.approx(0.6)
    assert (g["low"], g["high"]) == pytest.approx((0.6 - 0.680093, 0.6 + 0.680093), abs=1e-5)
    # the same differences 4 times: sd sqrt(4.8/19); t(0.975, 19) = 2.093024 → half-width 0.235231
    g20 = paired_gain_interval(_items(tmp_path / "b.parquet", [1, 1, 1, 0, 1] * 4, [0, 1, 0, 0, 0] * 4), "s")
    assert g20["low"] == pytest.approx(0.6 - 0.235231, abs=1e-5)


def test_gain_prefers_the_evaluations_own_interval(tmp_path):
    gate = tmp_path / "gate.json"
    gate.write_text(json.dumps({"suites": [{"suite": "s", "delta": 0.12, "delta_ci": {"low": 0.05, "high": 0.2}}]}))
    items = _items(tmp_path / "i.parquet", [1, 1], [0, 0])
    g = gain_interval({"gate_path": str(gate), "items_path": str(items)}, "s")
    assert (g["mean"], g["low"], g["high"], g["method"]) == (0.12, 0.05, 0.2, "delta_ci from the evaluation")
    gate.write_text(json.dumps({"suites": [{"suite": "s"}]}))
    assert gain_interval({"gate_path": str(gate), "items_path": str(items)}, "s")["method"].startswith("paired t")


def test_report_counts_reused_outputs_in_the_result_but_not_in_the_run(tmp_path):
    ledger = Ledger(tmp_path / "ledger.duckdb")

    def stage(name, key, usd, kind, run):
        lines = [{"kind": kind, "price_key": "h", "quantity": usd, "unit": "gpu-hour", "unit_price": 1.0, "usd": usd}]
        extra = {
            "teacher_generations": {"prompt_tokens": 600_000, "completion_tokens": 400_000, "wall_seconds": 100.0},
            "distillation_set": {"rows": 500},
        }.get(name, {})
        m = StageDir(tmp_path, "camp", name, key).commit({"cost_lines": lines if usd else [], **extra})
        ledger.record_stage(campaign="camp", asset=name, run_id=run, step_key=name, manifest=m)
        return m

    gen = stage("teacher_generations", "g1", 2.0, "teacher", "r1")
    stage("student_adapter", "a0", 5.0, "training", "r1")  # an older adapter: not part of the new result
    dist = stage("distillation_set", "d1", 0.0, "-", "r1")
    ledger.record_stage(campaign="camp", asset="teacher_generations", run_id="r2", step_key="g", manifest=gen)  # reused
    adapter = stage("student_adapter", "a1", 3.0, "training", "r2")
    r = build_report(
        campaign="camp",
        run_id="r2",
        ledger=ledger,
        primary_suite="s",
        budget_usd=20.0,
        manifests={"teacher_generations": gen, "distillation_set": dist, "student_adapter": adapter},
    )
    assert r["total_usd"] == pytest.approx(5.0) and r["teacher_usd"] == pytest.approx(2.0)
    assert r["spent_this_run_usd"] == pytest.approx(3.0) and r["campaign_spent_usd"] == pytest.approx(10.0)
    assert r["budget_remaining_usd"] == pytest.approx(10.0) and r["budget_used_fraction"] == pytest.approx(0.5)
    assert r["usd_per_million_teacher_tokens"] == pytest.approx(2.0) and r[
        "usd_per_1k_accepted_examples"
    ] == pytest.approx(4.0)
    assert r["gain_points"] is None
    text = "\n".join(render_text(r))
    assert "cost of this result: $5.000000" in text and "spent in this run: $3.000000" in text
    # plan vs actual marks what this run reused: the teacher's actuals are r1's, the adapter's its own
    plan = {
        "total_usd": 6.0,
        "memory": {"total_gb": 1.0},
        "stages": {"teacher_generations": {"usd": 2.0}, "student_adapter": {"usd": 3.0}},
    }
    r = build_report(
        campaign="camp",
        run_id="r2",
        ledger=ledger,
        primary_suite="s",
        plan=plan,
        manifests={"teacher_generations": gen, "distillation_set": dist, "student_adapter": adapter},
    )
    rows = {p["stage"]: p["reused_from_run"] for p in r["plan_vs_actual"]}
    assert rows == {"teacher_generations": "r1", "student_adapter": None, "evaluation": None}
    text = "\n".join(render_text(r))
    assert [x for x in text.splitlines() if "reused (actuals of run r1)" in x][0].split()[0] == "teacher_generations"


def test_report_says_when_teacher_generations_came_from_the_cache(tmp_path):
    ledger = Ledger(tmp_path / "ledger.duckdb")
    gen = StageDir(tmp_path, "camp", "teacher_generations", "g").commit(
        {
            "cost_lines": [],
            "rows": 300,
            "prompt_tokens": 100,
            "completion_tokens": 50,
            "stats": {"cache_hits": 200, "generated": 100},
        }
    )
    ledger.record_stage(campaign="camp", asset="teacher_generations", run_id="r", step_key="g", manifest=gen)
    r = build_report(
        campaign="camp", run_id="r", ledger=ledger, primary_suite="s", manifests={"teacher_generations": gen}
    )
    assert (r["teacher_cache_hits"], r["teacher_generations"]) == (200, 300)
    assert "200 of 300 teacher generations came from the content-addressed cache" in "\n".join(render_text(r))
    gen_fresh = {**gen, "stats": {"cache_hits": 0, "generated": 300}}
    r = build_report(
        campaign="camp", run_id="r", ledger=ledger, primary_suite="s", manifests={"teacher_generations": gen_fresh}
    )
    assert "content-addressed cache" not in "\n".join(render_text(r))


def test_spend_per_teacher_by_hand():
    """Several teachers: each one's tagged lines split by what it did (generations, scoring in evaluation, replay,
    a stopped attempt), its rows and categories from the teacher stage; an unpriced teacher's spend is unknown."""
    from campaign_orchestrator.costs.report import _teacher_text, teacher_spend

    def line(teacher, usd, asset, status="completed"):
        return _line("teacher", usd, 1.0, "host-hour", status, asset) | {"teacher": teacher}

    lines = [
        line("code", 0.25, "teacher_generations"),
        line("code", 0.5, "teacher_generations", "interrupted"),
        line("code", 0.125, "evaluation"),
        line("rest", 1.0, "teacher_generations"),
        line("rest", 0.0625, "distillation_set"),
        _line("training", 3.0, 1.0, "gpu-hour"),  # no teacher: not a teacher's spend
    ]
    gen = {
        "teachers": {
            "code": {"categories": ["code"], "rows": 40, "usd": 0.25, "stopped": "teacher code's budget_share"},
            "rest": {"categories": None, "rows": 60, "usd": 1.0},
            "api": {"categories": ["math"], "rows": 5, "usd": None},  # unpriced
        }
    }
    t = teacher_spend(lines, gen)
    assert t["code"]["usd"] == pytest.approx(0.875) and t["code"]["generations_usd"] == pytest.approx(0.75)
    assert t["code"]["interrupted_usd"] == pytest.approx(0.5) and t["code"]["scoring_usd"] == pytest.approx(0.125)
    assert t["code"]["stopped"] == "teacher code's budget_share" and t["code"]["rows"] == 40
    assert t["rest"]["usd"] == pytest.approx(1.0625) and t["rest"]["replay_usd"] == pytest.approx(0.0625)
    assert t["api"]["usd"] is None and t["api"]["generations_usd"] is None
    assert teacher_spend([_line("teacher", 1.0, 1.0, "host-hour")], {}) is None  # one teacher: no split

    text = "; ".join(_teacher_text(n, x) for n, x in t.items())  # the cost report's `spend per teacher`
    assert "code $0.875000 (code; 40 rows; generations $0.750000, scoring $0.125000, of which $0.500000 in a " in text
    assert "STOPPED: teacher code's budget_share" in text and "api unknown (unpriced) (math; 5 rows" in text
    assert "rest $1.062500 (the rest; 60 rows; generations $1.000000, replay $0.062500)" in text
