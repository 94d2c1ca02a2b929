"""Baselines: the first run is recorded; a later run whose numbers drop beyond the threshold fails
and names the metric, both values and the environment change that could explain it."""

import json

from training.cluster import ladder
from training.cluster.baseline import BaselineStore, Rule, compare

SWEEP = {
    "summary": {
        "all_reduce": {"plateau_busbw_gbps": 40.0, "latency_floor_us": 20.0, "wrong": 0},
        "all_gather": {"plateau_busbw_gbps": 35.0, "latency_floor_us": 15.0, "wrong": 0},
    }
}
ENV = {"version:torch": "2.13.0", "driver_version": "550.54", "devices": "NVIDIA H100"}


def _sweep(scale_bw=1.0, scale_lat=1.0):
    return {
        "summary": {
            op: {
                "plateau_busbw_gbps": s["plateau_busbw_gbps"] * scale_bw,
                "latency_floor_us": s["latency_floor_us"] * scale_lat,
                "wrong": 0,
            }
            for op, s in SWEEP["summary"].items()
        }
    }


def test_first_run_records_then_a_bandwidth_drop_fails_naming_the_change(tmp_path):
    store = BaselineStore(tmp_path)
    rules = ladder.bandwidth_rules(plateau_drop=0.25, latency_rise=0.5, ops=["all_reduce", "all_gather"])
    first = store.check("collective_bandwidth", "nccl-h100-2x8", ladder.bandwidth_metrics(_sweep()), ENV, rules)
    assert first.passed and first.recorded and "now the baseline" in first.summary()

    ok = store.check("collective_bandwidth", "nccl-h100-2x8", ladder.bandwidth_metrics(_sweep(0.9, 1.3)), ENV, rules)
    assert ok.passed and not ok.recorded

    new_env = ENV | {"driver_version": "560.28"}
    bad = store.check(
        "collective_bandwidth", "nccl-h100-2x8", ladder.bandwidth_metrics(_sweep(0.5, 1.0)), new_env, rules
    )
    assert not bad.passed
    assert sorted(c.metric for c in bad.changes) == ["all_gather.plateau_busbw_gbps", "all_reduce.plateau_busbw_gbps"]
    text = bad.summary()
    assert "all_reduce.plateau_busbw_gbps dropped 50%: 40 → 20 (allowed: -25%)" in text
    assert "driver_version: 550.54 → 560.28" in text
    # the failing run did not replace the baseline, and every run is in the history
    assert store.load("collective_bandwidth", "nccl-h100-2x8")["metrics"]["all_reduce.plateau_busbw_gbps"] == 40.0
    history = (tmp_path / "collective_bandwidth-nccl-h100-2x8.history.jsonl").read_text().splitlines()
    assert [json.loads(h)["passed"] for h in history] == [True, True, False]


def test_latency_floor_rise_fails_and_rebaseline_accepts_it(tmp_path):
    store = BaselineStore(tmp_path)
    rules = ladder.bandwidth_rules(0.25, 0.5, ["all_reduce", "all_gather"])
    store.check("bw", "s", ladder.bandwidth_metrics(_sweep()), ENV, rules)
    slow = store.check("bw", "s", ladder.bandwidth_metrics(_sweep(1.0, 2.0)), ENV, rules)
    assert not slow.passed
    assert [c.metric for c in slow.changes] == ["all_reduce.latency_floor_us", "all_gather.latency_floor_us"]
    assert "all_reduce.latency_floor_us rose 100%: 20 → 40 (allowed: +50%)" in slow.summary()
    again = store.check("bw", "s", ladder.bandwidth_metrics(_sweep(1.0, 2.0)), ENV, rules, rebaseline=True)
    assert again.passed and again.recorded
    assert store.check("bw", "s", ladder.bandwidth_metrics(_sweep(1.0, 2.0)), ENV, rules).passed


def test_compare_respects_direction_and_shapes_are_separate(tmp_path):
    rules = {"tokens_per_s": Rule(higher_is_better=True, threshold=0.3)}
    assert compare({"tokens_per_s": 200.0}, {"tokens_per_s": 100.0}, rules) == []  # faster is never a failure
    assert compare({"tokens_per_s": 60.0}, {"tokens_per_s": 100.0}, rules)[0].relative == -0.4
    assert ladder.shape({"backend": "gloo", "devices": []}, 1, 2) == "gloo-cpu-1x2"
    assert (
        ladder.shape({"backend": "nccl", "devices": ["NVIDIA H100 80GB HBM3"]}, 2, 8)
        == "nccl-nvidia_h100_80gb_hbm3-2x8"
    )
    store = BaselineStore(tmp_path)
    store.check("t", "gloo-cpu-1x2", {"tokens_per_s": 100.0}, ENV, rules)
    assert store.check("t", "gloo-cpu-2x2", {"tokens_per_s": 10.0}, ENV, rules).recorded  # another shape


def test_a_failed_rung_never_becomes_the_baseline(tmp_path):
    store = BaselineStore(tmp_path)
    rules = ladder.gate_rules(0.05)
    failed = store.check("eval_gate", "s", {"candidate_score": 0.0}, ENV, rules, record=False)
    assert not failed.passed and "not recorded" in failed.summary()
    assert store.load("eval_gate", "s") is None
    assert store.check("eval_gate", "s", {"candidate_score": 0.95}, ENV, rules).recorded
    worse = store.check("eval_gate", "s", {"candidate_score": 0.5}, ENV, rules, record=False)
    assert not worse.passed and "candidate_score dropped 47%" in worse.summary()
