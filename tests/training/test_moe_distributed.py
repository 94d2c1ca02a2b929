"""A mixture-of-experts student under FSDP2 on two gloo ranks: expert LoRA, router and attention
gradients (load-balancing loss included) equal one process's on the same micro-batches."""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.support.moe_support import moe_student as student_spec
from tests.support.train_support import PYTHON, REPO_ROOT, child_env, make_job, write_pairs_dataset

pytestmark = pytest.mark.slow

PAIRS = [
    ("encode ab =", " xy"),
    ("encode abcdefgh =", " qwertyui qwertyui"),
    ("encode abc =", " q"),
    ("encode hello =", " itssg"),
    ("encode zz =", " mm"),
    ("encode word =", " vgkr"),
    ("encode abcd =", " qwer"),
    ("encode x =", " b"),
]


def test_world2_moe_gradients_equal_one_process(tmp_path, moe_student):
    ds = write_pairs_dataset(tmp_path / "ds", moe_student, PAIRS)
    variants = {
        # fp32 base: expert LoRA + trained router + attention LoRA, aux loss weighted by each micro-batch's tokens
        "full_aux": (
            {"nodes": 1, "processes_per_node": 2, "sharding": "full"},
            student_spec(moe={"router": "trained", "aux_loss_coef": 0.05}),
        ),
        # QLoRA: 4-bit attention (the fused experts stay fp32), no aux loss: plain cross-entropy, hybrid mesh
        "qlora_hybrid": (
            {"nodes": 2, "processes_per_node": 1, "sharding": "hybrid"},
            student_spec(moe={"aux_loss_coef": 0.0}, quantization={"load_in_4bit": True, "compute_dtype": "float32"}),
        ),
    }
    files = []
    for name, (topo, st) in variants.items():
        job = make_job(
            tmp_path / name,
            moe_student,
            ds,
            student=st.model_dump(exclude={"base_model"}),
            max_steps=1,
            micro_batch_size=2,
            gradient_accumulation_steps=2,
            eval_rows=0,
            **topo,
        )
        files.append(str(job.write(tmp_path / f"{name}.json")))
    out = tmp_path / "grads.pt"
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(REPO_ROOT / "tests" / "support" / "train_scripts" / "moe_grad_check.py"),
        str(out),
        *files,
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = torch.load(out, weights_only=False)
    figures = {}
    for (name, (_, st)), f in zip(variants.items(), files, strict=False):
        r = results[f]
        g, ref = r["grads"], r["reference_grads"]
        assert set(g) == set(ref)
        experts = [k for k in g if ".mlp.experts." in k]
        assert len(experts) == 2 * 4 and any(k in r["sharded"] for k in experts)  # A and B of both tensors, 2 layers
        assert all(float(ref[k].abs().sum()) > 0 for k in g)
        worst = max(float((g[k] - ref[k]).abs().max()) for k in g)
        rel = (sum(float((g[k] - ref[k]).norm() ** 2) for k in g) / sum(float(ref[k].norm() ** 2) for k in g)) ** 0.5
        figures[name] = (worst, rel)
        for k in g:
            torch.testing.assert_close(g[k], ref[k], rtol=1e-4, atol=1e-6, msg=f"{name}: {k}")
        assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5), name
        assert r["routed_tokens"].sum() == 2 * 2 * r["reference_real_tokens"]  # MoE layers × top-k × real tokens
        assert [c["lora"] for c in r["grad_checks"]] == ["B"]
        if st.moe.aux_loss_coef:
            assert r["aux"] is not None and 1.0 <= r["aux"] <= 4.0
            assert any(k.endswith("mlp.gate.modules_to_save.default.weight") for k in g)
            # the auxiliary term changes the gradients well beyond the tolerance, so its weighting is what is checked
            off = r["reference_grads_without_aux"]
            assert max(float((ref[k] - off[k]).abs().max()) for k in g) > 100 * max(worst, 1e-9)
        else:
            assert r["aux"] is None and r["reference_loss"] == r["reference_loss_without_aux"]
    print("MoE FSDP2 vs one process (max |Δgrad|, relative error):", figures)
