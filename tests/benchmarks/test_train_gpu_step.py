"""benchmarks/train_gpu_step.py: skips cleanly without CUDA, and ``--tiny`` runs every section on CPU (TRL included)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.train_support import child_env

SCRIPT = REPO_ROOT / "benchmarks" / "train_gpu_step.py"


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, env=child_env(threads=1),
                          capture_output=True, text=True, timeout=timeout)


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
def test_tiny_runs_every_section_with_trl_and_reports_ratios_and_goals(tmp_path):
    p = _run("--tiny", "--steps", "2", "--planned-micro-batch", "6", "--out", str(tmp_path / "tiny.json"))
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads((tmp_path / "tiny.json").read_text())
    assert out["failed"] == [] and out["matmul_peak_tflops"]["value"] > 0
    r = out["results"]
    timed = [k for k in ("lora", "lora_other_ce", "qlora_nf4", "fsdp2_lora", "qlora_fsdp2", "bare_loop", "planned",
                         "trl_checkpointing_off", "trl_checkpointing_on") if "tokens_per_s" in r[k]]
    assert {"lora", "lora_other_ce", "fsdp2_lora", "bare_loop", "planned", "trl_checkpointing_off",
            "trl_checkpointing_on"} <= set(timed)
    for k in ("qlora_nf4", "qlora_fsdp2"):
        assert "tokens_per_s" in r[k] or "bitsandbytes" in r[k]["skipped"]
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
    assert r["planned"]["micro_batch"] == 6
    checks = r["kernel_checks"]
    assert checks["failed"] == [] and checks["varlen_attention"]["segment_eager"]["ok"]
    assert checks["linear_cross_entropy"]["chunked"]["ok"] and "skipped" in checks["liger"]["rms_norm"]
    # ratios and goals reported; on a CPU (--tiny) never enforced, and the 1.1B MFU goal not read
    ratios = out["ratios"]
    for k in ("speed_vs_trl_fastest", "peak_memory_vs_trl_leanest", "world_of_one_vs_bare_loop",
              "fsdp2_vs_world_of_one"):
        assert ratios[k] > 0, k
    assert out["goals_enforced"] is False and out["goals"]["planned_mfu"]["met"] is None
    assert set(out["goals"]) == {"speed_vs_trl_fastest", "peak_memory_vs_trl_leanest", "planned_mfu",
                                 "world_of_one_vs_bare_loop", "qlora_vs_lora"}
    assert "skipped" in r["vllm_teacher"]
