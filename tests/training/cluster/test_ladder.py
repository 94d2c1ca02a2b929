"""The ``cluster`` asset group: registered with its checks and job; the all-reduce and bandwidth
rungs really run (gloo, two processes, through Dagster) and record their baselines, and a later
run whose numbers drop fails its check naming the change. A rung that fails its correctness check
is never recorded; numbers that improve beyond the threshold pass the baseline as a warning."""

import json
import os

import pytest
from dagster import AssetCheckSeverity, AssetKey, DagsterInstance, materialize

from assets import cluster
from assets.location import build_definitions, default_resources
from resources.cluster import ClusterValidation
from training.cluster import ladder
from training.cluster.baseline import BaselineStore

ENV = {"version:torch": "2.13.0", "driver_version": "550.54", "devices": "NVIDIA H100"}


def _sweep(wrong: int = 0, bw: float = 40.0, lat: float = 20.0) -> dict:
    return {
        "summary": {
            "all_reduce": {"plateau_busbw_gbps": bw, "latency_floor_us": lat, "wrong": wrong},
            "all_gather": {"plateau_busbw_gbps": bw / 2, "latency_floor_us": lat, "wrong": 0},
        }
    }


def test_a_sweep_with_wrong_results_never_becomes_the_bandwidth_baseline(tmp_path):
    store = BaselineStore(tmp_path)
    broken = ladder.check_bandwidth(store, "s", _sweep(wrong=3), ENV, 0.25, 0.5)
    assert not broken.passed and not broken.recorded and "not recorded" in broken.summary()
    assert store.load("collective_bandwidth", "s") is None
    assert not ladder.check_bandwidth(store, "s", _sweep(wrong=1), ENV, 0.25, 0.5, rebaseline=True).recorded
    assert store.load("collective_bandwidth", "s") is None
    assert ladder.check_bandwidth(store, "s", _sweep(), ENV, 0.25, 0.5).recorded
    # with a baseline, a wrong sweep is still compared, but never replaces it, even when asked to
    again = ladder.check_bandwidth(store, "s", _sweep(wrong=2, bw=80.0), ENV, 0.25, 0.5, rebaseline=True)
    assert not again.recorded
    assert store.load("collective_bandwidth", "s")["metrics"]["all_reduce.plateau_busbw_gbps"] == 40.0


def test_allreduce_smoke_baseline_is_recorded_when_correct_and_names_a_change(tmp_path):
    store = BaselineStore(tmp_path)
    result = {
        "world_size": 2,
        "backend": "gloo",
        "sum_max_abs_diff": 2.4e-7,
        "avg_max_abs_diff": 2.4e-7,
        "avg_error": None,
        "ranks_agree": True,
    }
    wrong = result | {"sum_max_abs_diff": 0.5}
    assert not ladder.check_allreduce(store, "s", wrong, ENV, correct=False, wall_seconds=5.0).recorded
    assert store.load("allreduce_smoke", "s") is None
    first = ladder.check_allreduce(store, "s", result, ENV, correct=True, wall_seconds=5.0)
    assert first.passed and first.recorded
    assert store.load("allreduce_smoke", "s")["metrics"] == {
        "world_size": 2.0,
        "sum_max_abs_diff": 2.4e-7,
        "avg_max_abs_diff": 2.4e-7,
        "wall_seconds": 5.0,
    }
    # The same numbers (slower start-up) pass; a reduction that lost precision, still within
    # tolerance, fails naming it; one that became exact passes with a warning.
    assert ladder.check_allreduce(store, "s", result, ENV, correct=True, wall_seconds=50.0).passed
    coarser = ladder.check_allreduce(
        store, "s", result | {"sum_max_abs_diff": 9.6e-7}, ENV | {"driver_version": "560"}, correct=True
    )
    assert not coarser.passed and not coarser.recorded
    assert "sum_max_abs_diff rose 300%: 2.4e-07 → 9.6e-07 (allowed: +50%)" in coarser.summary()
    assert "driver_version: 550.54 → 560" in coarser.summary()
    finer = ladder.check_allreduce(store, "s", result | {"avg_max_abs_diff": 6e-8}, ENV, correct=True)
    assert finer.passed and finer.warning and [c.metric for c in finer.improvements] == ["avg_max_abs_diff"]
    assert store.load("allreduce_smoke", "s")["metrics"]["sum_max_abs_diff"] == 2.4e-7


def test_an_improvement_beyond_the_threshold_is_a_warning_to_rebaseline(tmp_path):
    store = BaselineStore(tmp_path)
    ladder.check_bandwidth(store, "s", _sweep(), ENV, 0.25, 0.5)
    within = ladder.check_bandwidth(store, "s", _sweep(bw=48.0, lat=12.0), ENV, 0.25, 0.5)  # +20%, -40%
    assert within.passed and not within.warning and within.summary() == "within thresholds of the baseline"
    faster = ladder.check_bandwidth(store, "s", _sweep(bw=100.0, lat=8.0), ENV, 0.25, 0.5)
    assert faster.passed and faster.warning and not faster.changes
    assert sorted(c.metric for c in faster.improvements) == [
        "all_gather.latency_floor_us",
        "all_gather.plateau_busbw_gbps",
        "all_reduce.latency_floor_us",
        "all_reduce.plateau_busbw_gbps",
    ]
    text = faster.summary()
    assert "all_reduce.plateau_busbw_gbps improved 150%: rebaseline if intended (campaign ladder --rebaseline)" in text
    assert "all_reduce.latency_floor_us improved 60%: rebaseline if intended" in text
    check = cluster._baseline_check("bandwidth_vs_baseline", faster, {})
    assert not check.passed and check.severity == AssetCheckSeverity.WARN and "improved 150%" in check.description
    assert "all_reduce.plateau_busbw_gbps improved" in check.metadata["improvements"].value
    # a regression next to an improvement still fails with severity ERROR, naming both
    mixed = ladder.check_bandwidth(store, "s", _sweep(bw=100.0, lat=40.0), ENV, 0.25, 0.5)
    assert not mixed.passed and not mixed.warning
    check = cluster._baseline_check("bandwidth_vs_baseline", mixed, {})
    assert not check.passed and check.severity == AssetCheckSeverity.ERROR
    assert "latency_floor_us rose 100%" in check.description and "plateau_busbw_gbps improved 150%" in check.description
    # the warning never moved the baseline; the history keeps it
    assert store.load("collective_bandwidth", "s")["metrics"]["all_reduce.plateau_busbw_gbps"] == 40.0
    history = [json.loads(h) for h in (tmp_path / "collective_bandwidth-s.history.jsonl").read_text().splitlines()]
    assert [len(h["improvements"]) for h in history] == [0, 0, 4, 2]
    assert ladder.check_bandwidth(store, "s", _sweep(bw=100.0, lat=8.0), ENV, 0.25, 0.5, rebaseline=True).recorded
    assert not ladder.check_bandwidth(store, "s", _sweep(bw=100.0, lat=8.0), ENV, 0.25, 0.5).warning


def test_cluster_group_checks_and_job_are_registered():
    defs = build_definitions([])
    graph = defs.resolve_asset_graph()
    rungs = ["environment", "allreduce_smoke", "collective_bandwidth", "tiny_training", "eval_gate"]
    for rung in rungs:
        assert graph.get(AssetKey(["cluster", rung])).group_name == "cluster"
    checks = {(c.asset_key.path[-1], c.name) for c in graph.asset_check_keys if c.asset_key.path[0] == "cluster"}
    assert {
        ("environment", "devices_visible"),
        ("allreduce_smoke", "gradient_equality"),
        ("allreduce_smoke", "allreduce_vs_baseline"),
        ("collective_bandwidth", "bandwidth_vs_baseline"),
        ("tiny_training", "throughput_vs_baseline"),
        ("eval_gate", "gate"),
    } <= checks
    job = defs.resolve_job_def(cluster.JOB)
    assert {n.name for n in job.nodes} >= {"cluster__" + r for r in rungs}
    # each rung stands on the one below it
    assert (
        AssetKey(["cluster", "allreduce_smoke"]) in graph.get(AssetKey(["cluster", "collective_bandwidth"])).parent_keys
    )
    assert AssetKey(["cluster", "tiny_training"]) in graph.get(AssetKey(["cluster", "eval_gate"])).parent_keys


def _checks(result) -> dict:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


@pytest.mark.slow
def test_bandwidth_rung_records_a_baseline_then_names_a_drop(artifact_root):
    resources = default_resources(str(artifact_root)) | {
        "cluster": ClusterValidation(max_bytes="1K", iters=3, warmup=1, plateau_drop=0.25, latency_rise=100.0)
    }
    instance = DagsterInstance.ephemeral()
    first = materialize(
        [cluster.environment, cluster.allreduce_smoke, cluster.collective_bandwidth],
        resources=resources,
        instance=instance,
    )
    assert first.success
    c = _checks(first)
    assert c["devices_visible"].passed and c["gradient_equality"].passed and c["collectives_correct"].passed
    assert c["allreduce_vs_baseline"].passed and "now the baseline" in c["allreduce_vs_baseline"].description
    assert c["bandwidth_vs_baseline"].passed and "now the baseline" in c["bandwidth_vs_baseline"].description
    smoke = json.loads((artifact_root / "cluster" / "baselines" / "allreduce_smoke-gloo-cpu-1x2.json").read_text())
    assert smoke["metrics"]["world_size"] == 2 and 0 <= smoke["metrics"]["sum_max_abs_diff"] <= 1e-5
    assert smoke["metrics"]["wall_seconds"] > 0

    sweep_file = next((artifact_root / "cluster" / "collective_bandwidth").glob("*/sweep.json"))
    sweep = json.loads(sweep_file.read_text())
    assert sweep["world_size"] == 2 and sweep["backend"] == "gloo"
    # nccl-tests' definitions, written out for n = 2: algbw = size / time; busbw = algbw x 2(n-1)/n = 1.0
    # for all_reduce and algbw x (n-1)/n = 0.5 for all_gather and reduce_scatter.
    factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}
    for op in factor:
        rows = [r for r in sweep["rows"] if r["op"] == op]
        assert [r["bytes"] for r in rows] == [8, 16, 32, 64, 128, 256, 512, 1024]
        for r in rows:
            assert r["time_us"] > 0 and r["wrong"] == 0
            algbw = r["bytes"] / (r["time_us"] * 1e-6) / 1e9
            assert r["algbw_gbps"] == pytest.approx(algbw)
            assert r["busbw_gbps"] == pytest.approx(algbw * factor[op])

    # Make the numbers drop: a baseline a thousand times faster than this machine (tiny messages on a loaded
    # host vary several-fold between runs, so a tenfold baseline could be met).
    base_file = next((artifact_root / "cluster" / "baselines").glob("collective_bandwidth-gloo-cpu-1x2.json"))
    base = json.loads(base_file.read_text())
    base["metrics"] = {k: v * 1000 if k.endswith("plateau_busbw_gbps") else v for k, v in base["metrics"].items()}
    base_file.write_text(json.dumps(base))
    second = materialize(
        [cluster.environment, cluster.collective_bandwidth],
        resources=resources,
        instance=instance,
        raise_on_error=False,
    )
    check = _checks(second)["bandwidth_vs_baseline"]
    assert not check.passed
    assert "all_reduce.plateau_busbw_gbps dropped" in check.description and "allowed: -25%" in check.description
    assert (
        check.metadata["baseline"].value["all_reduce.plateau_busbw_gbps"]
        == base["metrics"]["all_reduce.plateau_busbw_gbps"]
    )


@pytest.mark.slow
def test_training_and_gate_rungs_run_through_the_real_gate(artifact_root):
    """The top two rungs: a tiny real training run on this machine (2 gloo ranks), then the same
    evaluation gate campaigns use (paired candidate/base statistics) on held-out items. The
    declared distributed environment reaches the ranks the local launcher starts."""
    from training.profiling import read_report

    assert "NCCL_DEBUG" not in os.environ  # what the rank sees can only come from the spec
    resources = default_resources(str(artifact_root)) | {
        "cluster": ClusterValidation(
            train_steps=60, train_items=600, eval_items=40, gate_min_score=0.5, distributed_env={"NCCL_DEBUG": "INFO"}
        )
    }
    result = materialize(
        [cluster.environment, cluster.tiny_training, cluster.eval_gate],
        resources=resources,
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    c = _checks(result)
    assert c["loss_decreased"].passed
    # os.environ of local rank 0, recorded by the trainer's diagnostics inside the torchrun process
    report = read_report(next((artifact_root / "cluster" / "tiny_training").glob("*/run")))
    assert report["diagnostics"][0]["env"]["NCCL_DEBUG"] == "INFO"
    assert report["diagnostics"][0]["env"]["WORLD_SIZE"] == "2"
    assert c["gate"].passed, c["gate"].description
    md = {k: v.value for k, v in result.asset_materializations_for_node("cluster__eval_gate")[0].metadata.items()}
    assert md["verdict"] == "GO" and md["candidate_score"] >= 0.5 > md["base_score"]
    assert "| cipher |" in md["report"]


def test_ladder_command_reports_warn_checks_without_failing():
    from dagster import AssetCheckEvaluation, AssetCheckSeverity, AssetKey

    from campaign_app.cli.common import check_status

    def ev(passed, severity):
        return AssetCheckEvaluation(
            asset_key=AssetKey(["cluster", "x"]), check_name="c", passed=passed, severity=severity
        )

    assert check_status(ev(True, AssetCheckSeverity.ERROR)) == "PASS"
    assert check_status(ev(False, AssetCheckSeverity.WARN)) == "WARN"
    assert check_status(ev(False, AssetCheckSeverity.ERROR)) == "FAIL"
