"""Benchmark: how fast the trainer's loader hands out batches, against how fast the demo
trainer consumes them, in one run.

    python benchmarks/dataset_loader.py [--examples 20000] [--train-steps 20] [--trainer-summary PATH]

1. Builds a demo-like tokenized dataset (the demo's max length, packing and padding).
2. The demo trainer's consumption: runs ``python -m training`` on that dataset with the demo
   campaign's student and batch settings for ``--train-steps`` steps and reads tokens/s from its
   ``summary.json`` (or takes it from ``--trainer-summary``, e.g. a demo campaign run's).
3. The loader: a training loop that does no work (batch plan → memory-mapped rows → collated
   tensors, the trainer's exact calls), for at least ``--loader-seconds``, in process and through
   a DataLoader with two worker processes.

Target: loader tokens/s ≥ 10 × trainer tokens/s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _dataset_common import REPO, demo_pairs, demo_student, emit, load_average, write_jsonl


def demo_spec():
    from campaigns.loader import load_campaigns

    return load_campaigns([str(REPO / "campaigns" / "demo.yaml")]).campaigns["demo"]


def build(model: Path, work: Path, n: int, spec) -> Path:
    from campaign_orchestrator.dataset.tokenize import build_tokenized_dataset
    from stages.tokenized_dataset import build_settings

    src = write_jsonl(demo_pairs(n), work / "pairs.jsonl")
    build_tokenized_dataset(model, [src], work / "ds", build_settings(spec))
    return work / "ds" / "train"


def trainer_tokens_per_s(model: Path, dataset: Path, work: Path, spec, steps: int) -> dict:
    from training.config import TrainJob

    tr = spec.training.model_copy(update={"max_steps": steps, "epochs": None, "log_every": 10_000})
    job = TrainJob(
        campaign="bench",
        base_model_path=str(model),
        dataset_path=str(dataset),
        output_dir=str(work / "train"),
        student=spec.student,
        training=tr,
    )
    (work / "train").mkdir()
    cfg = job.write(work / "job.json")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "training", "--config", str(cfg)], cwd=REPO, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"trainer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((work / "train" / "summary.json").read_text())
    return {
        "source": f"python -m training, {steps} steps",
        "tokens_per_s": summary["tokens_per_s"],
        "tokens": summary["tokens"],
        "train_seconds": summary["train_seconds"],
        "process_seconds": time.perf_counter() - t0,
    }


def loader_tokens_per_s(dataset: Path, spec, seconds: float, workers: int) -> dict:
    from training import data as tdata

    tr = spec.training
    t_open = time.perf_counter()
    ds = tdata.load_rows(dataset)
    open_s = time.perf_counter() - t_open
    plan = tdata.BatchPlan(len(ds), tr.micro_batch_size, 1, tr.gradient_accumulation_steps, tr.seed)
    tokens = steps = 0
    t0 = time.perf_counter()
    if workers == 0:
        step = 0
        while time.perf_counter() - t0 < seconds:
            for idx in plan.step_rows(step, 0):
                b = tdata.collate(ds, idx, 0)
                tokens += tdata.real_token_count(b)
                tdata.loss_token_count(b)
            step += 1
        steps = step
    else:
        per_pass = 2000
        while time.perf_counter() - t0 < seconds:
            for _step, batches in tdata.make_loader(ds, plan, 0, steps, steps + per_pass, 0, num_workers=workers):
                tokens += sum(tdata.real_token_count(b) for b in batches)
            steps += per_pass
    dt = time.perf_counter() - t0
    return {
        "workers": workers,
        "steps": steps,
        "tokens": tokens,
        "seconds": round(dt, 3),
        "tokens_per_s": tokens / dt,
        "open_seconds": round(open_s, 3),
        "rows": len(ds),
        "padding": ds.padding,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=20_000)
    ap.add_argument("--train-steps", type=int, default=20)
    ap.add_argument("--trainer-summary", type=Path, default=None, help="use this summary.json instead of a short run")
    ap.add_argument("--loader-seconds", type=float, default=3.0)
    ap.add_argument(
        "--reference-trainer-tokens-per-s",
        type=float,
        default=12_000,
        help="the demo trainer's rate on an idle machine, for a second ratio (informational)",
    )
    args = ap.parse_args()

    spec = demo_spec()
    model = demo_student()
    work = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    load_before = load_average()
    try:
        dataset = build(model, work, args.examples, spec)
        if args.trainer_summary:
            s = json.loads(args.trainer_summary.read_text())
            trainer = {"source": str(args.trainer_summary), "tokens_per_s": s["tokens_per_s"], "tokens": s["tokens"]}
        else:
            trainer = trainer_tokens_per_s(model, dataset, work, spec, args.train_steps)
        inproc = loader_tokens_per_s(dataset, spec, args.loader_seconds, workers=0)
        pooled = loader_tokens_per_s(dataset, spec, args.loader_seconds, workers=2)
    finally:
        load_after = load_average()
        shutil.rmtree(work, ignore_errors=True)
    ratio = inproc["tokens_per_s"] / trainer["tokens_per_s"]
    return emit(
        {
            "benchmark": "dataset_loader",
            "demo_batch": {
                "micro_batch_size": spec.training.micro_batch_size,
                "gradient_accumulation_steps": spec.training.gradient_accumulation_steps,
                "max_seq_len": spec.training.max_seq_len,
                "padding": spec.dataset.padding,
            },
            "trainer": {k: round(v, 2) if isinstance(v, float) else v for k, v in trainer.items()},
            "loader_in_process": {k: round(v, 1) if isinstance(v, float) else v for k, v in inproc.items()},
            "loader_2_workers": {k: round(v, 1) if isinstance(v, float) else v for k, v in pooled.items()},
            "ratio_loader_to_trainer": round(ratio, 1),
            "ratio_loader_to_idle_reference": round(inproc["tokens_per_s"] / args.reference_trainer_tokens_per_s, 1),
            "note": "the trainer calls collate in process (loader_in_process); loader_2_workers is the DataLoader "
            "path, whose figure includes starting the worker processes",
            "target_ratio": 10.0,
            "pass": ratio >= 10.0,
            "load_average_before": load_before,
            "load_average_after": load_after,
        }
    )


if __name__ == "__main__":
    raise SystemExit(main())
