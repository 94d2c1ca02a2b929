"""benchmarks/train_gpu_step.py: skips cleanly without CUDA, and ``--tiny`` runs every section on CPU (TRL included),
the planned section at the memory policy's choice and the QLoRA sections with their NF4 dequantization share."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.train_support import child_env

SCRIPT = REPO_ROOT / "benchmarks" / "train_gpu_step.py"


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO_ROOT,
        env=child_env(threads=1),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _script_module():
    spec = importlib.util.spec_from_file_location("train_gpu_step_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved  # the script puts the repository's folders first on its own path
    return mod


def test_the_planned_section_takes_the_memory_policy_and_an_override_fixes_only_the_micro_batch(tmp_path, monkeypatch):
    import torch

    from training import model

    mod = _script_module()
    monkeypatch.setattr(model, "device_memory_gb", lambda _device: 80.0)
    cpu = torch.device("cpu")
    auto = mod.planned_policy(tmp_path, mod.SHAPES["tiny"], 64, "float32", cpu, tiny=True, micro=None)
    assert (auto.micro_batch_size, auto.activation_policy, auto.fits) == (mod.TINY_PLANNED_ROWS, "none", True)
    assert auto.chosen == ("micro_batch_size", "activation_checkpointing") and auto.device_memory_gb == 80.0
    fixed = mod.planned_policy(tmp_path, mod.SHAPES["tiny"], 64, "float32", cpu, tiny=True, micro=3)
    assert fixed.micro_batch_size == 3 and fixed.chosen == ("activation_checkpointing",)
    # the 1.1B shape at 1024 tokens: a large GPU keeps every activation, a 24 GB one recomputes the layers
    big = mod.planned_policy(tmp_path, mod.SHAPES["1b"], 1024, "bfloat16", torch.device("cuda"), tiny=False, micro=16)
    monkeypatch.setattr(model, "device_memory_gb", lambda _device: 24.0)
    small = mod.planned_policy(tmp_path, mod.SHAPES["1b"], 1024, "bfloat16", torch.device("cuda"), tiny=False, micro=16)
    assert (big.activation_policy, small.activation_policy) == ("none", "full") and big.fits and small.fits


def test_without_cuda_it_skips_cleanly_and_refuses_a_run_without_a_timed_step(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the real run is not a unit test")
    p = _run("--out", str(tmp_path / "r.json"))
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out == {"benchmark": "train_gpu_step", "skipped": "no CUDA device on this machine"}
    assert json.loads((tmp_path / "r.json").read_text()) == out
    bad = _run("--tiny", "--steps", "1")
    assert bad.returncode == 2 and "--steps must be at least 2" in bad.stderr


@pytest.mark.stage
def test_a_time_limit_skips_the_sections_that_would_start_after_it(tmp_path):
    p = _run(
        "--tiny",
        "--steps",
        "2",
        "--time-limit",
        "0.001",
        "--sections",
        "lora,planned,kernel_checks",
        "--out",
        str(tmp_path / "r.json"),
    )
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads((tmp_path / "r.json").read_text())
    assert "partial" not in out and out["failed"] == [] and out["time_limit_s"] == 0.001
    for k in ("lora", "planned", "kernel_checks"):
        assert out["results"][k] == {"skipped": "--time-limit 0.001 s reached before it started"}, k


@pytest.mark.stage
def test_tiny_runs_every_section_with_trl_and_reports_ratios_and_goals(tmp_path):
    p = _run("--tiny", "--steps", "2", "--out", str(tmp_path / "tiny.json"))
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads((tmp_path / "tiny.json").read_text())
    assert out["failed"] == [] and out["matmul_peak_tflops"]["value"] > 0
    r = out["results"]
    timed = [
        k
        for k in (
            "lora",
            "lora_other_ce",
            "qlora_nf4",
            "fsdp2_lora",
            "qlora_fsdp2",
            "bare_loop",
            "planned",
            "trl_checkpointing_off",
            "trl_checkpointing_on",
        )
        if "tokens_per_s" in r[k]
    ]
    assert {
        "lora",
        "lora_other_ce",
        "fsdp2_lora",
        "bare_loop",
        "planned",
        "trl_checkpointing_off",
        "trl_checkpointing_on",
    } <= set(timed)
    for k in ("qlora_nf4", "qlora_fsdp2"):
        assert "tokens_per_s" in r[k] or "bitsandbytes" in r[k]["skipped"]
        if "tokens_per_s" in r[k]:  # the NF4 dequantization's share, profiled on the trained recipe
            d = r[k]["nf4_dequant"]
            assert 0 < d["dequant_share"] < 1 and d["dequant_ms_per_step"] > 0 and d["steps"] == 3, (k, d)
            assert d["dequant_calls_per_step"] >= 14 and d["clock"] == "cpu", (k, d)  # 2 layers x 7 4-bit linears
    for k in timed:
        assert r[k]["tokens_per_s"] > 0 and r[k]["peak_memory_mb"] > 0 and r[k]["steps_timed"] == 1, (k, r[k])
        assert 0 < r[k].get("mfu", 0.5) < 1, (k, r[k])
    assert r["lora"]["fsdp2_mesh"] is None and r["fsdp2_lora"]["fsdp2_mesh"] == out["device"]
    # the sharded run computes what the unsharded one does (same seed, same rows)
    assert r["fsdp2_lora"]["final_loss"] == pytest.approx(r["lora"]["final_loss"], rel=1e-3)
    # TRL ran on the same kernel, with gradient checkpointing off and on, alternating with this trainer
    assert r["trl_checkpointing_off"]["attention"] == r["trl_checkpointing_on"]["attention"] == r["lora"]["attention"]
    assert [r[k]["gradient_checkpointing"] for k in ("trl_checkpointing_off", "trl_checkpointing_on")] == [False, True]
    # on a CPU the trainer's loss is on logits, and the linear cross-entropy without logits trains to the same loss
    assert r["lora"]["fused"] == {"liger": [], "cross_entropy": "logits"}
    assert r["lora_other_ce"]["fused"]["cross_entropy"] == "chunked"
    assert out["ratios"]["other_ce_final_loss_rel_diff"] < 1e-4
    # the planned section ran at the memory policy's choice (no --planned-micro-batch), and the trainer used it
    planned = r["planned"]
    policy = planned["memory_policy"]
    assert planned["micro_batch"] == policy["micro_batch_size"] == out["planned_micro_batch"] == 6
    assert planned["activation_policy"] == policy["activation_policy"] == out["planned_activation_policy"] == "none"
    assert policy["chosen"] == ["micro_batch_size", "activation_checkpointing"] and policy["fits"]
    assert r["lora"]["activation_policy"] == "recompute"  # the fixed sections keep the campaign's setting
    checks = r["kernel_checks"]
    assert checks["failed"] == [] and checks["varlen_attention"]["segment_eager"]["ok"]
    assert checks["linear_cross_entropy"]["chunked"]["ok"] and "skipped" in checks["liger"]["rms_norm"]
    # ratios and goals reported; on a CPU (--tiny) never enforced, and the 1.1B MFU goal not read
    ratios = out["ratios"]
    for k in (
        "speed_vs_trl_fastest",
        "peak_memory_vs_trl_leanest",
        "world_of_one_vs_bare_loop",
        "fsdp2_vs_world_of_one",
    ):
        assert ratios[k] > 0, k
    assert out["goals_enforced"] is False and out["goals"]["planned_mfu"]["met"] is None
    assert set(out["goals"]) == {
        "speed_vs_trl_fastest",
        "peak_memory_vs_trl_leanest",
        "planned_mfu",
        "world_of_one_vs_bare_loop",
        "qlora_vs_lora",
    }
    assert "skipped" in r["vllm_teacher"]


def test_the_gpu_check_script_runs_each_step_and_leaves_its_files(tmp_path):
    """benchmarks/gpu_check.sh on a machine without CUDA: every step runs and says how it ended; the benchmarks
    record themselves as skipped."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the real check is not a unit test")
    out = tmp_path / "out"
    env = child_env(threads=1) | {"OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_SECONDS": "200"}
    p = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu_check.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    summary = (out / "gpu_check.txt").read_text()
    assert "train_gpu_step: exit 0" in summary and "generation_speed: " in summary and "total: " in summary
    assert json.loads((out / "train_gpu_step.json").read_text())["skipped"] == "no CUDA device on this machine"
    env_txt = (out / "env.txt").read_text()
    assert "== nvidia-smi" in env_txt and "torch " in env_txt and "cuda None available False" in env_txt


@pytest.mark.stage  # two short trainer runs of the tiny model on the CPU
def test_the_gpu_check_fails_on_a_missed_goal_and_keeps_generation_its_own_budget(tmp_path):
    """A planted goal no run can meet (a world of one 1000x the bare loop), enforced on this CPU: train_gpu_step.py
    measures for real, misses it and exits 1, and gpu_check.sh exits 1 naming the step. Generation still gets its
    own GEN_SECONDS, however much training was allowed (TRAIN_SECONDS above the whole budget)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the real check is not a unit test")
    out = tmp_path / "out"
    planted = "--tiny --steps 2 --sections bare_loop --enforce-goals --goal world_of_one_vs_bare_loop=1000"
    env = child_env(threads=1) | {
        "OUT": str(out),
        "PYTHON": sys.executable,
        "GPU_CHECK_SECONDS": "400",
        "TRAIN_SECONDS": "1000",
        "GEN_SECONDS": "45",
        "TRAIN_ARGS": planted,
    }
    p = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu_check.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = (out / "gpu_check.txt").read_text()
    assert p.returncode == 1, summary + p.stderr[-2000:]
    train = re.search(r"train_gpu_step: exit (\d+) in \d+s \(limit (\d+)s\)", summary)
    assert train and train[1] == "1" and int(train[2]) <= 400 - 45, summary
    assert re.search(r"generation_speed: exit 0 in \d+s \(limit 45s\)", summary), summary
    assert "FAILED: train_gpu_step" in summary
    r = json.loads((out / "train_gpu_step.json").read_text())
    g = r["goals"]["world_of_one_vs_bare_loop"]
    assert r["goals_enforced"] and r["goals_missed"] == ["world_of_one_vs_bare_loop"] and not r["failed"]
    assert g["target"] == ">= 1000" and g["met"] is False and 0 < g["value"] < 1000  # measured, then judged
