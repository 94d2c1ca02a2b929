"""The trainer across processes (CPU, gloo, torchrun): exact gradients, two "nodes", kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.support.train_support import (
    PYTHON,
    REPO_ROOT,
    child_env,
    make_job,
    node_logs,
    start_nodes,
    write_cipher_dataset,
    write_pairs_dataset,
)
from training.net import free_port

pytestmark = pytest.mark.slow

FP32_4BIT = {"quantization": {"load_in_4bit": True, "compute_dtype": "float32"}}
BF16_4BIT = {"quantization": {"load_in_4bit": True, "compute_dtype": "bfloat16"}}  # never `auto`: fp32 on AVX2 hosts


def test_world2_accum2_gradients_equal_one_process(tmp_path, demo_models):
    """World 2 × accumulation 2 with uneven loss tokens per rank (one micro-batch has none) gives the
    gradients of one process on the whole batch, for every sharding topology and with each example counted once
    (``loss_normalization: example``); sharded forwards equal the unsharded model's, also on later forwards and
    after eval mode."""
    student = demo_models["student"]
    long = " " + " ".join(["qwertyui"] * 4)
    ds = write_pairs_dataset(
        tmp_path / "ds",
        student,
        [("encode ab =", " xy"), ("encode abcdefgh =", long), ("encode abc =", " q"), ("encode hello =", " itssg")],
        masked={0},
    )
    variants = {
        "full": ({"nodes": 1, "processes_per_node": 2, "sharding": "full"}, FP32_4BIT),
        "hybrid": ({"nodes": 2, "processes_per_node": 1, "sharding": "hybrid"}, FP32_4BIT),
        "none_ac": (
            {"nodes": 1, "processes_per_node": 2, "sharding": "none", "activation_checkpointing": True},
            FP32_4BIT,
        ),
        "full_bf16": ({"nodes": 1, "processes_per_node": 2, "sharding": "full"}, BF16_4BIT),
        # each example counted once: the step's example count is global too (all-reduced with the token counts)
        "full_example": (
            {"nodes": 1, "processes_per_node": 2, "sharding": "full", "loss_normalization": "example"},
            FP32_4BIT,
        ),
    }
    files = []
    for name, (topo, student_over) in variants.items():
        job = make_job(
            tmp_path / name,
            student,
            ds,
            student=student_over,
            max_steps=1,
            micro_batch_size=1,
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
        str(REPO_ROOT / "tests" / "support" / "train_scripts" / "grad_check.py"),
        str(out),
        *files,
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = torch.load(out, weights_only=False)
    assert len(results) == len(variants)
    for (name, _), f in zip(variants.items(), files, strict=False):
        r = results[f]
        per_rank = [sum(x) for x in r["tokens_per_rank_micro"]]
        assert per_rank[0] != per_rank[1], f"{name}: ranks should hold uneven loss-token counts, got {per_rank}"
        assert 0 in [x for micro in r["tokens_per_rank_micro"] for x in micro], (
            "one micro-batch should have no loss token"
        )
        assert r["global_tokens"] == sum(per_rank)
        bf16 = name.endswith("bf16")
        assert r["compute_dtype"] == ("bfloat16" if bf16 else "float32"), name
        fwd_tol = 0.0 if not bf16 else 1e-6  # same kernels on the same rows: bit-identical expected
        for mode, diffs in r["forward_max_abs_diff"].items():
            assert max(diffs) <= fwd_tol, f"{name}: sharded {mode} forward differs from unsharded: {diffs}"
        assert r["loss"] == pytest.approx(r["reference_loss"], rel=2e-2 if bf16 else 1e-5), name
        g, ref = r["grads"], r["reference_grads"]
        assert set(g) == set(ref) and len(g) == 28
        num = sum(float((g[k] - ref[k]).norm() ** 2) for k in g) ** 0.5
        den = sum(float(ref[k].norm() ** 2) for k in g) ** 0.5
        assert den > 0
        assert num / den < (3e-2 if bf16 else 1e-5), f"{name}: relative gradient error {num / den:.2e}"
        if not bf16:
            for k in g:
                torch.testing.assert_close(g[k], ref[k], rtol=1e-4, atol=1e-7, msg=f"{name}: {k}")


# --------------------------------------------------------------------------- two nodes, kill, resume

LORA = {
    "lora": {
        "r": 8,
        "alpha": 16,
        "dropout": 0.1,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }
}
STEPS, EVERY = 24, 6


def _two_node_job(out: Path, student: Path, ds: Path):
    return make_job(
        out,
        student,
        ds,
        student=LORA | FP32_4BIT,  # the dtype named, so every host runs the same job (bf16 FSDP: the test above)
        max_steps=STEPS,
        micro_batch_size=8,
        nodes=2,
        processes_per_node=1,
        sharding="full",
        learning_rate=5e-3,
        warmup_steps=2,
        eval_rows=32,
        collective_timeout_s=30,
        checkpoint={"every_steps": EVERY, "every_minutes": None, "keep_last": 2},
    )


def _commands(job_file: Path) -> list[list[str]]:
    from resources.local_launcher import torchrun_commands

    return torchrun_commands(job_file, 2, 1, PYTHON, free_port(), f"t{os.getpid()}{time.monotonic_ns()}")


def _run_to_end(job, workdir: Path) -> dict:
    from resources.local_launcher import supervise

    workdir.mkdir(parents=True, exist_ok=True)
    job_file = job.write(workdir / "train_job.json")
    logdir = workdir / f"logs-{time.monotonic_ns()}"
    procs = start_nodes(_commands(job_file), logdir)
    try:
        supervise(procs, sorted(logdir.glob("node-*.log")), time.monotonic() + 600, poll_s=0.2)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"training failed: {e}\n{node_logs(logdir)}")
    return json.loads((Path(job.output_dir) / "summary.json").read_text())


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory, demo_models):
    root = tmp_path_factory.mktemp("twonode")
    ds = write_cipher_dataset(root / "ds", demo_models["student"], 384, seed=3)
    job = _two_node_job(root / "uninterrupted", demo_models["student"], ds)
    summary = _run_to_end(job, root / "uninterrupted")
    return {"root": root, "ds": ds, "job": job, "summary": summary}


def _peft_eval_loss(base: Path, adapter: Path, ds: Path, rows: int) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from training import data as tdata
    from training import losses

    q = BitsAndBytesConfig(  # as the trainer loaded it (FP32_4BIT)
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, quantization_config=q)
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    data = tdata.load_rows(ds)
    total = n = 0.0
    with torch.no_grad():
        for i in range(0, rows, 8):
            b = tdata.collate(data, list(range(i, i + 8)), model.config.pad_token_id or 0)
            s, k = losses.cross_entropy_sum(
                model(**{k: v for k, v in b.items() if k not in tdata.NON_MODEL_KEYS}).logits, b["labels"]
            )
            total, n = total + float(s), n + k
    return total / n


def test_two_nodes_train_4bit_and_adapter_reloads_with_peft(two_node_run, demo_models):
    s, job = two_node_run["summary"], two_node_run["job"]
    assert (s["world_size"], s["nodes"], s["processes_per_node"], s["sharding"]) == (2, 2, 1, "full")
    assert s["effective_batch"] == 16 and s["trained_steps"] == STEPS and s["skipped_steps"] == 0
    assert s["eval_loss"] < 0.6 * s["eval_loss_before"], s
    out = Path(job.output_dir)
    adapter = out / "adapter"
    # the adapter, and what serving it needs from its base (tokenizer, chat template, generation config, card)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert not [
        p.name for p in adapter.iterdir() if p.suffix == ".safetensors" and p.name != "adapter_model.safetensors"
    ]
    reloaded = _peft_eval_loss(demo_models["student"], adapter, two_node_run["ds"], s["eval_rows"])
    assert s["compute_dtype"] == "float32"
    assert reloaded == pytest.approx(s["eval_loss"], rel=1e-3), (reloaded, s["eval_loss"])  # same dtype, same rows
    import pyarrow.parquet as pq

    metrics = pq.read_table(out / "metrics.parquet").to_pylist()
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert sum(m["loss"] for m in metrics[-4:]) / 4 < 0.6 * metrics[0]["loss"], [m["loss"] for m in metrics]
    assert all(m["tokens_per_s"] > 0 and m["peak_memory_mb"] > 0 and m["grad_norm"] > 0 for m in metrics)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["step-00000018", "step-00000024"], kept  # keep_last 2
    from safetensors import safe_open

    with safe_open(str(out / "checkpoints" / "step-00000018" / "adapter_model.safetensors"), "pt") as f:
        assert all(".lora_A." in k or ".lora_B." in k for k in f.keys())  # adapter only, never the base


def _worker_pids(node: subprocess.Popen) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(node.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_killed_rank_fails_job_in_bounded_time_and_relaunch_resumes(two_node_run, demo_models):
    from resources.local_launcher import stop_all

    root = two_node_run["root"]
    job = _two_node_job(root / "killed", demo_models["student"], two_node_run["ds"])
    (root / "killed").mkdir()
    job_file = job.write(root / "killed" / "train_job.json")
    ckpts = Path(job.output_dir) / "checkpoints"
    procs = start_nodes(_commands(job_file), root / "killed" / "logs-first")
    try:
        deadline = time.monotonic() + 300
        while not any((d / "_SUCCESS").exists() for d in ckpts.glob("step-*")):
            assert all(p.poll() is None for p in procs), node_logs(root / "killed" / "logs-first")
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        victims = _worker_pids(procs[1])
        assert victims, "rank 1's worker process not found"
        assert not (Path(job.output_dir) / "summary.json").exists(), "the run finished before the kill"
        os.kill(victims[0], signal.SIGKILL)
        t0 = time.monotonic()
        codes = [p.wait(timeout=120) for p in procs]  # no launcher stops the survivor: it must fail by itself
        elapsed = time.monotonic() - t0
    finally:
        stop_all(procs, grace_s=1)
    assert all(c != 0 for c in codes), codes
    print(f"job failed {elapsed:.1f}s after rank 1 was killed")
    assert elapsed < 45, f"the job took {elapsed:.1f}s to fail after a rank died"
    done = sorted(int(d.name.split("-")[1]) for d in ckpts.glob("step-*") if (d / "_SUCCESS").exists())
    assert done and done[-1] < STEPS
    # Relaunch: resumes from the newest complete checkpoint and ends where the uninterrupted run ended.
    summary = _run_to_end(job, root / "killed")
    assert summary["resumed_from_step"] == done[-1]
    from safetensors.torch import load_file

    a = load_file(str(Path(two_node_run["job"].output_dir) / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(Path(job.output_dir) / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    import pyarrow.parquet as pq

    steps = [m["step"] for m in pq.read_table(Path(job.output_dir) / "metrics.parquet").to_pylist()]
    assert steps == list(range(1, STEPS + 1))
