"""The fused cross-entropy under FSDP2 (gloo, torchrun, CPU): with the LM head sharded, world 2 trains with the fused
loss, and its loss and LoRA gradients are those of a world of one, fused or on logits.

After ``fully_shard`` the head's weight is a ``DTensor`` shard between steps; the loss runs inside the forward in place
of the head (``training.kernels.linear_ce.head_loss``), where the root unit holds it whole, with the root keeping its
parameters until backward (``reshard_after_forward: false``) or resharding them after its forward (``true``: backward
must gather them again before the final norm). The trainer's own counter says the fused path ran."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from tests.conftest import DIST_ENV
from tests.support.train_support import PYTHON, REPO_ROOT, child_env, make_job, write_pairs_dataset

pytestmark = pytest.mark.slow  # a torchrun launch of two processes

FP32 = {
    "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "quantization": {"load_in_4bit": False, "compute_dtype": "float32"},
}


def _torchrun(nproc: int, out, runs: list[str]) -> dict:
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(REPO_ROOT / "tests" / "support" / "train_scripts" / "fused_ce_check.py"),
        str(out),
        *runs,
    ]
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return torch.load(out, weights_only=False)


def _world_of_one(job_file: str, fused: bool, monkeypatch) -> dict:
    """What fused_ce_check.py records, for a world of one in this process."""
    sys.path.insert(0, str(REPO_ROOT / "tests" / "support" / "train_scripts"))
    from grad_check import perturb

    from training.config import TrainJob
    from training.recipes import LoraFinetuneRecipe

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in zip(DIST_ENV, ("0", "0", "1", "1", "127.0.0.1", str(port)), strict=True):
        monkeypatch.setenv(k, v)
    t = LoraFinetuneRecipe(TrainJob.read(job_file))
    t.fused_loss = fused
    try:
        t.setup()
        perturb(t.named_trainable)
        batches, counts, _ = t.prepare(0)
        res = t.accumulate(batches, counts)
        return {
            "loss": res.loss,
            "sharded": t.mesh is not None,
            "fused": t.fused_ce.report() if t.fused_ce is not None else None,
            "grads": {n: p.grad.detach().clone() for n, p in t.named_trainable},
        }
    finally:
        t.cleanup()


def test_world2_fused_loss_with_a_sharded_head_equals_world1(tmp_path, demo_models, monkeypatch):
    student = demo_models["student"]
    long = " " + " ".join(["qwertyui"] * 4)
    ds = write_pairs_dataset(
        tmp_path / "ds",
        student,
        [("encode ab =", " xy"), ("encode abcdefgh =", long), ("encode abc =", " q"), ("encode hello =", " itssg")],
        masked={0},
    )

    def job(name, **kw):
        j = make_job(tmp_path / name, student, ds, student=FP32, max_steps=1, eval_rows=0, **kw)
        return str(j.write(tmp_path / f"{name}.json"))

    two = {"nodes": 1, "processes_per_node": 2, "sharding": "full", "micro_batch_size": 1}
    w2 = _torchrun(
        2,
        tmp_path / "w2.pt",
        [
            "fused:" + job("w2_kept", reshard_after_forward=False, gradient_accumulation_steps=2, **two),
            "fused:" + job("w2_freed", reshard_after_forward=True, gradient_accumulation_steps=2, **two),
        ],
    )
    one = {"nodes": 1, "processes_per_node": 1, "micro_batch_size": 1, "gradient_accumulation_steps": 4}
    fused1 = _world_of_one(job("w1_fused", **one), True, monkeypatch)
    logits1 = _world_of_one(job("w1_logits", **one), False, monkeypatch)
    (kept,), (freed,) = ([v for k, v in w2.items() if name in k] for name in ("w2_kept", "w2_freed"))
    assert kept["sharded"] and freed["sharded"] and not fused1["sharded"] and kept["world"] == 2
    # the fused path ran on every micro-batch of every rank (counted where the head computes the loss)
    assert kept["fused"] == freed["fused"] == {"kind": "chunked", "micro_batches": 2}
    assert fused1["fused"] == {"kind": "chunked", "micro_batches": 4}
    assert logits1["fused"] is None
    ref = logits1
    assert len(ref["grads"]) == 12
    for name, r in (("w2 kept", kept), ("w2 freed", freed), ("w1 fused", fused1)):
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
        assert set(r["grads"]) == set(ref["grads"]), name
        for k, g in ref["grads"].items():
            assert float(g.abs().sum()) > 0, k
            torch.testing.assert_close(r["grads"][k], g, rtol=1e-4, atol=1e-7, msg=f"{name}: {k}")
