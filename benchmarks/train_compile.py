"""torch.compile on a CPU: does it pay? This trainer eager and compiled (inductor) on the demo student and on SmolLM2,
beside what ``compile: auto``'s probe decides for the same runs (prints JSON).

For each model, the trainer (``training.recipes.run``, a world of one, each run its own subprocess with
``--threads`` OpenMP threads, as the local launcher gives a rank) trains ``--steps`` steps eager (``compile: false``)
and compiled (``compile: true``, inductor), alternating for ``--repeats`` rounds so that other tenants' load falls on
both alike. The compiled runs share one inductor cache directory, empty before the first: the first compiled run's
warm-up is a cold one (code generation and gcc), later ones read inductor's caches. Per run: steady tokens/s (the
steps after the warm-up ones: the first two eager steps, the compiling steps and the one after them compiled), the
warm-up seconds (the compiling steps, less as many steady eager steps), the whole ``train()`` call, and the losses
(compiled against eager, step by step). The probe (``training.compile_choice.choose``, its own subprocess, its own
empty cache) then measures the same shape and says what ``auto`` decides for this benchmark's run and for the
campaign's own run length.

Models: the demo student (``@demo/student``, plain LoRA base in the dtype ``compute_dtype: auto`` picks here, the demo
campaign's LoRA, micro-batch 12 packed rows of <= 64 tokens, cipher rows) and SmolLM2-135M-Instruct with the speed
benchmarks' LoRA (``benchmarks/_real_model.py``: r16 on every linear layer, micro-batch 4 packed rows of <= 128
tokens of the smollm2 campaign's frozen distillation set).

Usage: python benchmarks/train_compile.py [--models demo,smollm2] [--steps 20] [--repeats 2] [--threads 1] [--out F]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

WARM_EAGER = 2  # eager steps left out of the steady figure (allocator and kernel warm-up)


def _env(threads: int, **extra) -> dict:
    from train_throughput import _env as base_env

    return base_env(threads) | extra


def run_child(job_file: str, out_file: str) -> None:
    """One trainer run (its compile setting is in the job); per-step figures and the summary's compile section."""
    import pyarrow.parquet as pq

    from training import recipes

    job = json.loads(Path(job_file).read_text())
    shutil.rmtree(job["output_dir"], ignore_errors=True)
    s = recipes.run(job_file)
    m = pq.read_table(Path(job["output_dir"]) / "metrics.parquet").to_pylist()
    keys = ("step", "loss", "tokens", "step_s", "compiling")
    Path(out_file).write_text(
        json.dumps({"steps": [{k: r.get(k) for k in keys} for r in m], "summary": {k: s.get(k) for k in SUMMARY}})
    )


SUMMARY = ("train_seconds", "compile", "compute_dtype", "attn_implementation", "activation_policy", "tokens")


def probe_child(job_file: str, out_file: str, campaign_micro_steps: str) -> None:
    """``compile_choice.choose`` for the job's run and for ``campaign_micro_steps``, as the trainer would call it."""
    import torch
    from transformers import AutoConfig

    from campaign_orchestrator.hardware import resolve_compute_dtype
    from training import compile_choice
    from training.config import TrainJob

    job = TrainJob.read(job_file)
    t = job.training
    dtype = getattr(torch, resolve_compute_dtype(job.student.quantization.compute_dtype, "cpu").dtype)
    cfg = AutoConfig.from_pretrained(job.base_model_path)
    tokens = t.micro_batch_size * t.max_seq_len
    out = {}
    for name, micro_steps in (("benchmark_run", t.max_steps), ("campaign_run", int(campaign_micro_steps))):
        t0 = time.perf_counter()
        c = compile_choice.choose(cfg, job.student, dtype, tokens, micro_steps)
        out[name] = c.as_dict() | {"seconds": round(time.perf_counter() - t0, 1)}
    Path(out_file).write_text(json.dumps(out))


def _child(args: list[str], threads: int, **env) -> None:
    p = subprocess.run(
        [sys.executable, __file__, *args], cwd=REPO, env=_env(threads, **env), capture_output=True, text=True
    )
    if p.returncode != 0:
        raise RuntimeError(f"{args[0]} failed:\n{p.stderr[-4000:]}")


def steady(run: dict, compiled: bool) -> dict:
    """Tokens/s over the steady steps, the warm-up seconds, and (compiled) how many steps compiled graphs."""
    steps = run["steps"]
    compiling = [i for i, r in enumerate(steps) if r["compiling"]]
    warm = (compiling[-1] + 2 if compiling else 1) if compiled else WARM_EAGER  # compiled: and the step after
    tail = steps[warm:] or [r for r in steps if not r["compiling"]][1:]  # still compiling late: its other steps
    out = {
        "steady_tokens_per_s": round(sum(r["tokens"] for r in tail) / sum(r["step_s"] for r in tail), 1)
        if tail
        else None,
        "steady_steps": len(tail),
        "warmup_steps": warm,
        "warmup_s": round(sum(r["step_s"] for r in steps[:warm]), 2),
        "train_seconds": round(run["summary"]["train_seconds"], 2),
    }
    if compiled:
        out["compiling_steps"] = [i + 1 for i in compiling]
    return out


def demo_jobs(work: Path, steps: int) -> tuple[dict, int]:
    """Eager and compiled jobs on the demo student (plain LoRA base) and the demo campaign's micro-steps."""
    from campaign_orchestrator.demo.build import build_demo_models
    from campaign_orchestrator.demo.recipe import resolve
    from tests.support.train_support import demo_spec, make_job, write_cipher_dataset

    root = Path(os.environ.get("CAMPAIGN_TEST_MODELS_ROOT", REPO / "artifacts"))
    build_demo_models(root, log=lambda _m: None, moe=False)
    student = resolve("@demo/student", root)
    tr = demo_spec().training
    ds = write_cipher_dataset(work / "demo-ds", student, 1024, seed=7)
    jobs = {}
    for compiled in (False, True):
        job = make_job(
            work / f"demo-{compiled}",
            student,
            ds,
            student={"quantization": {"load_in_4bit": False}},
            max_steps=steps,
            micro_batch_size=tr.micro_batch_size,
            eval_rows=0,
            compile=compiled,
            checkpoint={"every_steps": None, "every_minutes": None},
        )
        jobs[compiled] = job.write(work / f"demo-{compiled}.json")
    return jobs, tr.max_steps * tr.gradient_accumulation_steps


def smollm2_jobs(work: Path, steps: int) -> tuple[dict, int]:
    """Eager and compiled jobs on SmolLM2 (the speed benchmarks' LoRA and data) and the smollm2 campaign's
    micro-steps (its epochs over the dataset's rows)."""
    import _real_model
    import pyarrow.parquet as pq
    from train_throughput import make_job

    spec = _real_model.campaign()
    model = _real_model.model_dir(spec)
    _real_model.tokenized_dataset(work / "smollm2-ds", spec)
    ds = work / "smollm2-ds" / "train"
    jobs = {}
    for compiled in (False, True):
        sub = work / f"smollm2-{compiled}"
        sub.mkdir()
        f = make_job(sub, ds, model, spec, steps, spec.training.micro_batch_size)
        data = json.loads(f.read_text())
        data["training"]["compile"] = compiled
        f.write_text(json.dumps(data))
        jobs[compiled] = f
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in ds.glob("*.parquet"))
    t = spec.training
    micro_steps = math.ceil(t.epochs * rows / (t.micro_batch_size * t.gradient_accumulation_steps))
    return jobs, micro_steps * t.gradient_accumulation_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,smollm2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    from campaign_orchestrator.hardware import cpu_capability

    work = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    report = {
        "benchmark": "train_compile",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "cpu_capability": cpu_capability(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "steps": args.steps,
        "repeats": args.repeats,
        "models": {},
    }
    try:
        for name in args.models.split(","):
            jobs, campaign_micro_steps = {"demo": demo_jobs, "smollm2": smollm2_jobs}[name](work, args.steps)
            cache = work / f"inductor-{name}"
            runs = []
            for i in range(args.repeats):
                for compiled, f in jobs.items():
                    out = work / f"{name}-{compiled}-{i}.json"
                    load = os.getloadavg()[0]
                    _child(["--run-child", str(f), str(out)], args.threads, TORCHINDUCTOR_CACHE_DIR=str(cache))
                    r = json.loads(out.read_text())
                    entry = {
                        "compiled": compiled,
                        "repeat": i,
                        "load_average_1m": round(load, 2),
                        **steady(r, compiled),
                    }
                    if compiled:
                        entry["inductor_cache"] = "cold" if i == 0 else "warm"
                    entry["losses"] = [round(s["loss"], 6) for s in r["steps"]]
                    entry["summary"] = r["summary"]
                    runs.append(entry)
                    print(f"{name} compiled={compiled} #{i}: {entry['steady_tokens_per_s']} tok/s", file=sys.stderr)
            probe_out = work / f"{name}-probe.json"
            _child(
                ["--probe-child", str(jobs[False]), str(probe_out), str(campaign_micro_steps)],
                args.threads,
                CAMPAIGN_CACHE_DIR=str(work / f"probe-cache-{name}"),
                TORCHINDUCTOR_CACHE_DIR=str(work / f"probe-inductor-{name}"),
            )
            eager = [r for r in runs if not r["compiled"]]
            comp = [r for r in runs if r["compiled"]]
            best_e = max(r["steady_tokens_per_s"] or 0 for r in eager)
            best_c = max(r["steady_tokens_per_s"] or 0 for r in comp)
            diffs = [abs(a - b) / abs(b) for r in comp for a, b in zip(r["losses"], eager[0]["losses"], strict=True)]
            report["models"][name] = {
                "steady_tokens_per_s": {"eager": best_e, "compiled": best_c},
                "compiled_over_eager": round(best_c / best_e, 3),
                "cold_warmup_s": next(r["warmup_s"] for r in comp if r["inductor_cache"] == "cold"),
                "train_seconds": {
                    "eager": min(r["train_seconds"] for r in eager),
                    "compiled_cold": next(r["train_seconds"] for r in comp if r["inductor_cache"] == "cold"),
                    "compiled_warm": min(
                        (r["train_seconds"] for r in comp if r["inductor_cache"] == "warm"), default=None
                    ),
                },
                "loss_max_rel_diff_compiled_vs_eager": max(diffs),
                "campaign_micro_steps": campaign_micro_steps,
                "auto_probe": json.loads(probe_out.read_text()),
                "runs": runs,
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--run-child":
        run_child(*sys.argv[2:4])
    elif len(sys.argv) > 1 and sys.argv[1] == "--probe-child":
        probe_child(*sys.argv[2:5])
    else:
        sys.exit(main())
