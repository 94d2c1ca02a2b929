"""Training throughput of this trainer against TRL's SFTTrainer, and MFU, in one run (prints JSON).

Same model (the demo student, 4-bit NF4 base with bf16 compute, built by ``training.model.load_student``
for both), same LoRA settings (the demo campaign's), same pre-tokenized rows and labels, same
micro-batch, accumulation and effective batch, same optimizer settings and step count, same
threads. Throughput counts real (non-padding) tokens per second of the training loop; TRL's
count is its own ``num_input_tokens_seen`` ("non_padding") over its ``train_runtime``. The two
alternate (ours, TRL, ours, TRL, ...) so load from other processes hits both alike; the best run
of each is compared, and every run is listed.

MFU: achieved model FLOP/s over this machine's measured peak for the compute dtype (a 2048²
bf16 matmul with the same thread count, measured in this run). Model FLOPs per token of LoRA
training: forward 2·N_base + backward input-gradients 2·N_base (the frozen base gets no weight
gradient) + 6·N_lora, plus attention (causal) 6·L·s·d; N counts linear weights only.

Usage: python benchmarks/train_throughput.py [--steps 150] [--repeats 3] [--threads 1]
Exit status 1 when the speedup is below the 1.5× target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

TARGET = 1.5


def _env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


def matmul_peak_gflops(threads: int, dtype: str = "bfloat16", n: int = 2048, reps: int = 8) -> float:
    import torch

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def flops_per_token(base_model: Path, lora_params: int, mean_seq: float) -> float:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(base_model))
    d, f, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = d // c.num_attention_heads * getattr(c, "num_key_value_heads", c.num_attention_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * f  # q, o, k, v, gate/up/down
    n_base = L * per_layer + c.vocab_size * d  # + lm_head
    attention = 6 * L * (mean_seq / 2) * d * 2  # QKᵀ and AV, causal half, forward + backward
    return 4 * n_base + 6 * lora_params + attention


def run_ours(job_file: Path, threads: int) -> dict:
    out = json.loads(job_file.read_text())["output_dir"]
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run([sys.executable, "-m", "training", "--config", str(job_file)], cwd=REPO, env=_env(threads),
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    s = json.loads((Path(out) / "summary.json").read_text())
    return {"tokens_per_s": s["tokens_per_s"], "tokens_per_cpu_s": s["tokens"] / s["train_cpu_seconds"],
            "tokens": s["tokens"], "seconds": s["train_seconds"], "cpu_seconds": s["train_cpu_seconds"],
            "final_loss": s["final_loss"], "trainable": s["trainable_parameters"], "attention": s["attn_implementation"]}


def run_trl(job_file: Path, threads: int, out_file: Path, attention: str = "sdpa") -> dict:
    p = subprocess.run([sys.executable, __file__, "--trl-child", str(job_file), str(out_file), attention], cwd=REPO,
                       env=_env(threads), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(out_file.read_text())


def trl_child(job_file: str, out_file: str, attention: str) -> None:
    """TRL's SFTTrainer on the same model, LoRA, rows and batch (runs in its own process).

    The model is loaded as a TRL user loads it: transformers' default attention (sdpa), unless the
    run is the transparency run that hands TRL this trainer's CPU attention choice too."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from training import data as tdata
    from training.config import TrainJob
    from training.model import load_student

    job = TrainJob.read(job_file)
    t = job.training
    torch.manual_seed(t.seed)
    model = load_student(job.base_model_path, job.student, torch.device("cpu"), attn_implementation=attention)
    tok = AutoTokenizer.from_pretrained(job.base_model_path)
    cols = pq.read_table(tdata.parquet_files(job.dataset_path)[0], columns=["input_ids", "labels"]).to_pydict()
    ds = Dataset.from_dict(cols)
    args = SFTConfig(
        output_dir=str(Path(out_file).parent / "trl_out"), per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps, max_steps=t.max_steps,
        learning_rate=t.learning_rate, lr_scheduler_type="cosine", warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, seed=t.seed, max_length=t.max_seq_len,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=t.log_every, include_num_input_tokens_seen="non_padding", dataloader_num_workers=0,
        packing=False, padding_free=False, disable_tqdm=True,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    cpu0 = time.process_time()
    res = trainer.train()
    cpu = time.process_time() - cpu0
    tokens = trainer.state.num_input_tokens_seen
    seconds = res.metrics["train_runtime"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    Path(out_file).write_text(json.dumps({"tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu,
                                          "tokens": tokens, "seconds": seconds, "cpu_seconds": cpu,
                                          "final_loss": losses[-1] if losses else None, "attention": attention}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads per process (default 1: with 2 on this shared 2-core machine OpenMP threads spin "
                         "against other tenants and both wall and CPU time stop measuring the trainer)")
    args = ap.parse_args()

    from campaign_orchestrator.demo.build import build_demo_models
    from campaign_orchestrator.demo.recipe import resolve
    from tests.support.train_support import demo_spec, make_job, write_cipher_dataset

    import torch

    root = REPO / "artifacts"
    build_demo_models(root, log=lambda _m: None, moe=False)
    student = resolve("@demo/student", root)
    spec = demo_spec()
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    ds = write_cipher_dataset(work / "ds", student, 2048, seed=7)
    tr = spec.training
    job = make_job(work / "ours", student, ds, max_steps=args.steps, micro_batch_size=tr.micro_batch_size,
                   gradient_accumulation_steps=tr.gradient_accumulation_steps, learning_rate=tr.learning_rate,
                   warmup_steps=tr.warmup_steps, log_every=tr.log_every, eval_rows=0,
                   checkpoint={"every_steps": None, "every_minutes": None})
    job_file = job.write(work / "job.json")

    try:
        return _measure(args, work, job_file, ds, student, spec, tr)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def _measure(args, work: Path, job_file: Path, ds: Path, student: Path, spec, tr) -> int:
    import torch

    runs = []
    for i in range(args.repeats):  # alternate, so load from other processes falls on every trainer alike
        runs.append({"trainer": "ours", **run_ours(job_file, args.threads)})
        runs.append({"trainer": "trl", **run_trl(job_file, args.threads, work / f"trl-{i}.json")})
        runs.append({"trainer": "trl_eager", **run_trl(job_file, args.threads, work / f"trle-{i}.json", "eager")})
    kinds = ("ours", "trl", "trl_eager")
    best = {k: max(r["tokens_per_s"] for r in runs if r["trainer"] == k) for k in kinds}
    best_cpu = {k: max(r["tokens_per_cpu_s"] for r in runs if r["trainer"] == k) for k in kinds}
    peak = matmul_peak_gflops(args.threads)
    import pyarrow.parquet as pq

    lengths = [len(x) for x in pq.read_table(ds / "data-00000.parquet", columns=["input_ids"]).column(0).to_pylist()]
    trainable = next(r["trainable"] for r in runs if r["trainer"] == "ours")
    fpt = flops_per_token(student, trainable, sum(lengths) / len(lengths))
    mfu = {k: fpt * v / (peak * 1e9) for k, v in best.items()}
    speedup_cpu = best_cpu["ours"] / best_cpu["trl"]
    speedup_wall = best["ours"] / best["trl"]
    import transformers
    import trl

    report = {
        "benchmark": "train_throughput",
        "ours_tokens_per_s": round(best["ours"], 1),
        "trl_sft_tokens_per_s": round(best["trl"], 1),
        "speedup_vs_trl_wall": round(speedup_wall, 3),
        "ours_tokens_per_cpu_s": round(best_cpu["ours"], 1),
        "trl_sft_tokens_per_cpu_s": round(best_cpu["trl"], 1),
        "speedup_vs_trl_cpu_time": round(speedup_cpu, 3),
        "target": TARGET,
        "pass": speedup_wall >= TARGET,
        "pass_rule": "real (non-padding) tokens per wall-clock second, best of alternating runs, as the target is "
                     "stated; tokens per CPU-second of the training loop is printed beside it (on a shared CPU the "
                     "wall clock also measures the other tenants)",
        "speedup_vs_trl_same_attention_cpu_time": round(best_cpu["ours"] / best_cpu["trl_eager"], 3),
        "mfu_ours": round(mfu["ours"], 5),
        "mfu_trl": round(mfu["trl"], 5),
        "matmul_peak_bf16_gflops": round(peak, 1),
        "model_flops_per_token": round(fpt),
        "config": {"model": "demo student (LlamaForCausalLM, hidden 64, 2 layers), 4-bit NF4, bf16 compute",
                   "lora": spec.student.lora.model_dump(), "micro_batch": tr.micro_batch_size,
                   "accumulation": tr.gradient_accumulation_steps, "world": 1, "steps": args.steps,
                   "threads": args.threads, "rows": len(lengths),
                   "attention": {"ours": next(r["attention"] for r in runs if r["trainer"] == "ours"),
                                 "trl": "sdpa (transformers' default)", "trl_eager": "eager"},
                   "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                "trl": trl.__version__}},
        "runs": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in runs],
        "load_average": os.getloadavg(),
        "note": "one run on a shared 2-core CPU: other processes' load moves absolute figures a lot. The speedup "
                "comes from the attention kernel this trainer picks on CPU (eager: PyTorch's CPU flash-attention "
                "backward is slow at these shapes) and a leaner loop; trl_eager gives TRL the same kernel.",
    }
    print(json.dumps(report, indent=2))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-child":
        trl_child(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(main())
