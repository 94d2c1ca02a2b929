"""Profiling in the trainer: off by default and inert; on, per-rank Chrome traces, a triage of a
real two-rank run of the demo trainer (gloo), the training asset's metadata, and S3 upload."""

import json
import shutil

import pytest

from campaigns.spec import DiagnosticsSpec, ProfilerScheduleSpec, ProfilingSpec, StudentSpec, TrainingSpec
from training.profiling import RunProfiler, read_report


def _training(**kw) -> TrainingSpec:
    return TrainingSpec(max_steps=5, **kw)


def _loop(prof, steps=5):
    import torch

    a = torch.randn(64, 64)
    for _ in range(steps):
        for _ in range(3):
            a = torch.tanh(a @ a)
        prof.step()


def test_profiling_is_off_by_default_and_writes_no_trace(tmp_path):
    t = _training()
    assert t.profiling.enabled is False
    with RunProfiler(t, tmp_path) as prof:
        assert prof._prof is None
        _loop(prof)
    report = prof.finish()
    assert report["profiling_enabled"] is False and report["triage"] is None and report["traces"] == []
    assert not (tmp_path / "profile" / "traces").exists()
    assert len(report["diagnostics"]) == 1 and report["diagnostics"][0]["node"] == 0
    from assets.perf_metadata import profile_metadata

    md = profile_metadata(tmp_path)
    assert "triage_verdict" not in md and "diagnostics" in md


def test_in_process_trace_export_triage_and_s3_upload(tmp_path, monkeypatch, capsys):
    import boto3
    from moto import mock_aws

    out = tmp_path / "demo" / "student_adapter" / "k123"
    spec = ProfilingSpec(
        enabled=True,
        schedule=ProfilerScheduleSpec(wait=1, warmup=1, active=2, repeat=1),
        record_shapes=True,
        upload_url="s3://traces-bucket/runs",
    )
    t = _training(profiling=spec, diagnostics=DiagnosticsSpec(commands=[]))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        boto3.client("s3").create_bucket(Bucket="traces-bucket")
        with RunProfiler(t, out) as prof:
            _loop(prof, steps=6)
        report = prof.finish()
        keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="traces-bucket")["Contents"]]
    trace = out / "profile" / "traces" / "rank0.cycle1.pt.trace.json"
    assert report["traces"] == [str(trace)]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("ProfilerStep#") for e in events)
    assert any("Input Dims" in e.get("args", {}) for e in events)  # record_shapes reached the profiler
    tri = report["triage"]
    assert tri["ranks"][0]["steps"] == 2 and tri["verdict"] in ("compute-bound", "launch-bound")
    assert read_report(out) == json.loads(json.dumps(report))
    assert (out / "profile" / "triage.md").read_text().startswith("verdict: ")
    assert report["upload_url"] == "s3://traces-bucket/runs/demo/student_adapter/k123/profile"
    assert "runs/demo/student_adapter/k123/profile/traces/rank0.cycle1.pt.trace.json" in keys
    assert "runs/demo/student_adapter/k123/profile/report.json" in keys
    from campaign_app.cli import main

    assert main(["triage", str(out / "profile" / "traces")]) == 0
    assert capsys.readouterr().out.startswith(f"verdict: {tri['verdict']}")


@pytest.mark.slow
def test_real_two_rank_demo_trainer_trace_is_triaged(tmp_path, demo_models):
    """The demo trainer (4-bit QLoRA, FSDP2, gloo) on two ranks, profiled: real CPU traces, triaged."""
    from assets.perf_metadata import profile_metadata
    from training import triage
    from training.cluster import ladder
    from training.cluster.torchrun import run_torchrun
    from training.config import TrainJob

    train, _ = ladder.tiny_task(64, 1)
    dataset = ladder.tokenize_tiny(demo_models["student"], train, tmp_path / "data")
    out = tmp_path / "camp" / "student_adapter" / "key"
    t = TrainingSpec(
        max_steps=4,
        micro_batch_size=8,
        max_seq_len=64,
        processes_per_node=2,
        log_every=1,
        profiling=ProfilingSpec(enabled=True, schedule=ProfilerScheduleSpec(wait=1, warmup=1, active=2)),
    )
    job = TrainJob(
        campaign="camp",
        base_model_path=str(demo_models["student"]),
        dataset_path=str(dataset),
        output_dir=str(out),
        student=StudentSpec(base_model="@demo/student"),
        training=t,
    )
    job.write(tmp_path / "job.json")
    logs = run_torchrun(
        ["-m", "training", "--config", str(tmp_path / "job.json")], nodes=1, procs=2, log_dir=tmp_path, timeout_s=600
    )
    report = read_report(out)
    assert report is not None, logs[0].read_text()[-3000:]
    traces = sorted((out / "profile" / "traces").glob("*.pt.trace.json"))
    assert [p.name for p in traces] == ["rank0.cycle1.pt.trace.json", "rank1.cycle1.pt.trace.json"]
    names = {e.get("name", "") for e in json.loads(traces[0].read_text())["traceEvents"]}
    # The names the classifier relies on, as torch 2.13 writes them on CPU with gloo and FSDP2:
    assert {"ProfilerStep#2", "ProfilerStep#3", "FSDP::root_pre_forward"} <= names
    assert any(n.startswith("FSDP::all_gather") for n in names) and any(n.startswith("gloo:") for n in names)
    tri = report["triage"]
    assert [r["rank"] for r in tri["ranks"]] == [0, 1]
    for r in tri["ranks"]:
        assert r["mode"] == "host" and r["steps"] == 2
        assert sum(r[f"{p}_fraction"] for p in triage.PARTS) == pytest.approx(1.0)
        assert r["comm_ms"] > 0 and r["data_ms"] > 0 and r["compute_ms"] > 0
    assert tri["verdict"] in triage.VERDICTS and tri["decision_path"]
    assert "This run fits one node (2 process(es))" in tri["topology_advice"]
    node = report["diagnostics"][0]
    cmds = {c["name"]: c for c in node["commands"]}
    assert list(cmds) == ["gpu_topology", "nvlink_status", "gpu_performance", "gpu_utilization", "infiniband"]
    # The status each command must have on the machine running this test: a tool not on PATH
    # (here: no nvidia-smi, no ibstat) is skipped and noted, never run and never an error; one that
    # is installed ran, and its status follows its exit code.
    for name, c in cmds.items():
        tool = c["command"].split()[0]
        if shutil.which(tool) is None:
            assert (c["status"], c["returncode"], c["seconds"]) == ("missing", None, 0.0), name
            assert c["note"] == f"`{tool}` is not installed on this node (not on PATH); skipped" and "file" not in c
        else:
            expected = "timeout" if c["returncode"] is None else "ok" if c["returncode"] == 0 else "failed"
            assert c["status"] == expected and (out / "profile" / "diagnostics" / "node0" / f"{name}.txt").exists()
    if shutil.which("nvidia-smi") is None and shutil.which("ibstat") is None:  # this machine: all five skipped
        assert report["diagnostics_summary"] == (
            f"node 0 ({node['host']}): missing 5 [gpu_topology, nvlink_status, "
            f"gpu_performance, gpu_utilization, infiniband]"
        )
    log = logs[0].read_text()
    assert "profile triage:" in log and f"verdict: {tri['verdict']}" in log
    md = profile_metadata(out)
    assert md["triage_verdict"] == tri["verdict"]
    assert md["profile_traces"].path == str(out / "profile" / "traces")
    assert "| 1 | 2 |" in md["triage_per_rank"].md_str
    assert "single NVLink node first" in md["topology_advice"].md_str
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
