"""Trace triage on synthetic Chrome traces built to show each bottleneck, one per verdict.

Each trace mimics what torch.profiler writes: ``ProfilerStep#N`` user annotations on the step
thread, ``cpu_op`` events (``aten::*``, ``c10d::*``), FSDP regions, gloo collectives on gloo's
own thread, and on GPU traces ``kernel`` / ``gpu_memcpy`` events on the device.
"""

import json

import pytest

from training import triage

PID, MAIN, GLOO, STREAM = 100, 100, 101, 7


def _x(name, ts, dur, cat="cpu_op", tid=MAIN, pid=PID):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": float(ts), "dur": float(dur)}


def _trace(rank, world, steps, step_us=10_000.0):
    """``steps(i, t0)`` returns the events of step ``i`` starting at ``t0`` (µs)."""
    events = []
    for i in range(3):
        t0 = 1_000_000.0 + i * step_us
        events.append(_x(f"ProfilerStep#{i + 2}", t0, step_us, cat="user_annotation"))
        events += steps(i, t0)
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world},
        "traceEvents": events + [{"ph": "M", "name": "thread_name", "pid": PID, "tid": MAIN, "args": {}}],
    }


def _host_step(t0, data_us=200.0, comm_us=1000.0, compute_us=8000.0):
    """Host (CPU-only) step: input pipeline, forward marker, compute, an FSDP all-gather, optimizer."""
    ev = [_x("aten::full", t0 + 10, data_us - 20)]  # collate, before forward
    f = t0 + data_us
    ev.append(_x("FSDP::root_pre_forward", f, 50, cat="user_annotation"))
    ev.append(_x("FSDP::all_gather (layers.0)", f + 50, comm_us, cat="user_annotation"))
    ev.append(_x("c10d::_allgather_base_", f + 60, comm_us - 20))  # nested inside the region
    t = f + 50 + comm_us
    n = 8
    for k in range(n):
        ev.append(_x("aten::mm", t + k * compute_us / n, compute_us / n - 5))
    return ev


def _decide(traces, context=None):
    return triage.decide([triage.analyze_trace(t).per_step() for t in traces], context)


def test_compute_bound_host_trace_adds_up():
    r = _decide([_trace(0, 1, lambda i, t0: _host_step(t0))])
    assert r["verdict"] == "compute-bound"
    row = r["ranks"][0]
    assert row["steps"] == 3 and row["mode"] == "host"
    assert sum(row[f"{p}_fraction"] for p in triage.PARTS) == pytest.approx(1.0)
    assert row["comm_ms"] == pytest.approx(1.0, abs=0.01)  # the region counts once, nested op included
    assert row["data_ms"] == pytest.approx(0.2, abs=0.01)


def test_data_starved_when_the_step_waits_before_forward():
    def step(i, t0):
        dl = [_x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", t0 + 100, 3500, cat="user_annotation")]
        return dl + _host_step(t0 + 3800, data_us=200, compute_us=5000)

    r = _decide([_trace(0, 1, step)])
    assert r["verdict"] == "data-starved"
    assert r["fractions"]["data"] > 0.35
    assert any("workers" in f for f in r["fixes"]) and any("pin_memory" in f for f in r["fixes"])


def test_communication_bound_counts_gloo_waits_on_its_own_thread():
    def step(i, t0):
        ev = _host_step(t0, comm_us=1000, compute_us=4000)
        # a synchronous all_reduce: the step thread waits (no op recorded there) while gloo works
        ev.append(_x("gloo:all_reduce", t0 + 5300, 4000, cat="user_annotation", tid=GLOO))
        return ev

    r = _decide([_trace(0, 2, step), _trace(1, 2, step)], {"nodes": 2, "processes_per_node": 8, "sharding": "full"})
    assert r["verdict"] == "communication-bound"
    assert r["ranks"][0]["comm_ms"] == pytest.approx(5.0, abs=0.05)
    assert "hybrid" in r["fixes"][0] and any("NCCL_IB_HCA" in f for f in r["fixes"])
    assert "sharding: hybrid" in r["topology_advice"] and "2 nodes" in r["topology_advice"]


def _device_trace(rank, kernels, step_us=10_000.0):
    def step(i, t0):
        ev = [_x("FSDP::root_pre_forward", t0 + 20, 10, cat="user_annotation")]
        for name, off, dur, cat in kernels:
            ev.append(_x(name, t0 + off, dur, cat=cat, tid=STREAM, pid=0))
        return ev

    return _trace(rank, 1, step, step_us)


def test_host_copy_bound_device_trace():
    kernels = [
        ("Memcpy HtoD (Pageable -> Device)", 40, 2000, "gpu_memcpy"),
        ("ampere_bf16_gemm", 2100, 7000, "kernel"),
        ("ncclDevKernel_AllGather_RING_LL", 9200, 300, "kernel"),
    ]
    r = _decide([_device_trace(0, kernels)])
    assert r["ranks"][0]["mode"] == "device"
    assert r["verdict"] == "host-copy-bound"
    assert r["fractions"]["h2d"] == pytest.approx(0.2, abs=0.01)


def test_launch_bound_many_tiny_kernels_with_gaps():
    kernels = [(f"void elementwise_kernel_{k}", 50 + k * 20, 5, "kernel") for k in range(490)]
    r = _decide([_device_trace(0, kernels)])
    assert r["verdict"] == "launch-bound"
    assert r["fractions"]["idle"] > 0.6 and r["median_op_us"] == pytest.approx(5.0)
    assert any("torch.compile" in f for f in r["fixes"]) and any("CUDA graphs" in f for f in r["fixes"])


def test_device_step_markers_decide_when_the_gpu_runs_behind_the_host():
    """The host finished queuing long ago; on the device each step starts with 4 ms of nothing
    (waiting for the next batch) before its kernels."""

    def step(i, t0):
        ev = [_x("FSDP::root_pre_forward", t0 + 20, 10, cat="user_annotation")]  # host window: all busy on device
        d0 = t0 + 3000  # the device's own step window, later than the host's
        ev.append(_x(f"ProfilerStep#{i + 2}", d0, 10_000, cat="gpu_user_annotation", tid=STREAM, pid=0))
        ev.append(_x("ampere_bf16_gemm", d0 + 4000, 5800, cat="kernel", tid=STREAM, pid=0))
        return ev

    r = _decide([_trace(0, 1, step)])
    assert r["verdict"] == "data-starved"
    assert r["fractions"]["data"] == pytest.approx(0.4, abs=0.01)


def test_overlapped_nccl_is_not_counted_as_exposed_communication():
    kernels = [("ampere_bf16_gemm", 40, 9000, "kernel"), ("ncclDevKernel_ReduceScatter", 1000, 7000, "kernel")]
    r = _decide([_device_trace(0, kernels)])
    assert r["verdict"] == "compute-bound"
    assert r["fractions"]["comm"] < 0.02


def test_straggler_one_rank_makes_the_others_wait():
    fast = _trace(0, 2, lambda i, t0: _host_step(t0, comm_us=5000, compute_us=4000))
    slow = _trace(1, 2, lambda i, t0: _host_step(t0, comm_us=1000, compute_us=8000))
    r = _decide([fast, slow])
    assert r["verdict"] == "straggler"
    assert r["slowest_rank"] == 1
    assert r["straggler_spread"] == pytest.approx(0.4, abs=0.02)
    assert "rank 1" in r["reason"] and any("throttling" in f for f in r["fixes"])
    assert r["decision_path"][0].startswith("straggler? ")


def test_files_cli_and_rendering(tmp_path, capsys):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.cycle1.pt.trace.json").write_text(
            json.dumps(_trace(rank, 2, lambda i, t0: _host_step(t0, comm_us=6000, compute_us=3000)))
        )
    assert triage.main([str(tmp_path), "--nodes", "1", "--processes-per-node", "2", "--sharding", "full"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("verdict: communication-bound")
    assert "| 0 | 3 |" in out and "| 1 | 3 |" in out and "single NVLink node first" in out
    assert "`sharding: none`" in out  # one node: the fix names replication, not hybrid sharding


def test_no_profiled_step_and_bad_file(tmp_path):
    empty = {"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0}]}
    r = triage.decide([triage.analyze_trace(empty, 0).per_step()])
    assert r["verdict"] is None and "schedule" in r["reason"]
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        triage.load_trace(bad)
