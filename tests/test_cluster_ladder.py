"""The ``cluster`` asset group: registered with its checks and job; the bandwidth rung really runs
(gloo, two processes, through Dagster), records its baseline, and a later run whose numbers drop
fails its check naming the change."""

import json

import pytest
from dagster import AssetKey, DagsterInstance, materialize

from assets import cluster
from assets.location import build_definitions, default_resources
from perf import collectives
from resources.cluster import ClusterValidation


def test_cluster_group_checks_and_job_are_registered():
    defs = build_definitions([])
    graph = defs.resolve_asset_graph()
    rungs = ["environment", "allreduce_smoke", "collective_bandwidth", "tiny_training", "eval_gate"]
    for rung in rungs:
        assert graph.get(AssetKey(["cluster", rung])).group_name == "cluster"
    checks = {(c.asset_key.path[-1], c.name) for c in graph.asset_check_keys if c.asset_key.path[0] == "cluster"}
    assert {("environment", "devices_visible"), ("allreduce_smoke", "gradient_equality"),
            ("collective_bandwidth", "bandwidth_vs_baseline"), ("tiny_training", "throughput_vs_baseline"),
            ("eval_gate", "gate")} <= checks
    job = defs.resolve_job_def(cluster.JOB)
    assert {n.name for n in job.nodes} >= {"cluster__" + r for r in rungs}
    # each rung stands on the one below it
    assert AssetKey(["cluster", "allreduce_smoke"]) in graph.get(AssetKey(["cluster", "collective_bandwidth"])).parent_keys
    assert AssetKey(["cluster", "tiny_training"]) in graph.get(AssetKey(["cluster", "eval_gate"])).parent_keys


def _checks(result) -> dict:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


@pytest.mark.slow
def test_bandwidth_rung_records_a_baseline_then_names_a_drop(artifact_root):
    resources = default_resources(str(artifact_root)) | {
        "cluster": ClusterValidation(max_bytes="1K", iters=3, warmup=1, plateau_drop=0.25, latency_rise=100.0)}
    instance = DagsterInstance.ephemeral()
    first = materialize([cluster.environment, cluster.collective_bandwidth], resources=resources, instance=instance)
    assert first.success
    c = _checks(first)
    assert c["devices_visible"].passed and c["collectives_correct"].passed
    assert c["bandwidth_vs_baseline"].passed and "now the baseline" in c["bandwidth_vs_baseline"].description

    sweep_file = next((artifact_root / "cluster" / "collective_bandwidth").glob("*/sweep.json"))
    sweep = json.loads(sweep_file.read_text())
    assert sweep["world_size"] == 2 and sweep["backend"] == "gloo" and sweep["rows"][0]["bytes"] == 8
    for r in sweep["rows"]:
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * collectives.bus_factor(r["op"], 2))
    assert {r["op"] for r in sweep["rows"]} == set(collectives.OPS)

    # Make the numbers drop: a baseline ten times faster than this machine.
    base_file = next((artifact_root / "cluster" / "baselines").glob("collective_bandwidth-gloo-cpu-1x2.json"))
    base = json.loads(base_file.read_text())
    base["metrics"] = {k: v * 10 if k.endswith("plateau_busbw_gbps") else v for k, v in base["metrics"].items()}
    base_file.write_text(json.dumps(base))
    second = materialize([cluster.environment, cluster.collective_bandwidth], resources=resources, instance=instance,
                         raise_on_error=False)
    check = _checks(second)["bandwidth_vs_baseline"]
    assert not check.passed
    assert "all_reduce.plateau_busbw_gbps dropped" in check.description and "allowed: -25%" in check.description
    assert check.metadata["baseline"].value["all_reduce.plateau_busbw_gbps"] == base["metrics"][
        "all_reduce.plateau_busbw_gbps"]


@pytest.mark.slow
def test_training_and_gate_rungs_run_through_the_real_gate(artifact_root):
    """The top two rungs: a tiny real training run on this machine (2 gloo ranks), then the same
    evaluation gate campaigns use (paired candidate/base statistics) on held-out items."""
    resources = default_resources(str(artifact_root)) | {
        "cluster": ClusterValidation(train_steps=60, train_items=600, eval_items=40, gate_min_score=0.5)}
    result = materialize([cluster.environment, cluster.tiny_training, cluster.eval_gate], resources=resources,
                         instance=DagsterInstance.ephemeral(), raise_on_error=False)
    c = _checks(result)
    assert c["loss_decreased"].passed
    assert c["gate"].passed, c["gate"].description
    md = {k: v.value for k, v in result.asset_materializations_for_node("cluster__eval_gate")[0].metadata.items()}
    assert md["verdict"] == "GO" and md["candidate_score"] >= 0.5 > md["base_score"]
    assert "| cipher |" in md["report"]
