"""benchmarks/train_gpu_step.py: skips cleanly without CUDA, and ``--tiny`` runs every section on CPU."""

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
def test_tiny_runs_lora_qlora_and_fsdp2_steps_and_reports_them(tmp_path):
    p = _run("--tiny", "--steps", "2", "--out", str(tmp_path / "tiny.json"))
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads((tmp_path / "tiny.json").read_text())
    assert out["failed"] == [] and out["matmul_peak_tflops"]["value"] > 0
    r = out["results"]
    timed = [k for k in ("lora", "qlora_nf4", "fsdp2_lora") if "tokens_per_s" in r[k]]
    assert "lora" in timed and "fsdp2_lora" in timed
    assert "tokens_per_s" in r["qlora_nf4"] or "bitsandbytes" in r["qlora_nf4"]["skipped"]
    for k in timed:
        assert r[k]["tokens_per_s"] > 0 and 0 < r[k]["mfu"] < 1 and r[k]["peak_memory_mb"] > 0, (k, r[k])
        assert r[k]["steps_timed"] == 1
    assert r["lora"]["fsdp2_mesh"] is None and r["fsdp2_lora"]["fsdp2_mesh"] == out["device"]
    # the sharded run computes what the unsharded one does (same seed, same rows)
    assert r["fsdp2_lora"]["final_loss"] == pytest.approx(r["lora"]["final_loss"], rel=1e-3)
    assert "skipped" in r["vllm_teacher"]
