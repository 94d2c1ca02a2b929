"""One GPU, one run (< 8 minutes): this trainer's bf16 LoRA, QLoRA and FSDP2 steps on a ~1B model, and the vLLM teacher.

Builds a TinyLlama-1.1B-shaped ``LlamaConfig`` model (random weights, bf16, saved like a checkpoint)
and a dataset of random token rows (labels on the second half), then runs ``training.recipes.run`` in
this process, a few steps each:

* ``lora``: bf16 base, LoRA r16 on every linear layer (a world of one: no FSDP wrapping);
* ``qlora_nf4``: the same on a 4-bit NF4 base (bf16 compute), when bitsandbytes runs 4-bit here; with
  ``nf4_dequant``, the NF4 dequantization's share of a step (``training.nf4_profile.recipe_dequant_share`` on the
  trained recipe before its cleanup: a few more forward/backward passes under the profiler, outside the timing);
* ``fsdp2_lora``: the bf16 LoRA run through FSDP2 (``fully_shard``, the trainer's own sharding,
  ``LoraFinetuneRecipe.shard_single_process``) with the NCCL process group of the trainer, on one GPU;

* ``qlora_fsdp2``: the NF4 run through FSDP2 on one GPU (4-bit storage in the compute dtype when sharded), with
  its ``nf4_dequant`` share too;
* ``bare_loop``: the same model, kernels and rows in a plain loop with no FSDP code and no process group at
  all (``load_student``, forward, loss, backward, AdamW): what a world of one may cost at most;
* ``planned``: this trainer at the micro-batch and activation policy the memory policy chooses for this model
  shape on this device's memory (``campaign_orchestrator.costs.memory_policy.choose_memory_policy``, as the planner
  and the trainer's ``auto`` fields do; ``--planned-micro-batch N`` fixes the micro-batch and the policy still
  picks the activations; ``--tiny`` aims at 6 rows so the suite stays fast), the choice in the JSON (MFU goal);
* ``trl``: TRL's ``SFTTrainer`` on the same model (``load_student``: same LoRA, dtype and attention kernel as
  ``lora`` resolved to), rows and batch (``completion_only_loss``, no packing, bf16 on a GPU), with
  gradient checkpointing off and on, alternating with ``lora`` (``--repeats`` rounds), steps after the first
  (with transformers' own RoPE put back around it: Liger's RoPE patch is module-wide);

each with real tokens/s after the first (warm-up) step, MFU against this GPU's measured bf16 matmul
peak (8192², same run) and peak allocated memory. ``kernel_checks``: every fused kernel (varlen attention,
linear cross-entropy, Liger's RMSNorm / SwiGLU / RoPE) against its plain path on this device
(``training.kernel_checks``). ``ratios`` and ``goals`` compare them (issue 35): >= 1.5x TRL's fastest
tokens/s with peak memory <= TRL's leanest (checkpointing on); MFU >= 35% (4N per token) at the planned
micro-batch on the 1.1B shape; a world of one <= 3% slower than the bare loop; QLoRA >= 0.75x LoRA's
tokens/s. Then, when ``vllm`` is importable, the ``vllm``
teacher backend (``campaign_orchestrator.generation.engines.vllm_engine.VLLMEngine``) generates for the demo
teacher (``@demo/teacher``; built into a temporary artifact root when absent): tokens/s, rows/s and
exact match against the references.

Without a CUDA device it prints ``{"skipped": ...}`` and exits 0 (so ``make bench`` passes on CPU
machines). ``--tiny`` runs a small config on whatever device there is, in the dtype
``compute_dtype: auto`` picks there (fp32 on a CPU without native bf16), against that dtype's
measured peak; the test suite runs it on CPU (``tests/benchmarks/test_train_gpu_step.py``). On CPU,
peak memory is the process's peak RSS so far (monotone across the runs of one process).

    python benchmarks/train_gpu_step.py --out gpu.json            # on a GPU node
    python benchmarks/train_gpu_step.py --tiny --steps 3          # anywhere: checks the script

The sections run in the order the goals need them (lora / TRL rounds, qlora_nf4, bare_loop, planned,
kernel_checks, then fsdp2_lora, qlora_fsdp2, lora_other_ce, vllm_teacher); ``--time-limit S`` reports the sections
that would start after S seconds as skipped, and ``--out`` holds what is done so far (``partial: true``) while it
runs, so a run cut short from outside still leaves its sections (``benchmarks/gpu_check.sh`` does both).

Exit status 1 when a section that should run fails (its error is in the JSON), when a kernel check differs,
or, on a GPU without ``--tiny``, when a goal is missed (``--tiny`` reports the goals and enforces them only with
``--enforce-goals``; ``--goal NAME=VALUE`` moves a goal's target: ``benchmarks/gpu_check.sh``'s test plants one).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]

SECTIONS = (
    "lora",
    "lora_other_ce",
    "qlora_nf4",
    "fsdp2_lora",
    "qlora_fsdp2",
    "bare_loop",
    "planned",
    "trl",
    "kernel_checks",
    "vllm_teacher",
)
SPEED_GOAL, MFU_GOAL, WORLD_OF_ONE_GOAL, QLORA_GOAL = 1.5, 0.35, 0.97, 0.75
# Each goal: the ratio it reads, met when at least (">=") or at most ("<=") its target. ``--goal NAME=VALUE`` moves a
# target (a check of the check: tests/benchmarks/test_train_gpu_step.py plants one no run can meet).
GOALS = {
    "speed_vs_trl_fastest": (">=", SPEED_GOAL),
    "peak_memory_vs_trl_leanest": ("<=", 1.0),
    "planned_mfu": (">=", MFU_GOAL),
    "world_of_one_vs_bare_loop": (">=", WORLD_OF_ONE_GOAL),
    "qlora_vs_lora": (">=", QLORA_GOAL),
}
TINY_PLANNED_ROWS = 6  # --tiny: the memory policy aims at this many rows per micro-step (a fast suite run)
PLAIN_ROPE: list = []  # transformers' Llama RoPE as imported, before any Liger patch (TRL's runs get it back)

SHAPES = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}


def matmul_peak_tflops(device, n: int) -> float:
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(10):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e12


def build(work: Path, shape: dict, seq: int, rows: int):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from campaign_orchestrator.dataset.tokenize import tokenizer_hash

    base = work / "base"
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
        pad_token="t0",
        bos_token="t1",
        eos_token="t2",
        unk_token="t3",
    )
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    cfg = LlamaConfig(
        max_position_embeddings=seq, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **shape
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(base))
    tok.save_pretrained(str(base))
    rng = np.random.default_rng(0)
    ids = [rng.integers(4, shape["vocab_size"], seq).tolist() for _ in range(rows)]
    labels = [[-100] * (seq // 2) + r[seq // 2 :] for r in ids]
    table = pa.table(
        {
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "labels": pa.array(labels, pa.list_(pa.int32())),
            "position_ids": pa.array([list(range(seq))] * rows, pa.list_(pa.int32())),
            "num_tokens": pa.array([seq] * rows, pa.int32()),
            "num_loss_tokens": pa.array([seq - seq // 2] * rows, pa.int32()),
            "example_ids": pa.array([[f"r{i}"] for i in range(rows)], pa.list_(pa.string())),
        }
    )
    (work / "ds").mkdir()
    meta = {
        "campaign.tokenizer_hash": tokenizer_hash(base),
        "campaign.max_seq_len": str(seq),
        "campaign.padding": "longest",
        "campaign.dataset_key": "gpu-bench",
        "campaign.split_name": "train",
    }
    pq.write_table(table.replace_schema_metadata(meta), work / "ds" / "data-00000.parquet")
    return base, work / "ds"


def student_spec(qlora: bool, dtype: str) -> dict:
    return {
        "quantization": {"load_in_4bit": qlora, "compute_dtype": dtype},
        "lora": {
            "r": 16,
            "alpha": 32,
            "dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        },
    }


def _peak_mb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    from campaign_orchestrator.process_memory import peak_rss_mb

    return peak_rss_mb()


def _reset_peak(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_one(
    work: Path,
    base: Path,
    ds: Path,
    name: str,
    qlora: bool,
    fsdp: bool,
    micro: int,
    steps: int,
    seq: int,
    dtype: str,
    fused_loss: str | bool | None = None,
    training: dict | None = None,
    dequant: bool = False,
) -> dict:
    """``training.recipes.run`` on a job of these settings (``training``: more TrainingSpec fields); ``dequant``:
    also the NF4 dequantization's share of a step, measured on the trained recipe before its cleanup."""
    import torch

    from tests.support.train_support import make_job
    from training import recipes
    from training.recipes import lora_finetune

    student = student_spec(qlora, dtype)
    out = work / name
    job = make_job(
        out,
        base,
        ds,
        student=student,
        max_steps=steps,
        micro_batch_size=micro,
        max_seq_len=seq,
        eval_rows=0,
        log_every=1,
        warmup_steps=1,
        checkpoint={"every_steps": None, "every_minutes": None},
        **(training or {}),
    )
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    recipes.LoraFinetuneRecipe.shard_single_process = fsdp
    real_shard, sharded = lora_finetune.shard, []

    def counting_shard(model, mesh, compute_dtype, *args):  # evidence that the run went through fully_shard
        sharded.append(str(mesh.device_type))
        return real_shard(model, mesh, compute_dtype, *args)

    lora_finetune.shard = counting_shard
    real_setup, seen = recipes.LoraFinetuneRecipe._setup_model, {}

    def recording_setup(self):  # which fused kernels the run used (the trainer logs them too)
        real_setup(self)
        seen.update(liger=list(self.liger_applied), cross_entropy=self.fused_ce.kind if self.fused_ce else "logits")

    recipes.LoraFinetuneRecipe._setup_model = recording_setup
    real_cleanup, nf4 = recipes.LoraFinetuneRecipe.cleanup, {}

    def measuring_cleanup(self, ok: bool = True):  # the trained model, process group and rows are still there
        if ok and dequant:
            from training.nf4_profile import recipe_dequant_share

            try:
                nf4.update(recipe_dequant_share(self, steps=3))
            except Exception as e:  # noqa: BLE001 - reported in the JSON; main() counts it as failed
                nf4["error"] = f"{type(e).__name__}: {e}"[:2000]
        real_cleanup(self, ok)

    recipes.LoraFinetuneRecipe.cleanup = measuring_cleanup
    if fused_loss is not None:
        recipes.LoraFinetuneRecipe.fused_loss = fused_loss
    try:
        summary = recipes.run(job.write(work / f"{out.name}.json"))
    finally:
        recipes.LoraFinetuneRecipe.shard_single_process = False
        lora_finetune.shard = real_shard
        recipes.LoraFinetuneRecipe._setup_model = real_setup
        recipes.LoraFinetuneRecipe.cleanup = real_cleanup
        recipes.LoraFinetuneRecipe.fused_loss = "auto"
    import pyarrow.parquet as pq

    # the first step warms kernels up; under torch.compile, every step that compiled graphs is warm-up too
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    m = [r for r in rows[1:] if not r.get("compiling")] or rows[-1:]
    tokens, secs = sum(r["tokens"] for r in m), sum(r["step_s"] for r in m)
    res = {
        "tokens_per_s": tokens / secs,
        "steps_timed": len(m),
        "peak_memory_mb": summary["peak_memory_mb"],
        "trainable": summary["trainable_parameters"],
        "final_loss": summary["final_loss"],
        "attention": summary["attn_implementation"],
        "world": summary.get("world_size", 1),
        "fsdp2_mesh": sharded[0] if sharded else None,
        "fused": seen,
        "activation_policy": summary.get("activation_policy"),
        "compiled": bool((summary.get("compile") or {}).get("enabled")),
    }
    if dequant:
        res["nf4_dequant"] = nf4 or {"error": "not measured (the run did not end cleanly)"}
    return res


def planned_policy(work: Path, shape: dict, seq: int, dtype: str, device, tiny: bool, micro: int | None):
    """The memory policy's micro-batch and activation policy for this benchmark's model shape, LoRA and rows on
    this device's memory (``choose_memory_policy``, the planner's and the trainer's rule; ``micro`` fixes the
    micro-batch). ``tiny``: aimed at a few rows per micro-step, so the suite runs the path quickly."""
    from campaign_orchestrator.costs.memory import ModelShape
    from campaign_orchestrator.costs.memory_policy import choose_memory_policy
    from tests.support.train_support import make_job
    from training.model import device_memory_gb

    job = make_job(
        work / "planned",
        work / "base",
        work / "ds",
        student=student_spec(False, dtype),
        micro_batch_size=micro or "auto",
        activation_checkpointing="auto",
        max_seq_len=seq,
    )
    return choose_memory_policy(
        ModelShape.from_config(shape | {"tie_word_embeddings": False}),
        job.student,
        job.training,
        device_memory_gb=device_memory_gb(device),
        seq_len=seq,
        device_type=device.type,
        compute_dtype=dtype,
        attention="sdpa",
        recompute_cheap=not job.training.compiling(device.type),
        target_tokens=TINY_PLANNED_ROWS * seq if tiny else None,
    )


def _job(work: Path, base: Path, ds: Path, name: str, micro: int, steps: int, seq: int, dtype: str, attention: str):
    from tests.support.train_support import make_job

    student = student_spec(False, dtype) | {"attn_implementation": attention}
    return make_job(
        work / name,
        base,
        ds,
        student=student,
        max_steps=steps,
        micro_batch_size=micro,
        max_seq_len=seq,
        eval_rows=0,
        warmup_steps=1,
    )


def _rows(ds: Path, n: int) -> dict:
    import pyarrow.parquet as pq

    t = pq.read_table(ds / "data-00000.parquet", columns=["input_ids", "labels", "position_ids"]).to_pydict()
    return {k: v[:n] for k, v in t.items()}


def bare_loop(
    work: Path, base: Path, ds: Path, micro: int, steps: int, seq: int, dtype: str, attention: str, device
) -> dict:
    """The same model, LoRA, kernels (attention, Liger, linear cross-entropy) and rows as ``lora`` in a plain loop:
    no process group, no FSDP import, no trainer: forward, loss, backward, clip, AdamW."""
    import torch

    from training import head, losses
    from training.kernels import liger, linear_ce
    from training.model import load_student, trainable_parameters

    job = _job(work, base, ds, "bare", micro, steps, seq, dtype, attention)
    t = job.training
    _reset_peak(device)
    torch.manual_seed(t.seed)
    model = load_student(str(base), job.student, device, attn_implementation=attention, compute_dtype=dtype)
    model.train()
    applied = liger.apply(model, device)
    fused = linear_ce.plan(model, device, distill=False)
    params = list(trainable_parameters(model))
    opt = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay, foreach=True)
    rows = _rows(ds, micro * steps)
    times, losses_seen = [], []
    for step in range(steps):
        sl = slice(step * micro, (step + 1) * micro)
        batch = {k: torch.tensor(rows[k][sl], dtype=torch.long, device=device) for k in rows}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        keep, scored = head.compact({"labels": batch["labels"]}, {"labels"})
        inputs = {
            "input_ids": batch["input_ids"],
            "position_ids": batch["position_ids"],
            "use_cache": False,
            "logits_to_keep": keep,
        }
        if fused is not None:
            sums = fused.loss_sums(model, inputs, scored["labels"])
        else:
            sums = losses.loss_sums(model(**inputs).logits, scored, False)
        loss = sums["ce_sum"] / sums["ce_tokens"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses_seen.append(float(loss))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    tokens = micro * seq
    return {
        "tokens_per_s": tokens * (steps - 1) / sum(times[1:]),
        "steps_timed": steps - 1,
        "peak_memory_mb": _peak_mb(device),
        "final_loss": losses_seen[-1],
        "attention": attention,
        "trainable": sum(p.numel() for p in params),
        "fused": {"liger": applied, "cross_entropy": fused[0] if fused else "logits"},
    }


def trl_run(
    work: Path,
    base: Path,
    ds: Path,
    micro: int,
    steps: int,
    seq: int,
    dtype: str,
    attention: str,
    device,
    checkpointing: bool,
) -> dict:
    """TRL's SFTTrainer on the same model (``load_student``: LoRA, dtype, attention kernel), rows and batch:
    ``completion_only_loss`` (the rows' labelled half), no packing, bf16 on a GPU; tokens/s over the steps after
    the first (a callback's clock at step begin/end, synchronized on CUDA)."""
    from transformers.models.llama import modeling_llama

    job = _job(work, base, ds, "trl", micro, steps, seq, dtype, attention)
    _reset_peak(device)
    patched_rope, modeling_llama.apply_rotary_pos_emb = modeling_llama.apply_rotary_pos_emb, PLAIN_ROPE[0]
    try:
        return _trl_train(job, base, ds, micro, steps, seq, dtype, attention, device, checkpointing, work)
    finally:  # TRL as shipped: transformers' own RoPE, not the module-wide Liger patch of this trainer's runs
        modeling_llama.apply_rotary_pos_emb = patched_rope


def _trl_train(job, base, ds, micro, steps, seq, dtype, attention, device, checkpointing, work) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from training.model import load_student

    t = job.training
    torch.manual_seed(t.seed)
    model = load_student(
        str(base), job.student, device, attn_implementation=attention, compute_dtype=dtype, recompute_cheap=False
    )
    rows = _rows(ds, micro * steps)
    data = Dataset.from_dict(
        {"input_ids": rows["input_ids"], "completion_mask": [[int(x != -100) for x in r] for r in rows["labels"]]}
    )

    class StepClock(TrainerCallback):
        def __init__(self):
            self.steps: list[float] = []
            self._t = 0.0

        def _sync(self):
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def on_step_begin(self, args, state, control, **kw):
            self._sync()
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self._sync()
            self.steps.append(time.perf_counter() - self._t)

    args = SFTConfig(
        output_dir=str(work / f"trl-out-{int(checkpointing)}-{time.monotonic_ns()}"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        seed=t.seed,
        max_length=seq,
        packing=False,
        padding_free=False,
        completion_only_loss=True,
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
        bf16=dtype == "bfloat16",
        fp16=False,
        use_cpu=device.type != "cuda",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        optim="adamw_torch",
    )
    clock = StepClock()
    tok = AutoTokenizer.from_pretrained(str(base))
    tr = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[clock])
    tr.train()
    losses_seen = [h["loss"] for h in tr.state.log_history if "loss" in h]
    out = {
        "tokens_per_s": micro * seq * (len(clock.steps) - 1) / sum(clock.steps[1:]),
        "steps_timed": len(clock.steps) - 1,
        "peak_memory_mb": _peak_mb(device),
        "final_loss": losses_seen[-1] if losses_seen else None,
        "attention": attention,
        "gradient_checkpointing": checkpointing,
    }
    del tr, model
    return out


def bnb_usable(device) -> str | None:
    """None when bitsandbytes can run 4-bit here, else why not."""
    try:
        import bitsandbytes as bnb  # noqa: F401
    except ImportError as e:
        return f"bitsandbytes not importable: {e}"
    if device.type == "cuda":
        try:
            import torch

            bnb.functional.quantize_4bit(torch.randn(64, 64, device=device, dtype=torch.bfloat16), quant_type="nf4")
        except Exception as e:  # noqa: BLE001 - a CPU-only build raises on a CUDA tensor
            return f"bitsandbytes has no CUDA support here: {e}"
    return None


def vllm_teacher(artifacts: Path, prompts_n: int, work: Path) -> dict:
    """The vllm teacher backend on the demo teacher: generation throughput and exact match."""
    from teacher_common import prompts

    from campaign_orchestrator.demo.recipe import resolve
    from campaign_orchestrator.generation.blobstore import LocalStore
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.engines.vllm_engine import VLLMEngine
    from campaign_orchestrator.generation.requests import Sampling, namespace
    from campaign_orchestrator.generation.runner import run_generation

    model_dir = resolve("@demo/teacher", artifacts)
    built = False
    if not (model_dir / "config.json").exists():
        from campaign_orchestrator.demo.build import build_demo_models

        root = work / "artifacts"
        build_demo_models(root, log=lambda _m: None, moe=False)
        model_dir, built = resolve("@demo/teacher", root), True
    rows = prompts(prompts_n)
    backend = VLLMEngine(
        model=str(model_dir),
        identity="bench:vllm",
        extra_args={"gpu_memory_utilization": 0.3, "enforce_eager": False},
    )
    s = Sampling(max_new_tokens=16)
    t0 = time.perf_counter()
    res = run_generation(
        rows,
        backend,
        s,
        GenerationCache(LocalStore(str(work / "gen")), namespace(backend.identity, s), str(work / "spool")),
    )
    wall = time.perf_counter() - t0
    st = res.stats
    correct = sum(r["completion"] == " " + p["reference"] for r, p in zip(res.rows, rows, strict=True))
    return {
        "prompts": prompts_n,
        "wall_s_with_engine_start": round(wall, 2),
        "generate_s": round(st.generate_s, 3),
        "completion_tokens": st.new_completion_tokens,
        "tokens_per_s": round(st.tokens_per_s, 1),
        "rows_per_s": round(st.rows_per_s, 1),
        "exact_match": round(correct / prompts_n, 4),
        "demo_teacher_built_in_run": built,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small config on any device (checks the script)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument(
        "--planned-micro-batch",
        type=int,
        default=None,
        help="the planned section's micro-batch (default: the memory policy's choice for this device; "
        "the MFU goal reads the section)",
    )
    ap.add_argument("--repeats", type=int, default=None, help="rounds of lora / TRL alternation (default 2, --tiny 1)")
    ap.add_argument("--sections", default=None, help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    ap.add_argument("--vllm-prompts", type=int, default=2048)
    ap.add_argument("--artifacts", type=Path, default=REPO / "artifacts", help="where @demo/teacher is looked up")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write the JSON here (as each section starts, what is done so far, partial: true)",
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds: sections that would start later are reported skipped (the run ends on its own, "
        "inside an outer timeout)",
    )
    ap.add_argument(
        "--goal",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"move a goal's target (repeatable; goals: {', '.join(GOALS)})",
    )
    ap.add_argument(
        "--enforce-goals",
        action="store_true",
        help="exit 1 on a missed goal on any device (by default only on a GPU without --tiny)",
    )
    args = ap.parse_args()
    targets = {}
    for g in args.goal:
        name, _, value = g.partition("=")
        try:
            targets[name] = float(value)
        except ValueError:
            ap.error(f"--goal {g!r}: expected NAME=NUMBER")
        if name not in GOALS:
            ap.error(f"--goal {g!r}: unknown goal {name!r}; goals: {', '.join(GOALS)}")
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is the warm-up, left out of the timing)")
    import torch

    if not torch.cuda.is_available() and not args.tiny:
        return _emit({"benchmark": "train_gpu_step", "skipped": "no CUDA device on this machine"}, args.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES["tiny" if args.tiny else "1b"]
    seq = 64 if args.tiny else args.seq
    from train_throughput import flops_per_token

    if device.type == "cuda":
        dtype = "bfloat16"
        peak_flops = matmul_peak_tflops(device, 1024 if args.tiny else 8192) * 1e12
    else:
        from campaign_orchestrator.hardware import measure_cpu_peak, resolve_compute_dtype

        cpu = measure_cpu_peak()
        dtype = resolve_compute_dtype("auto", "cpu", cpu).dtype
        peak_flops = cpu.gflops(dtype) * 1e9
    from transformers.models.llama import modeling_llama

    PLAIN_ROPE[:] = [modeling_llama.apply_rotary_pos_emb]
    t_start = time.perf_counter()
    results: dict = {}
    failed = []
    wanted = set(args.sections.split(",")) if args.sections else set(SECTIONS)
    if wanted - set(SECTIONS):
        ap.error(f"unknown sections {sorted(wanted - set(SECTIONS))}; choose from {SECTIONS}")
    wanted.add("lora")  # every ratio is against it
    repeats = args.repeats or (1 if args.tiny else 2)

    deadline = t_start + args.time_limit if args.time_limit else None

    def out_of_time(name: str) -> bool:
        """Past ``--time-limit``: the section is reported skipped (a round already timed keeps its result)."""
        if deadline is None or time.perf_counter() < deadline:
            return False
        results.setdefault(name, {"skipped": f"--time-limit {args.time_limit:g} s reached before it started"})
        return True

    def snapshot() -> None:  # what is done so far, in --out: a run killed from outside still leaves it
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(
                json.dumps(
                    {
                        "benchmark": "train_gpu_step",
                        "partial": True,
                        "device": str(device),
                        "results": results,
                        "failed": failed,
                        "wall_s": round(time.perf_counter() - t_start, 1),
                    },
                    indent=2,
                )
            )

    def timed(name: str, fn, *a, **kw) -> dict | None:
        snapshot()
        if out_of_time(name):
            return None
        try:
            r = fn(*a, **kw)
        except Exception as e:  # noqa: BLE001 - reported in the JSON; the exit status says it failed
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            failed.append(name)
            return None
        if "trainable" in r:
            r["mfu"] = flops_per_token(base, r["trainable"], seq) * r["tokens_per_s"] / peak_flops
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}

    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        work = Path(tmp)
        policy = None
        if "planned" in wanted:
            try:
                policy = planned_policy(work, shape, seq, dtype, device, args.tiny, args.planned_micro_batch)
            except Exception as e:  # noqa: BLE001
                results["planned"] = {"error": f"memory policy: {type(e).__name__}: {e}"[:2000]}
                failed.append("planned")
        most = max(args.micro, policy.micro_batch_size if policy else 0)
        base, ds = build(work, shape, seq, rows=most * (args.steps + 2))
        why_not_4bit = bnb_usable(device)
        # this trainer's LoRA and TRL alternate, round by round, so other load falls on both alike (best run kept)
        runs: dict[str, list[dict]] = {}
        kernel = None
        for i in range(repeats):
            r = timed("lora", run_one, work, base, ds, f"lora-{i}", False, False, args.micro, args.steps, seq, dtype)
            if r is None:
                break
            runs.setdefault("lora", []).append(r)
            results["lora"] = max(runs["lora"], key=lambda x: x["tokens_per_s"]) | {"runs": len(runs["lora"])}
            kernel = kernel or r["attention"]
            if "trl" not in wanted:
                continue
            for gc_on in (False, True):
                name = f"trl_checkpointing_{'on' if gc_on else 'off'}"
                t = timed(name, trl_run, work, base, ds, args.micro, args.steps, seq, dtype, kernel, device, gc_on)
                if t is not None:
                    runs.setdefault(name, []).append(t)
                    results[name] = max(runs[name], key=lambda x: x["tokens_per_s"]) | {"runs": len(runs[name])}
        for name, rs in runs.items():
            results[name] = max(rs, key=lambda x: x["tokens_per_s"]) | {"runs": len(rs)}

        def lora_section(name: str, qlora: bool, fsdp: bool) -> None:
            if name not in wanted:
                return
            if qlora and why_not_4bit:
                results[name] = {"skipped": why_not_4bit}
                return
            r = timed(
                name, run_one, work, base, ds, name, qlora, fsdp, args.micro, args.steps, seq, dtype, dequant=qlora
            )
            if r is not None:
                results[name] = r
                if "error" in r.get("nf4_dequant", {}):
                    failed.append(f"{name}.nf4_dequant")

        # the sections the goals read come first (a --time-limit skips the last ones)
        lora_section("qlora_nf4", True, False)
        if "bare_loop" in wanted and kernel:
            r = timed("bare_loop", bare_loop, work, base, ds, args.micro, args.steps, seq, dtype, kernel, device)
            if r is not None:
                results["bare_loop"] = r
        if policy is not None:
            r = timed(
                "planned",
                run_one,
                work,
                base,
                ds,
                "planned",
                False,
                False,
                policy.micro_batch_size,
                args.steps,
                seq,
                dtype,
                training={"activation_checkpointing": policy.activation_policy},
            )
            if r is not None:
                results["planned"] = r | {
                    "micro_batch": policy.micro_batch_size,
                    "source": "--planned-micro-batch (activations by the memory policy)"
                    if args.planned_micro_batch
                    else "memory policy" + (f" (--tiny: aimed at {TINY_PLANNED_ROWS} rows)" if args.tiny else ""),
                    "memory_policy": policy.as_dict(),
                }
        snapshot()
        if "kernel_checks" in wanted and not out_of_time("kernel_checks"):
            from training import kernel_checks as checks

            try:
                results["kernel_checks"] = checks.run(device, getattr(torch, dtype))
                failed += [f"kernel_checks.{f}" for f in results["kernel_checks"]["failed"]]
            except Exception as e:  # noqa: BLE001
                results["kernel_checks"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                failed.append("kernel_checks")
        lora_section("fsdp2_lora", False, True)
        lora_section("qlora_fsdp2", True, True)
        if "lora_other_ce" in wanted and "fused" in results.get("lora", {}):
            # the trainer with the other cross-entropy path than lora's (plain logits <-> linear without logits):
            # the same loss (the CPU suite's check of the trainer's hook), and on a GPU what the fused loss pays
            fused_in_lora = results["lora"]["fused"]["cross_entropy"] != "logits"
            r = timed(
                "lora_other_ce",
                run_one,
                work,
                base,
                ds,
                "lora_other_ce",
                False,
                False,
                args.micro,
                args.steps,
                seq,
                dtype,
                fused_loss=not fused_in_lora,
            )
            if r is not None:
                results["lora_other_ce"] = r
        snapshot()
        if "vllm_teacher" not in wanted or out_of_time("vllm_teacher"):
            pass
        else:
            try:
                import vllm  # noqa: F401

                have_vllm = device.type == "cuda"
                why = "vllm needs a CUDA device" if not have_vllm else None
            except ImportError:
                have_vllm, why = False, "vllm is not importable here (pip install '.[vllm]' on the GPU image)"
            if have_vllm:
                try:
                    results["vllm_teacher"] = vllm_teacher(args.artifacts, args.vllm_prompts, work)
                except Exception as e:  # noqa: BLE001
                    results["vllm_teacher"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                    failed.append("vllm_teacher")
            else:
                results["vllm_teacher"] = {"skipped": why}
    ratios, goals = compare(results, big=not args.tiny, targets=targets)
    enforced = args.enforce_goals or (device.type == "cuda" and not args.tiny)
    missed = [k for k, g in goals.items() if g["met"] is False]
    return _emit(
        {
            "benchmark": "train_gpu_step",
            "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "model": "Llama " + ("tiny" if args.tiny else "1.1B (TinyLlama shape)"),
            "compute_dtype": dtype,
            "seq": seq,
            "micro_batch": args.micro,
            "steps": args.steps,
            "matmul_peak_tflops": {
                "dtype": dtype,
                "value": round(peak_flops / 1e12, 4),
                "source": "8192² matmul, this run"
                if device.type == "cuda"
                else "campaign_orchestrator.hardware.measure_cpu_peak",
            },
            "time_limit_s": args.time_limit,
            "planned_micro_batch": policy.micro_batch_size if policy else None,
            "planned_activation_policy": policy.activation_policy if policy else None,
            "repeats": repeats,
            "results": results,
            "ratios": ratios,
            "goals": goals,
            "goals_enforced": enforced,
            "goals_missed": missed,
            "failed": failed,
            "wall_s": round(time.perf_counter() - t_start, 1),
            "versions": _versions(),
        },
        args.out,
        1 if failed or (enforced and missed) else 0,
    )


def _versions() -> dict:
    import importlib.metadata as md

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("transformers", "peft", "trl", "liger-kernel", "bitsandbytes"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def compare(results: dict, big: bool, targets: dict | None = None) -> tuple[dict, dict]:
    """The ratios of one run and the issue's goals on them (``met`` None where a side did not run); ``targets``
    moves goals' targets (``--goal``)."""

    def tps(name):
        return results.get(name, {}).get("tokens_per_s")

    def peak(name):
        return results.get(name, {}).get("peak_memory_mb")

    ours = tps("lora")
    trl_fast = max([x for x in (tps("trl_checkpointing_off"), tps("trl_checkpointing_on")) if x], default=None)
    ratios = {
        "speed_vs_trl_fastest": ours / trl_fast if ours and trl_fast else None,
        "speed_vs_trl_checkpointing_off": ours / tps("trl_checkpointing_off")
        if ours and tps("trl_checkpointing_off")
        else None,
        "speed_vs_trl_checkpointing_on": ours / tps("trl_checkpointing_on")
        if ours and tps("trl_checkpointing_on")
        else None,
        "peak_memory_vs_trl_leanest": peak("lora") / peak("trl_checkpointing_on")
        if peak("lora") and peak("trl_checkpointing_on")
        else None,
        "world_of_one_vs_bare_loop": ours / tps("bare_loop") if ours and tps("bare_loop") else None,
        "fsdp2_vs_world_of_one": tps("fsdp2_lora") / ours if ours and tps("fsdp2_lora") else None,
        "qlora_vs_lora": tps("qlora_nf4") / ours if ours and tps("qlora_nf4") else None,
        "qlora_fsdp2_vs_qlora": tps("qlora_fsdp2") / tps("qlora_nf4")
        if tps("qlora_fsdp2") and tps("qlora_nf4")
        else None,
        "planned_mfu": results.get("planned", {}).get("mfu"),
        "other_ce_vs_lora": tps("lora_other_ce") / ours if ours and tps("lora_other_ce") else None,
        "other_ce_final_loss_rel_diff": abs(results["lora_other_ce"]["final_loss"] - results["lora"]["final_loss"])
        / abs(results["lora"]["final_loss"])
        if "final_loss" in results.get("lora_other_ce", {}) and ours
        else None,
    }
    ratios = {k: round(v, 4) if isinstance(v, float) else v for k, v in ratios.items()}

    targets = {name: target for name, (_, target) in GOALS.items()} | (targets or {})

    def goal(name: str, value, note: str = "") -> dict:
        op, target = GOALS[name][0], targets[name]
        met = None if value is None else bool(value >= target if op == ">=" else value <= target)
        return {"target": f"{op} {target:g}{note}", "value": value, "met": met}

    goals = {name: goal(name, ratios[name]) for name in GOALS if name != "planned_mfu"}
    goals["planned_mfu"] = goal("planned_mfu", ratios["planned_mfu"] if big else None, " (1.1B shape)")
    return ratios, {name: goals[name] for name in GOALS}


def _emit(result: dict, out: Path | None, rc: int = 0) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
