"""The demo's training throughput with ``compute_dtype: auto`` against the same run forced to bf16, in
one run (prints JSON).

Same job (the demo campaign's student, LoRA, micro-batch, learning rate), same cipher rows, same
threads; only ``student.quantization.compute_dtype`` differs. The two alternate (auto, bf16, auto,
bf16, ...) and the best run of each is compared. ``auto`` resolves per host from a measured matmul
(campaign_orchestrator/hardware.py): fp32 on a CPU without native bf16, bf16 where it is native,
so the expected ratio is about 1x where bf16 is native and far more on an AVX2-only CPU.

Usage: python benchmarks/train_dtype.py [--steps 60] [--repeats 2] [--threads 1]
Exit status 1 when auto is slower than forced bf16 (auto must never lose).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]


def run(job_file: Path, threads: int) -> dict:
    out = Path(json.loads(job_file.read_text())["output_dir"])
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(
        [sys.executable, "-m", "training", "--config", str(job_file)], cwd=REPO, env=env, capture_output=True, text=True
    )
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    s = json.loads((out / "summary.json").read_text())
    return {
        "tokens_per_s": s["tokens_per_s"],
        "seconds": s["train_seconds"],
        "tokens": s["tokens"],
        "final_loss": s["final_loss"],
        "compute_dtype": s["compute_dtype"],
        "reason": s["compute_dtype_reason"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from campaign_orchestrator import hardware
    from campaign_orchestrator.demo.build import build_demo_models
    from campaign_orchestrator.demo.recipe import resolve
    from tests.support.train_support import demo_spec, make_job, write_cipher_dataset

    torch.set_num_threads(args.threads)
    root = REPO / "artifacts"
    build_demo_models(root, log=lambda _m: None)
    student = resolve("@demo/student", root)
    tr = demo_spec().training
    work = Path(tempfile.mkdtemp(prefix="bench-dtype-"))
    try:
        ds = write_cipher_dataset(work / "ds", student, 1024, seed=7)
        jobs = {}
        for dtype in ("auto", "bfloat16"):
            job = make_job(
                work / dtype,
                student,
                ds,
                student={"quantization": {"compute_dtype": dtype}},
                max_steps=args.steps,
                micro_batch_size=tr.micro_batch_size,
                learning_rate=tr.learning_rate,
                warmup_steps=tr.warmup_steps,
                eval_rows=0,
                checkpoint={"every_steps": None, "every_minutes": None},
            )
            jobs[dtype] = job.write(work / f"{dtype}.json")
        runs = []
        for _ in range(args.repeats):
            for dtype, f in jobs.items():
                runs.append({"setting": dtype, **run(f, args.threads)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = {k: max(r["tokens_per_s"] for r in runs if r["setting"] == k) for k in jobs}
    peak = hardware.measure_cpu_peak(refresh=True)
    ratio = best["auto"] / best["bfloat16"]
    report = {
        "benchmark": "train_dtype",
        "auto_resolved_to": next(r["compute_dtype"] for r in runs if r["setting"] == "auto"),
        "auto_reason": next(r["reason"] for r in runs if r["setting"] == "auto"),
        "cpu_capability": peak.capability,
        "matmul_gflops": {
            "float32": peak.fp32_gflops,
            "bfloat16": peak.bf16_gflops,
            "n": hardware.MATMUL_N,
            "threads": peak.threads,
        },
        "auto_tokens_per_s": round(best["auto"], 1),
        "bf16_tokens_per_s": round(best["bfloat16"], 1),
        "ratio_auto_over_bf16": round(ratio, 2),
        "pass": ratio >= 0.95,
        "pass_rule": "auto is never meaningfully slower than forcing bf16 (>= 0.95x, best of alternating runs)",
        "config": {
            "model": "demo student, 4-bit NF4 base (QLoRA), LoRA as the demo campaign",
            "steps": args.steps,
            "threads": args.threads,
            "micro_batch": tr.micro_batch_size,
        },
        "runs": runs,
        "load_average": os.getloadavg(),
    }
    print(json.dumps(report, indent=2))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
