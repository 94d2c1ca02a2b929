"""Training throughput at real shapes: this trainer against TRL's SFTTrainer at its fastest, on SmolLM2-135M (prints
JSON).

Model: SmolLM2-135M-Instruct (``@packaged/smollm2-135m-instruct``, 30 layers, vocabulary 49,152),
built by ``training.model.load_student`` for both trainers, with the smollm2 campaign's LoRA (r16,
alpha 32, every linear layer of the decoder) in the dtype ``compute_dtype: auto`` resolves to on this
host (fp32 on a CPU without native bf16). Data: the smollm2 campaign's tokenized dataset, fixed
(``benchmarks/_real_model.py``: the frozen distillation set built by the tokenized_dataset stage's own
code: chat template, loss on the assistant turns, BFD-packed rows of ≤ 128 tokens); its labelled-token
fraction is printed beside the figures.

TRL runs in its fastest configuration here: the same examples (the packed rows split back into the
stage's examples, with their loss masks), ``packing=True, packing_strategy="bfd"`` (which turns on
``padding_free``: one flattened row per micro-batch, no pad token), ``max_length`` 128, the same
micro-batch (packed rows per step), accumulation, steps, optimizer settings (AdamW, lr, cosine
schedule, warm-up, weight decay, clipping), threads and attention kernel, and its own chunked LM head
(``fused_lm_head``). This trainer runs as ``training.recipes.run`` does in production.

Every run is its own subprocess (fresh allocator, its own peak RSS), and the kinds alternate
(ours, trl, ours, trl, ...), so load from other tenants falls on both alike. Throughput is real
(non-padding) tokens per wall-clock second over the steps after the first ``--warmup`` (the
per-step clocks of each trainer; TRL's through a callback at step begin/end), and over the whole
``train()`` call for both. The best run of each kind is compared.

Kinds: ``ours`` (attention ``auto``: the kernel measured fastest at this shape, ``training.attention``),
``trl`` (TRL with the kernel ``ours`` resolved to: the pass/fail pairing), ``trl_eager`` / ``trl_sdpa``
(TRL with eager / transformers' default sdpa), ``ours_full_head`` (this trainer with the LM head and
loss at every position: the labelled-positions head switched off, to measure what it pays),
``ours_keep_all`` (this trainer keeping every activation autograd keeps: the exact recomputation of the
SwiGLU products and norm outputs in backward switched off, ``training/recompute.py``),
``ours_eager`` / ``ours_sdpa`` (this trainer forced to eager / sdpa: what the kernel choice pays),
``ours_glibc`` (this trainer on glibc malloc instead of the jemalloc its launcher preloads when the host
has it: what the allocator pays, ``campaign_orchestrator.allocator``), ``trl_jemalloc`` (TRL on jemalloc too).

MFU: model FLOPs per token × tokens/s over this host's measured matmul peak for the dtype used
(``campaign_orchestrator.hardware.measure_cpu_peak``). Model FLOPs per token of LoRA training on a
frozen base: 2·N forward + 2·N backward (input gradients only) for every linear weight N (the LM head
included, as if scored at every position) + 6·N_lora + causal attention. The same count is used for
both trainers, so the MFU ratio is the throughput ratio; the head skipped at unlabelled positions shows
up as MFU.

Usage: python benchmarks/train_throughput.py [--steps 30] [--repeats 2] [--threads 2] [--kinds ours,trl,...]
Exit status 1 when this trainer is slower than TRL (same kernel) or its peak memory is over 0.7× TRL's, both
against TRL at its best: its fastest run and its lowest peak, on glibc or on jemalloc.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

SPEED_TARGET = 1.3
MEMORY_TARGET = 0.7
MFU_TARGET = 0.65
KINDS = (
    "ours",
    "trl",
    "trl_eager",
    "trl_sdpa",
    "ours_full_head",
    "ours_eager",
    "ours_sdpa",
    "ours_glibc",
    "trl_jemalloc",
    "ours_keep_all",
)


def _env(threads: int) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


def flops_per_token(base_model: Path, lora_params: int, mean_seq: float) -> float:
    """Model FLOPs per trained token: 4·N_base (frozen: forward + input gradients) + 6·N_lora + causal attention."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(base_model))
    d, f, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or d // c.num_attention_heads
    q = c.num_attention_heads * head_dim
    kv = head_dim * getattr(c, "num_key_value_heads", c.num_attention_heads)
    per_layer = d * q * 2 + d * kv * 2 + 3 * d * f  # q, o, k, v, gate/up/down
    n_base = L * per_layer + c.vocab_size * d  # + lm_head
    attention = 6 * L * (mean_seq / 2) * q * 2  # QKᵀ and AV, causal half, forward + backward (input grads)
    return 4 * n_base + 6 * lora_params + attention


# --------------------------------------------------------------------------- children (one per run)


def _peak_rss_mb() -> float:
    from campaign_orchestrator.process_memory import peak_rss_mb

    return peak_rss_mb()  # the child's own peak: ru_maxrss starts from the parent's


def ours_child(job_file: str, out_file: str, variant: str) -> None:
    """This trainer, as ``python -m training`` runs it (``variant``: ``full_head`` switches the labelled head off,
    ``keep_all`` the recomputation of cheap activations: training/recompute.py)."""
    import pyarrow.parquet as pq
    import torch

    from training import recipes

    if variant == "full_head":
        recipes.LoraFinetuneRecipe.labelled_head = False
    if variant == "keep_all":
        recipes.LoraFinetuneRecipe.recompute_cheap = False
    job = json.loads(Path(job_file).read_text())
    shutil.rmtree(job["output_dir"], ignore_errors=True)
    t0 = time.perf_counter()
    s = recipes.run(job_file)
    wall = time.perf_counter() - t0
    m = pq.read_table(Path(job["output_dir"]) / "metrics.parquet").to_pylist()
    warm = int(os.environ.get("BENCH_WARMUP", "2"))
    steady = m[warm:]
    Path(out_file).write_text(
        json.dumps(
            {
                "tokens_per_s": sum(r["tokens"] for r in steady) / sum(r["step_s"] for r in steady),
                "tokens_per_s_best_step": max(r["tokens"] / r["step_s"] for r in steady),
                "tokens_per_s_train_call": s["tokens"] / s["train_seconds"],
                "tokens": s["tokens"],
                "steps": len(m),
                "loss_tokens": sum(r["loss_tokens"] for r in m),
                "train_seconds": s["train_seconds"],
                "process_wall_s": wall,
                "first_loss": m[0]["loss"],
                "final_loss": s["final_loss"],
                "peak_rss_mb": _peak_rss_mb(),
                "trainable": s["trainable_parameters"],
                "attention": s["attn_implementation"],
                "allocator": __import__("campaign_orchestrator.allocator", fromlist=["in_use"]).in_use(),
                "threads": torch.get_num_threads(),
            }
        )
    )


def trl_examples(dataset_dir: str) -> dict[str, list]:
    """The stage's examples, taken back out of its packed rows: ``input_ids`` and ``completion_mask`` (1 where
    the example's token carries a label)."""
    import numpy as np
    import pyarrow.parquet as pq

    from training import data as tdata

    ids_out, mask_out = [], []
    for f in tdata.parquet_files(dataset_dir):
        t = pq.read_table(f, columns=["input_ids", "labels", "position_ids"]).to_pydict()
        for ids, labels, pos in zip(t["input_ids"], t["labels"], t["position_ids"], strict=False):
            a, lab = np.asarray(ids), np.asarray(labels)
            starts = [*np.flatnonzero(np.asarray(pos) == 0).tolist(), len(a)]
            for s, e in zip(starts, starts[1:], strict=False):
                m = lab[s:e] != -100
                if not np.array_equal(lab[s:e][m], a[s:e][m]):
                    raise ValueError(
                        f"{f}: labels differ from input_ids where set; TRL's completion_mask cannot express these rows"
                    )
                ids_out.append(a[s:e].tolist())
                mask_out.append(m.astype(int).tolist())
    return {"input_ids": ids_out, "completion_mask": mask_out}


def trl_child(job_file: str, out_file: str, attention: str) -> None:
    """TRL's SFTTrainer, packing bfd + padding-free, on the same model, LoRA, examples, batch and optimizer."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from campaign_orchestrator.hardware import resolve_compute_dtype
    from training.config import TrainJob
    from training.model import load_student

    job = TrainJob.read(job_file)
    t = job.training
    torch.manual_seed(t.seed)
    dtype = resolve_compute_dtype(job.student.quantization.compute_dtype, "cpu").dtype
    kernel = attention
    model = load_student(
        job.base_model_path, job.student, torch.device("cpu"), attn_implementation=kernel, compute_dtype=dtype
    )
    tok = AutoTokenizer.from_pretrained(job.base_model_path)
    ds = Dataset.from_dict(trl_examples(job.dataset_path))

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps: list[tuple[float, int]] = []
            self._t = self._seen = 0

        def on_step_begin(self, args, state, control, **kw):
            self._t, self._seen = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **kw):
            self.steps.append((time.perf_counter() - self._t, state.num_input_tokens_seen - self._seen))

    args = SFTConfig(
        output_dir=str(Path(out_file).parent / f"trl_out_{os.getpid()}"),
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        max_steps=t.max_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        seed=t.seed,
        max_length=t.max_seq_len,
        packing=True,
        packing_strategy="bfd",
        padding_free=True,
        completion_only_loss=True,
        gradient_checkpointing=False,
        bf16=dtype == "bfloat16",
        fp16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=t.log_every,
        include_num_input_tokens_seen="non_padding",
        dataloader_num_workers=0,
        disable_tqdm=True,
        optim="adamw_torch",
    )
    clock = StepClock()
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[clock])
    t0 = time.perf_counter()
    res = trainer.train()
    wall = time.perf_counter() - t0
    warm = int(os.environ.get("BENCH_WARMUP", "2"))
    steady = clock.steps[warm:]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    Path(out_file).write_text(
        json.dumps(
            {
                "tokens_per_s": sum(n for _, n in steady) / sum(s for s, _ in steady),
                "tokens_per_s_best_step": max(n / s for s, n in steady),
                "tokens_per_s_train_call": trainer.state.num_input_tokens_seen / res.metrics["train_runtime"],
                "tokens": trainer.state.num_input_tokens_seen,
                "steps": len(clock.steps),
                "train_seconds": res.metrics["train_runtime"],
                "process_wall_s": wall,
                "first_loss": losses[0] if losses else None,
                "final_loss": losses[-1] if losses else None,
                "peak_rss_mb": _peak_rss_mb(),
                "attention": kernel,
                "threads": torch.get_num_threads(),
                "allocator": __import__("campaign_orchestrator.allocator", fromlist=["in_use"]).in_use(),
                "packed_rows": len(trainer.train_dataset),
            }
        )
    )


def _child(kind: str, job_file: Path, threads: int, out_file: Path, warmup: int, kernel: str) -> dict:
    """One run of ``kind`` in its own process; ``kernel``: the attention kernel ``ours`` resolved to."""
    mode = {
        "ours": ["--ours-child", "default"],
        "ours_full_head": ["--ours-child", "full_head"],
        "ours_keep_all": ["--ours-child", "keep_all"],
        "ours_sdpa": ["--ours-child", "default"],
        "ours_eager": ["--ours-child", "default"],
        "ours_glibc": ["--ours-child", "default"],
        "trl_jemalloc": ["--trl-child", kernel],
        "trl": ["--trl-child", kernel],
        "trl_eager": ["--trl-child", "eager"],
        "trl_sdpa": ["--trl-child", "sdpa"],
    }[kind]
    job = job_file
    if kind in ("ours_sdpa", "ours_eager"):
        data = json.loads(job_file.read_text())
        data["student"]["attn_implementation"] = kind.removeprefix("ours_")
        data["output_dir"] += "-" + kind
        job = job_file.with_name(f"job-{kind}.json")
        job.write_text(json.dumps(data))
    cmd = [sys.executable, __file__, mode[0], str(job), str(out_file), mode[1]]
    from campaign_orchestrator import allocator

    env = _env(threads) | {"BENCH_WARMUP": str(warmup)}
    # this trainer's processes get the allocator its launcher gives them (jemalloc when the host has it);
    # TRL's run as TRL users run them (glibc), and once on jemalloc too: the pairing that isolates the allocator
    if kind in ("trl_jemalloc", *(k for k in KINDS if k.startswith("ours") and k != "ours_glibc")):
        env |= allocator.preload_env(env)
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} run failed:\n{p.stderr[-4000:]}")
    return json.loads(out_file.read_text())


def ablation_child(job_file: str, out_file: str, rounds: str) -> None:
    """What each of the trainer's choices pays, measured in one process on one model: the trainer's own step
    (``accumulate``: forward, loss, backward of its collated micro-batches) with the labelled-positions head on
    and off and with each attention kernel, interleaved round by round (A, B, C, A, B, C, ...) so that other
    tenants' load falls on every variant alike; the fastest round of each is compared."""
    import statistics

    from training import attention
    from training.recipes import LoraFinetuneRecipe

    attention.register()
    tr = LoraFinetuneRecipe(__import__("training.config", fromlist=["TrainJob"]).TrainJob.read(job_file))
    tr.setup()
    base = tr.model.get_base_model()
    variants = {
        "auto": (True, tr.attn_implementation),
        "full_head": (False, tr.attn_implementation),
        **{f"attention_{k}": (True, k) for k in attention.CANDIDATES if k != tr.attn_implementation},
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    tokens = 0
    for r in range(int(rounds) + 1):
        batches, counts, _ = tr.prepare(r)
        tokens = counts[2]
        for name, (head, kernel) in variants.items():
            tr.labelled_head = head
            base.set_attn_implementation(kernel)
            t0 = time.perf_counter()
            tr.accumulate(batches, counts)
            dt = time.perf_counter() - t0
            tr.optimizer.zero_grad(set_to_none=True)
            if r:  # round 0 warms every variant up
                times[name].append(dt / counts[2])
    tr.cleanup()
    best = {k: min(v) for k, v in times.items()}
    Path(out_file).write_text(
        json.dumps(
            {
                "auto_kernel": tr.attn_implementation,
                "tokens_per_micro_step": tokens,
                "tokens_per_s_best_round": {k: round(1 / v, 1) for k, v in best.items()},
                "tokens_per_s_median_round": {k: round(1 / statistics.median(v), 1) for k, v in times.items()},
                "speedup_of_auto_over": {k: round(best[k] / best["auto"], 3) for k in best if k != "auto"},
                "rounds": int(rounds),
                "peak_rss_mb": round(_peak_rss_mb()),
            }
        )
    )


# --------------------------------------------------------------------------- the comparison


def make_job(work: Path, dataset: Path, model: Path, spec, steps: int, micro: int):
    from campaigns.spec import TrainingSpec
    from training.config import TrainJob

    tr = spec.training.model_dump() | {
        "max_steps": steps,
        "epochs": None,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": 1,
        "eval_rows": 0,
        "log_every": 10,
        "checkpoint": spec.training.checkpoint.model_dump() | {"every_steps": None, "every_minutes": None},
    }
    return TrainJob(
        campaign="bench",
        base_model_path=str(model),
        dataset_path=str(dataset),
        output_dir=str(work / "ours"),
        student=spec.student,
        training=TrainingSpec.model_validate(tr),
    ).write(work / "job.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the steady-state clock")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="packed rows (≤ 128 tokens) per micro-batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--ablation-rounds",
        type=int,
        default=6,
        help="rounds of the in-process interleaved comparison of the trainer's choices (0: none)",
    )
    ap.add_argument(
        "--kinds",
        default="ours,trl,ours_glibc,trl_jemalloc,trl_eager,ours_eager,ours_full_head",
        help=f"comma-separated, from {','.join(KINDS)}; ours and trl are always run",
    )
    args = ap.parse_args()
    kinds = list(dict.fromkeys(["ours", "trl", *[k for k in args.kinds.split(",") if k]]))
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown kinds {bad}; choose from {KINDS}")

    import _real_model

    spec = _real_model.campaign()
    model = _real_model.model_dir(spec)
    work = Path(tempfile.mkdtemp(prefix="bench-train-real-"))
    try:
        built = _real_model.tokenized_dataset(work / "ds", spec)
        job_file = make_job(work, work / "ds" / "train", model, spec, args.steps, args.micro)
        load_before = [round(x, 2) for x in os.getloadavg()]
        runs = []
        kernel = None
        for i in range(args.repeats):  # alternate, so other tenants' load falls on every kind alike
            for k in kinds:
                r = _child(k, job_file, args.threads, work / f"{k}-{i}.json", args.warmup, kernel)
                if k == "ours":
                    kernel = r["attention"]  # TRL gets the kernel this trainer resolved `auto` to
                runs.append({"kind": k, "repeat": i, **r, "load_average": [round(x, 2) for x in os.getloadavg()]})
                print(f"{k} #{i}: {r['tokens_per_s']:.1f} tok/s, peak RSS {r['peak_rss_mb']:.0f} MB", file=sys.stderr)
        ablation = None
        if args.ablation_rounds:
            p = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--ablation-child",
                    str(job_file),
                    str(work / "abl.json"),
                    str(args.ablation_rounds),
                ],
                cwd=REPO,
                env=_env(args.threads),
                capture_output=True,
                text=True,
            )
            if p.returncode != 0:
                raise RuntimeError(f"ablation run failed:\n{p.stderr[-4000:]}")
            ablation = json.loads((work / "abl.json").read_text())
        return report(args, kinds, runs, built, model, load_before, spec, ablation)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(args, kinds, runs, built, model: Path, load_before, spec, ablation=None) -> int:
    import torch
    import transformers
    import trl

    from campaign_orchestrator.hardware import measure_cpu_peak, resolve_compute_dtype

    torch.set_num_threads(args.threads)
    peak = measure_cpu_peak(refresh=True)  # measured again now: the cache keeps the best figure this host has shown
    dtype = resolve_compute_dtype("auto", "cpu", peak).dtype
    best = {k: max((r for r in runs if r["kind"] == k), key=lambda r: r["tokens_per_s"]) for k in kinds}
    train = built["splits"]["train"]
    labelled = train["loss_tokens"] / train["total_tokens"]
    mean_seq = built["total_tokens"] / built["examples_out"]  # attention spans one example (block-diagonal)
    fpt = flops_per_token(model, best["ours"]["trainable"], mean_seq)
    peak_flops = peak.gflops(dtype) * 1e9
    mfu = {k: fpt * b["tokens_per_s"] / peak_flops for k, b in best.items()}
    min_rss = {k: min(r["peak_rss_mb"] for r in runs if r["kind"] == k) for k in kinds}
    # the competitor at its best on the same kernel: its fastest run, and its lowest peak over every run on
    # either allocator (TRL as shipped runs on glibc; trl_jemalloc is TRL on the allocator this trainer uses)
    same_kernel_trl = [k for k in ("trl", "trl_jemalloc") if k in best]
    speed = best["ours"]["tokens_per_s"] / max(best[k]["tokens_per_s"] for k in same_kernel_trl)
    memory = min_rss["ours"] / min(min_rss[k] for k in same_kernel_trl)
    targets = {
        "speed_vs_trl_same_kernel": {
            "target": f">= {SPEED_TARGET}",
            "value": round(speed, 3),
            "met": speed >= SPEED_TARGET,
        },
        "peak_memory_vs_trl": {
            "target": f"<= {MEMORY_TARGET}",
            "value": round(memory, 3),
            "met": memory <= MEMORY_TARGET,
        },
        "mfu": {"target": f">= {MFU_TARGET}", "value": round(mfu["ours"], 4), "met": mfu["ours"] >= MFU_TARGET},
    }
    out = {
        "benchmark": "train_throughput",
        "date": time.strftime("%Y-%m-%d"),
        "model": (
            f"SmolLM2-135M-Instruct ({model.name}), LoRA r{spec.student.lora.r} on "
            f"{','.join(spec.student.lora.target_modules)}, {dtype}"
        ),
        "tokens_per_s": {k: round(b["tokens_per_s"], 1) for k, b in best.items()},
        "tokens_per_s_whole_train_call": {k: round(b["tokens_per_s_train_call"], 1) for k, b in best.items()},
        "tokens_per_s_best_single_step": {
            k: round(max(r.get("tokens_per_s_best_step", 0) for r in runs if r["kind"] == k), 1) for k in kinds
        },
        "speedup_vs_trl_same_kernel_best_single_step": round(
            max(r.get("tokens_per_s_best_step", 0) for r in runs if r["kind"] == "ours")
            / max(max(r.get("tokens_per_s_best_step", 0) for r in runs if r["kind"] == "trl"), 1e-9),
            3,
        ),
        "speedup_vs_trl_same_kernel": round(speed, 3),
        "speedups_other_pairings": {
            f"ours_vs_{k}": round(best["ours"]["tokens_per_s"] / best[k]["tokens_per_s"], 3)
            for k in kinds
            if k not in ("ours", "trl")
        },
        "peak_rss_mb": {k: round(b["peak_rss_mb"]) for k, b in best.items()},
        "peak_rss_mb_min_over_runs": {k: round(v) for k, v in min_rss.items()},
        "peak_memory_ratio_vs_trl": round(memory, 3),
        "allocator": {k: best[k].get("allocator") for k in kinds},
        "peak_memory_ratios_other_pairings": {
            f"{a}_vs_{b}": round(best[a]["peak_rss_mb"] / best[b]["peak_rss_mb"], 3)
            for a in ("ours", "ours_glibc")
            for b in ("trl", "trl_jemalloc")
            if a in best and b in best and (a, b) != ("ours", "trl")
        },
        "mfu": {k: round(v, 4) for k, v in mfu.items()},
        "matmul_peak_gflops": {
            "dtype": dtype,
            "value": round(peak.gflops(dtype), 1),
            "threads": peak.threads,
            "source": "campaign_orchestrator.hardware.measure_cpu_peak (cached per host)",
        },
        "model_flops_per_token": round(fpt),
        "data": {
            "source": "benchmarks/data/smollm2_distillation.jsonl through the tokenized_dataset stage's build",
            "train_rows": train["rows"],
            "examples": train["examples"],
            "tokens": train["total_tokens"],
            "loss_tokens": train["loss_tokens"],
            "labelled_token_fraction": round(labelled, 4),
            "packing_efficiency": round(built["packing_efficiency"], 4),
        },
        "what_each_change_pays": ablation,
        # the recomputation is exact: with it and without it, the same losses (bit for bit)
        "recompute_same_final_loss": (
            best["ours"]["final_loss"] == best["ours_keep_all"]["final_loss"] if "ours_keep_all" in best else None
        ),
        "targets": targets,
        "pass": speed >= 1.0 and memory <= MEMORY_TARGET,
        "pass_rule": "exit 1 when this trainer is slower than TRL (same kernel, steady-state wall clock, TRL's fastest "
        "run) or its lowest peak RSS is over 0.7x TRL's lowest (over TRL's runs on glibc and on "
        "jemalloc); every target's met/missed is listed in targets",
        "config": {
            "micro_batch_packed_rows": args.micro,
            "max_seq_len": 128,
            "accumulation": 1,
            "world": 1,
            "steps": args.steps,
            "warmup_steps_excluded": args.warmup,
            "threads": args.threads,
            "repeats": args.repeats,
            "trl": "SFTTrainer packing=True packing_strategy=bfd padding_free=True "
            "completion_only_loss=True max_length=128 optim=adamw_torch",
            "attention": {k: best[k]["attention"] for k in kinds},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        },
        "runs": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in runs],
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": len(os.sched_getaffinity(0)),
    }
    print(json.dumps(out, indent=2))
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ours-child":
        ours_child(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "--ablation-child":
        ablation_child(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "--trl-child":
        trl_child(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(main())
