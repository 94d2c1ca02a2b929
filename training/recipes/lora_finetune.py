"""LoRA / QLoRA fine-tuning recipe: supervised fine-tuning and logit distillation under FSDP2.

One class, methods named for the steps of a run (after torchtune's ``lora_finetune_distributed``):
``setup`` (``_setup_data``, ``_setup_model``, ``_setup_optimizer``, ``load_checkpoint``), ``train`` (per step:
``prepare``, ``accumulate`` with ``_loss_step`` per micro-batch, ``_clip``, the optimizer and schedule),
``evaluate``, ``save_checkpoint`` and ``cleanup``. On-policy distillation is its own recipe, a subclass
(``training.recipes.on_policy_distillation``); a mixture-of-experts student is a model-setup concern
(``_setup_model`` attaches ``training.moe.MoeMonitor``).

Features
  * 4-bit NF4 or bf16 base, PEFT LoRA adapters, FSDP2 ``fully_shard`` with a mixed-precision
    policy; topology ``full`` / ``hybrid`` / ``none`` from ``training.sharding``; a world of one trains the
    plain module (nothing to shard); optional activation checkpointing.
  * Exact loss: every optimizer step divides summed token losses by the *global* count of loss
    tokens across ranks and accumulation micro-steps (one all-reduce per step), so the gradient
    equals a single process's gradient on the whole batch. Effective batch = micro × ranks × accumulation.
  * Distillation: cross-entropy on the teacher's text, or forward KL against the teacher's stored
    top-k log-probabilities mixed with cross-entropy (``training.distillation``).
  * Mixture-of-experts students (``training.moe``): LoRA on the fused expert tensors, the trainable
    parameters broken down by kind (a run whose routed experts would stay frozen is refused), the
    router's load-balancing loss per micro-batch weighted by its share of the step's real tokens,
    expert-gradient checks after the first steps, tokens routed to each expert, collapse warnings.
  * Every start is a resume: the newest complete checkpoint (local, or fetched from S3 by global
    rank 0) restores adapter, optimizer, LR schedule, RNG states and the data position (= step).
    Checkpoints are written every N steps, every M minutes, on SIGTERM (preemption) and at the
    end; atomically; the last K are kept.
  * Guards: a non-finite loss or gradient norm stops training before the optimizer step, keeping
    the last good checkpoint; a step whose micro-batches hold no loss token on any rank is counted
    and skipped, never logged as loss 0; every collective has the process-group timeout, so a rank
    that dies makes the others fail within ``training.collective_timeout_s`` instead of hanging.
  * Output: a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``),
    optionally a merged model, ``metrics.parquet`` (one row per step) and ``summary.json``;
    metrics stream through Dagster Pipes from global rank 0.

Raises
  ``TrainingError`` for a configuration, data or numerical problem found before or during training.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from campaign_orchestrator import allocator
from campaign_orchestrator.hardware import resolve_compute_dtype
from campaign_orchestrator.process_memory import peak_rss_mb
from training import checkpoint, data, head, losses, moe, selection
from training.checkpoint import CheckpointStore
from training.config import TrainJob
from training.errors import TrainingError
from training.export import copy_serving_files
from training.kernels import liger, linear_ce
from training.model import (
    attention_kernel,
    build_mesh,
    check_4bit_storage,
    compile_count,
    compile_layers,
    device_for,
    device_memory_gb,
    load_student,
    packed_4bit_checksums,
    shard,
    trainable_parameters,
    verify_sharded_4bit,
)
from training.net import free_port
from training.profiling import RunProfiler
from training.reporting import Reporter
from training.schedule import cosine_with_warmup
from training.sharded import full_tensor
from training.summary import run_summary, write_reproducibility_card
from training.trainer_guards import OutputDirLock, OutputDirLocked

# Batch tensors aligned with ``labels`` position by position (gathered with them by ``head.compact``).
LABEL_ALIGNED = frozenset({"labels", losses.EXAMPLE_WEIGHTS, *losses.TEACHER_KEYS})


def _r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _ensure_dist_env() -> None:
    """Allow ``python -m training`` without torchrun: a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mb()  # this rank's own peak (ru_maxrss would start from its launcher's)


@dataclass
class StepResult:
    """What one optimizer step produced (global figures, identical on every rank)."""

    loss: float
    ce: float | None
    kl: float | None
    grad_norm: float
    loss_tokens: int
    kl_tokens: int
    real_tokens: int
    aux: float | None = None  # MoE: the token-weighted mean load-balancing loss of the step's micro-batches
    reverse_kl: float | None = None  # on-policy: the mean reverse KL(student || teacher) on the sampled tokens

    @classmethod
    def unclipped(cls, loss: float | None, tokens: tuple[int, int, int], **figures) -> StepResult:
        """A step's result as its micro-batches left it: ``tokens`` = (loss, KL, real) token counts; ``grad_norm``
        is filled in once the gradients are clipped. ``figures``: ``ce``, ``kl``, ``aux``, ``reverse_kl``."""
        loss_tokens, kl_tokens, real_tokens = tokens
        return cls(
            loss=loss,
            ce=figures.pop("ce", None),
            kl=figures.pop("kl", None),
            grad_norm=float("nan"),
            loss_tokens=loss_tokens,
            kl_tokens=kl_tokens,
            real_tokens=real_tokens,
            **figures,
        )


class LoraFinetuneRecipe:
    """Supervised fine-tuning (cross-entropy on the teacher's text) and logit distillation (forward KL on the
    teacher's stored top-k log-probabilities mixed with cross-entropy) of a LoRA / QLoRA student.

    ``setup()`` then ``train()`` (which returns the summary), ``cleanup()`` always; :func:`training.recipes.run`
    does the three for a job file."""

    # The LM head and loss at labelled positions only (training.head); False computes them everywhere
    # (benchmarks/train_throughput.py measures both).
    labelled_head = True
    # Recompute the SwiGLU products, the norms' outputs and PEFT's input casts in backward instead of keeping
    # them (exact: training/recompute.py); False keeps what autograd keeps (benchmarks/train_throughput.py
    # measures both).
    recompute_cheap = True
    # FSDP2 even in a world of one: for measurements only (benchmarks/train_gpu_step.py times the sharded path on
    # one GPU against the plain module); a run never wraps a world of one (nothing to shard, only hooks and copies).
    shard_single_process = False
    # torch.compile's backend for `training.compile` (tests on the CPU use aot_eager: the same graph capture and
    # autograd partitioning without inductor's code generation, which takes minutes there).
    compile_backend = "inductor"
    # The cross-entropy from the hidden states and the head's weight, no [tokens x vocab] logits
    # (training.kernels.linear_ce.plan: auto = on CUDA) and Liger's fused RMSNorm/SwiGLU/RoPE (training.kernels.liger:
    # auto = on CUDA with liger_kernel installed); benchmarks/train_gpu_step.py measures both.
    fused_loss: str | bool = "auto"
    liger_kernels: str | bool = "auto"

    def __init__(self, job: TrainJob):
        self.job = job
        self.spec = job.training
        self.out = Path(job.output_dir)
        self.report = Reporter(False)
        self.distill = self.spec.distillation.loss == "logits"
        # training.loss_normalization: example: each example's mean token loss counts once (losses.example_weights)
        self.example_norm = self.spec.loss_normalization == "example"
        self.step_examples = 0  # the step's examples with a loss label, all ranks (prepare)
        self.metrics: list[dict] = []
        self.moe: moe.MoeMonitor | None = None  # set by _setup_model for a mixture-of-experts student
        self.skipped = 0
        self.start_step = 0
        self.resumed_from: int | None = None
        self.eval_loss_before: float | None = None
        self._last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        self._stop_signal: int | None = None
        self._old_sigterm = None
        self._out_lock: OutputDirLock | None = None
        self.selector = None  # training.selection: the best checkpoint by held-out loss (training/selection.py)
        self.compile_auto = None  # training.compile_choice: what `compile: auto` resolved to on a CPU, and why
        self._stopped_at: int | None = None  # early stop: the step at which selection's patience ran out
        self.teacher_alignment: dict | None = None  # rows aligned by byte offsets: what each part of the loss covers

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        _ensure_dist_env()
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        try:  # every rank, before the process group forms: a second job is refused, not hung (trainer_guards)
            self._out_lock = OutputDirLock(self.out, self.rank).acquire()
        except OutputDirLocked as e:
            raise TrainingError(str(e)) from None
        self.device = device_for(
            self.local_rank, self.job.gpu_required, self.spec.allow_cpu_fallback, self.spec.hardware
        )
        if self.job.gpu_required and self.device.type == "cpu":
            print(
                f"training.hardware {self.spec.hardware!r} is a GPU but none is visible: training on the CPU "
                f"(training.allow_cpu_fallback), billed as CPU time at {self.spec.cpu_hardware!r}",
                flush=True,
            )
        if not dist.is_initialized():
            # On GPUs, NCCL moves the model's tensors and gloo the small CPU ones (token counts, flags,
            # checkpoint metadata); every collective carries the timeout, so a dead peer fails the job.
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=self.spec.collective_timeout_s))
        self.is_main = self.rank == 0
        self.report = Reporter(self.is_main)
        if self.world != self.spec.world_size:
            raise TrainingError(
                f"launched with {self.world} processes but the campaign asks for nodes × processes_per_node = "
                f"{self.spec.nodes} × {self.spec.processes_per_node} = {self.spec.world_size}"
            )
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            # a mask inherited blocked (a parent that blocks it while it spawns) would keep the stop from arriving
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
        self.allocator = allocator.in_use()
        self._resolve_compile()
        self._setup_memory_policy()
        self._setup_data()
        self._check_teacher_tokenizer()
        self._setup_model()
        self._setup_optimizer()
        self.store = CheckpointStore(self.out / "checkpoints", self.job.checkpoint_uri, self.spec.checkpoint.keep_last)
        self.load_checkpoint()

    def _setup_memory_policy(self) -> None:
        """What this trainer runs on its device (:meth:`policy_for`; rank 0's choice on every rank): ``auto``
        micro-batch and activation policy resolved by the planner's own call, compile, the activation policy."""
        from campaign_orchestrator.costs.memory_policy import resolved_training

        choice = [self.policy_for(self.device)]
        if self.world > 1:
            dist.broadcast_object_list(choice, src=0)
        self.training_policy = p = choice[0]
        self.memory_policy = p.memory
        if p.memory is not None:
            self.spec = resolved_training(self.spec, p.memory)
        self.compiled = p.compile
        self.activation_policy = p.activation_policy
        self.report.log(f"training policy: {p.describe()}")

    def policy_for(self, device: torch.device):
        """The :class:`~campaign_orchestrator.costs.memory_policy.TrainingPolicy` of this job on ``device``, its
        inputs derived here as the trainer sees them: the device's memory (``training.model.device_memory_gb``),
        the compute dtype it resolves to, the allocator this process runs on, and the job's policy terms (the
        catalog's and the campaign's, as the planner has them); the same call as ``campaign plan``'s."""
        from campaign_orchestrator.costs.memory import ModelShape
        from campaign_orchestrator.costs.memory_policy import DEFAULT_HEADROOM, device_facts, resolve_training_policy

        terms = self.job.policy_terms or {}
        auto = "auto" in (self.spec.micro_batch_size, self.spec.activation_checkpointing)
        facts = device_facts(terms, device.type, device_memory_gb(device), allocator.in_use())
        return resolve_training_policy(
            ModelShape.from_model_dir(Path(self.job.base_model_path)) if auto else None,
            self.job.student,
            self.spec,
            facts,
            compute_dtype=resolve_compute_dtype(self.job.student.quantization.compute_dtype, device.type).dtype,
            headroom=float(terms.get("headroom", DEFAULT_HEADROOM)),
            recompute_available=self.recompute_cheap,
        )

    def _resolve_compile(self) -> None:
        """``training.compile: auto`` on a CPU: compiled where ``training.compile_choice`` measures that compiling pays
        for this run (rank 0 decides, every rank follows); on CUDA ``auto`` keeps ``TrainingSpec.compiling``'s rule."""
        if self.spec.compile != "auto" or self.device.type != "cpu":
            return
        choice = [self._measure_compile() if self.is_main else None]
        if self.world > 1:
            dist.broadcast_object_list(choice, src=0)
        self.compile_auto = choice[0]
        self.spec = self.spec.model_copy(update={"compile": self.compile_auto.compile})
        self.report.log(f"compile auto -> {'on' if self.compile_auto.compile else 'off'}: {self.compile_auto.why}")

    def _measure_compile(self):
        """:func:`training.compile_choice.choose` for this run: micro-steps per rank over the whole run (with
        ``epochs``, from the dataset's row count) of ``micro_batch_size × max_seq_len`` tokens (an ``auto`` micro-batch
        counts as one row: the run's work is then underestimated, never over)."""
        from transformers import AutoConfig

        from training import compile_choice

        spec, student = self.spec, self.job.student
        unmeasured = None
        if student.quantization.load_in_4bit:
            unmeasured = "a 4-bit base is not measured (the probe builds plain layers): eager"
        elif spec.distillation.loss == "on_policy":
            unmeasured = "on-policy distillation samples with the same layers, which the probe does not time: eager"
        if unmeasured:
            return compile_choice.CompileChoice(False, unmeasured, 0, 0, 0, {}, False)
        micro = spec.micro_batch_size if isinstance(spec.micro_batch_size, int) else 1
        steps = spec.max_steps
        if steps is None:
            import pyarrow.parquet as pq

            rows = sum(pq.ParquetFile(f).metadata.num_rows for f in data.parquet_files(self.job.dataset_path))
            steps = max(1, math.ceil(spec.epochs * rows / (micro * self.world * spec.gradient_accumulation_steps)))
        dtype = getattr(torch, resolve_compute_dtype(student.quantization.compute_dtype, "cpu").dtype)
        return compile_choice.choose(
            AutoConfig.from_pretrained(self.job.base_model_path),
            student,
            dtype,
            tokens=micro * spec.max_seq_len,
            micro_steps=steps * spec.gradient_accumulation_steps,
        )

    def _on_sigterm(self, signum, _frame) -> None:
        self._stop_signal = signum

    def _setup_data(self) -> None:
        from campaign_orchestrator.dataset.tokenizer_files import tokenizer_hash

        model_hash = tokenizer_hash(self.job.base_model_path)
        try:
            data.check_tokenizer(
                data.dataset_tokenizer_hash(self.job.dataset_path),
                model_hash,
                self.job.dataset_path,
                self.job.base_model_path,
            )
        except data.DatasetMismatch as e:
            raise TrainingError(str(e)) from e
        self.rows = data.load_rows(self.job.dataset_path)
        self.eval_data, self.eval_source = self._validation_rows(model_hash)
        n = len(self.rows["input_ids"])
        if self.distill:
            self.teacher = self._load_teacher_topk()
        self._fit_auto_micro_batch(n)
        self.plan = data.BatchPlan(
            n, self.spec.micro_batch_size, self.world, self.spec.gradient_accumulation_steps, self.spec.seed
        )
        if n < self.plan.rows_per_step:
            raise TrainingError(
                f"{n} training rows but one optimizer step needs micro_batch_size × world × accumulation = "
                f"{self.plan.rows_per_step}; lower the batch settings or add data"
            )
        if self.spec.max_steps is not None:
            self.total_steps = self.spec.max_steps
        else:
            self.total_steps = max(1, math.ceil(self.spec.epochs * n / self.plan.rows_per_step))
        from transformers import AutoConfig

        self.pad_id = AutoConfig.from_pretrained(self.job.base_model_path).pad_token_id or 0
        per_rank = min(self.spec.eval_rows, len(self.eval_data["input_ids"])) // self.world
        self.eval_rows = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(self.world)]

    def _fit_auto_micro_batch(self, rows: int) -> None:
        """An ``auto`` micro-batch larger than the dataset allows (one step: micro × world × accumulation rows)
        shrinks to what the rows fill (``costs.memory_policy.fit_micro_batch``, as the adapter's key has it)."""
        from campaign_orchestrator.costs.memory_policy import fit_micro_batch

        p = fit_micro_batch(self.training_policy, rows, self.world, self.spec.gradient_accumulation_steps)
        if p.micro_batch_size != self.spec.micro_batch_size:
            self.report.log(
                f"memory policy: micro-batch {self.spec.micro_batch_size} lowered to {p.micro_batch_size}, "
                f"what {rows} rows fill"
            )
            self.training_policy, self.memory_policy = p, p.memory
            self.spec = self.spec.model_copy(update={"micro_batch_size": p.micro_batch_size})

    def _validation_rows(self, model_hash: str):
        """The eval-loss rows: the validation split when the dataset has one, else the training rows."""
        path = self.job.validation_path
        if not path or not any(Path(path).glob("*.parquet")):
            return self.rows, "train (the dataset has no validation split)"
        try:
            data.check_tokenizer(data.dataset_tokenizer_hash(path), model_hash, path, self.job.base_model_path)
        except data.DatasetMismatch as e:
            raise TrainingError(str(e)) from e
        val = data.load_rows(path)
        if len(val["input_ids"]) < self.world:
            return self.rows, f"train (the validation split has {len(val['input_ids'])} rows for {self.world} ranks)"
        return val, "validation"

    def _load_teacher_topk(self) -> dict[str, Any]:
        """The teacher's top-k columns as Arrow arrays (compact buffers, decoded per batch by ``take``); from a
        teacher of another tokenizer also its alignment columns (``self.teacher_alignment``: what each part of the
        loss covers over the training rows, for the summary)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        files = data.parquet_files(self.job.dataset_path)
        xtok = all(losses.TEACHER_ALIGN in pq.read_schema(f).names for f in files)
        cols = [losses.TEACHER_IDS, losses.TEACHER_LOGPROBS]
        cols += [losses.TEACHER_ALIGN, losses.TEACHER_SPAN] if xtok else []
        parts: dict[str, list] = {c: [] for c in [*cols, "labels"]}
        for f in files:
            names = pq.read_schema(f).names
            if not all(c in names for c in cols):
                raise TrainingError(
                    f"training.distillation.loss is 'logits' but {f} has no {cols} columns; the tokenized rows must "
                    f"carry the teacher's top-k log-probabilities aligned with input_ids (the tokenized_dataset stage "
                    f"writes them when the distillation set has top_logprobs: set teacher.sampling.logprobs; see "
                    f"campaign_orchestrator.dataset.topk), or use loss 'sequence'"
                )
            t = pq.read_table(f, columns=[*cols, "labels"] if xtok else cols, memory_map=True)
            for c in t.column_names:
                parts[c] += t.column(c).chunks
        if xtok:
            from campaign_orchestrator.dataset.xtok import alignment_report

            labels = pa.chunked_array(parts["labels"])
            self.teacher_alignment = alignment_report(pa.chunked_array(parts[losses.TEACHER_ALIGN]), labels)
        return {c: pa.chunked_array(parts[c]) for c in cols}

    @property
    def compares_teacher_tokens(self) -> bool:
        """Whether the loss compares the teacher's and the student's token ids (one vocabulary needed): not from
        rows aligned by byte offsets (a teacher of another tokenizer, campaign_orchestrator.dataset.xtok)."""
        return self.distill and self.teacher_alignment is None

    def _check_teacher_tokenizer(self) -> None:
        """Logit and on-policy distillation compare token ids: teacher and student must share one vocabulary."""
        if not self.compares_teacher_tokens:
            return
        loss = self.spec.distillation.loss
        path = self.job.teacher_tokenizer_path
        if not path:
            raise TrainingError(
                f"training.distillation.loss is '{loss}' but the teacher's tokenizer is unknown; for a remote teacher "
                "set training.distillation.teacher_tokenizer to a directory holding it"
            )
        from transformers import AutoTokenizer

        try:
            teacher = AutoTokenizer.from_pretrained(path).get_vocab()
        except Exception as e:  # noqa: BLE001 - any load failure is a configuration error here
            raise TrainingError(f"could not load the teacher tokenizer from {path}: {e}") from e
        student = AutoTokenizer.from_pretrained(self.job.base_model_path).get_vocab()
        if teacher != student:
            diff = sorted(set(teacher.items()) ^ set(student.items()), key=str)[:5]
            raise TrainingError(
                f"{loss} distillation needs a teacher that shares the student's tokenizer, but the teacher's ({path}, "
                f"{len(teacher)} tokens) differs from the student's ({self.job.base_model_path}, {len(student)} "
                f"tokens), e.g. {diff}; use training.distillation.loss 'sequence' or a teacher of the same family"
            )

    def _setup_model(self) -> None:
        torch.manual_seed(self.spec.seed)  # identical LoRA init on every rank
        self.precision = resolve_compute_dtype(self.job.student.quantization.compute_dtype, self.device.type)
        self.compute_dtype = getattr(torch, self.precision.dtype)
        self.report.log(f"compute dtype {self.precision.dtype} ({self.precision.requested}: {self.precision.reason})")
        if self.precision.warning:
            self.report.log(f"WARNING: {self.precision.warning}")
        self.attn_implementation = self._attention_kernel()
        model = load_student(
            self.job.base_model_path,
            self.job.student,
            self.device,
            activation_checkpointing=self.activation_policy == "full",
            attn_implementation=self.attn_implementation,
            compute_dtype=self.precision.dtype,
            recompute_cheap=self.activation_policy == "recompute",
        )
        self.liger_applied = liger.apply(model, self.device, self.liger_kernels)  # before sharding: patches modules
        self.compiled_layers = compile_layers(model, self.compile_backend) if self.compiled else 0
        self.trainable = sum(p.numel() for p in trainable_parameters(model))
        self.total_params = sum(p.numel() for p in model.parameters())
        self.param_breakdown = moe.parameter_breakdown(model)  # by kind; refuses routed experts left frozen
        moe.refuse_frozen_experts(self.param_breakdown, self.job.student, self.job.base_model_path)
        if self.world > 1 or self.shard_single_process:
            if self.job.student.quantization.load_in_4bit:
                try:  # FSDP2 moves the packed words as compute-dtype values
                    check_4bit_storage(model, self.compute_dtype)
                except ValueError as e:
                    raise TrainingError(str(e)) from e
            before = packed_4bit_checksums(model)
            self.mesh = build_mesh(self.spec, self.device)
            self.model = shard(model, self.mesh, self.compute_dtype, self.spec.resharding_after_forward)
            try:
                checked = verify_sharded_4bit(self.model, before)
            except ValueError as e:
                raise TrainingError(str(e)) from e
            if checked:
                self.report.log(f"verified {checked} sharded 4-bit weights bit-identical after all-gather")
        else:
            # Nothing to shard in a world of one: FSDP2 would only add per-unit hooks and copies. The
            # numerics are those of the sharded path (base units in the compute dtype, LoRA in fp32).
            self.mesh, self.model = None, model
        self.model.train()
        # the fused kernel sums per token without weights: example normalization runs the cross-entropy on the logits
        self.fused_ce = (
            None if self.example_norm else linear_ce.plan(self.model, self.device, self.distill, self.fused_loss)
        )
        self.report.log(
            f"fused kernels: {', '.join(self.liger_applied) or 'none'} (Liger); cross-entropy "
            f"{self.fused_ce.kind + ' linear' if self.fused_ce else 'on logits'}"
            f"{', each example weighted once (loss_normalization: example)' if self.example_norm else ''}"
        )
        self.named_trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.moe = moe.MoeMonitor.attach(
            self.model, self.job.student, self.param_breakdown, self.report.log, self.world, self.compute_dtype
        )
        torch.manual_seed(self.spec.seed + 1 + self.rank)  # dropout differs per rank
        random.seed(self.spec.seed + 1 + self.rank)

    def _attention_kernel(self) -> str:
        """``auto``: the kernel measured fastest at this run's micro-batch shape (training.attention), rank 0's
        choice on every rank."""
        shape = None
        if self.job.student.attn_implementation == "auto" and self.rows is not None:
            from transformers import AutoConfig

            from training.attention import batch_shape

            row_tokens, seq_len = batch_shape(self.rows, self.spec.micro_batch_size)
            shape = {
                "config": AutoConfig.from_pretrained(self.job.base_model_path),
                "row_tokens": row_tokens,
                "seq_len": seq_len,
                "dtype": self.compute_dtype,
            }
        kernel = [attention_kernel(self.job.student, self.device, self.spec.max_seq_len, shape)]
        if self.world > 1:
            dist.broadcast_object_list(kernel, src=0)
        return kernel[0]

    def _setup_optimizer(self) -> None:
        params = [p for _, p in self.named_trainable]
        # foreach: one multi-tensor kernel per Adam op instead of one per parameter (CPU included).
        self.optimizer = torch.optim.AdamW(
            params, lr=self.spec.learning_rate, weight_decay=self.spec.weight_decay, foreach=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(self.spec.warmup_steps, self.total_steps)
        )

    # ------------------------------------------------------------------ batches and steps
    def _batch(self, idx: list[int]) -> dict[str, torch.Tensor]:
        batch = data.collate(self.rows, idx, self.pad_id)
        if self.distill:
            batch |= losses.teacher_batch(self.teacher, idx, tuple(batch["input_ids"].shape))
        if self.moe is not None:
            batch[moe.MASK] = moe.token_mask(batch, [len(self.rows["input_ids"][i]) for i in idx])
        return batch

    @staticmethod
    def _kl_token_count(batch: dict[str, torch.Tensor]) -> int:
        return losses.distill_token_count(batch)

    def _scored(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """With ``labelled_head``, the batch the LM head and loss see at the labelled positions only
        (``training.head``: ``logits_to_keep`` and the label-aligned tensors gathered to match)."""
        if not self.labelled_head:
            return batch
        keep, batch = head.compact(batch, LABEL_ALIGNED)
        return batch | {"logits_to_keep": keep}

    def _forward(self, batch: dict[str, torch.Tensor], fused: linear_ce.FusedHead | None = None):
        """The logits, or with ``fused`` the cross-entropy sums its kernel computes in place of the LM head."""
        skip = data.NON_MODEL_KEYS | losses.TEACHER_KEYS | moe.BATCH_KEYS | {losses.EXAMPLE_WEIGHTS}
        inputs = {k: v for k, v in batch.items() if k not in skip}
        inputs["use_cache"] = False  # training never reuses a KV cache; building one costs time and memory
        if fused is not None:
            return fused.loss_sums(self.model, inputs, batch["labels"])
        return self.model(**inputs).logits

    def _loss_step(
        self, batch: dict[str, torch.Tensor], ce_tokens: int, kl_tokens: int, real_tokens: int = 0
    ) -> tuple[float, float, float]:
        """Forward + backward of one micro-batch against global token counts; returns its (CE, KL) sums and,
        for a MoE, its load-balancing loss times its real tokens (``real_tokens``: the step's, global)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if self.moe is not None:
            self.moe.begin()
        batch = self._scored(batch)  # example weights (prepare) are gathered with the labels
        if self.fused_ce is not None:  # no [tokens x vocab] logits (training.kernels.linear_ce)
            sums = self._forward(batch, self.fused_ce)
        elif self.example_norm:  # ce_tokens is then the step's example count (accumulate)
            w = batch[losses.EXAMPLE_WEIGHTS]
            sums = {"ce_sum": losses.weighted_cross_entropy_sum(self._forward(batch), batch["labels"], w)}
        else:
            sums = losses.loss_sums(self._forward(batch), batch, self.distill)
        w = self.spec.distillation.kl_weight if self.distill else 0.0
        loss = losses.mix(sums["ce_sum"], ce_tokens, sums.get("kl_sum"), kl_tokens, w)
        aux = 0.0
        if self.moe is not None:  # + coef · aux_micro · real_micro / real_step (global): a token-weighted mean
            term, aux = self.moe.end(batch[moe.MASK], real_tokens)
            loss = loss + term if term is not None else loss
        # FSDP averages gradients over the data-parallel ranks; scale by world so the sum is exact.
        # Every rank runs backward, even on a micro-batch without loss tokens (FSDP's collectives need it).
        (loss * self.world).backward()
        return float(sums["ce_sum"].detach()), float(sums["kl_sum"].detach()) if self.distill else 0.0, aux

    def _all_reduce(self, t: torch.Tensor) -> None:
        if self.world > 1:  # a world of one has nothing to add
            dist.all_reduce(t)

    def _set_grad_sync(self, enabled: bool) -> None:
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(enabled)

    def prepare(self, step: int, control: tuple[float, ...] = ()) -> tuple[list[dict], list[int], list[float]]:
        """This rank's micro-batches of global ``step`` and the step's global token counts.

        One all-reduce carries [loss tokens, KL tokens, real tokens] and the ``control`` values
        (checkpoint due, stop requested), whose global sums come back as the third result.
        """
        batches = [self._batch(idx) for idx in self.plan.step_rows(step, self.rank)]
        counts = torch.tensor(
            [
                sum(data.loss_token_count(b) for b in batches),
                sum(self._kl_token_count(b) for b in batches),
                sum(data.real_token_count(b) for b in batches),
                sum(self._weigh_examples(b) for b in batches),
                *control,
            ],
            dtype=torch.float64,
        )
        self._all_reduce(counts)
        self.step_examples = int(counts[3])
        return batches, [int(c) for c in counts[:3].tolist()], counts[4:].tolist()

    def _weigh_examples(self, batch: dict[str, torch.Tensor]) -> int:
        """``loss_normalization: example``: ``batch``'s per-label example weights, added to it once here (the loss
        step reads them), and its number of examples with a loss label; 0 and nothing added otherwise."""
        if not self.example_norm:
            return 0
        batch[losses.EXAMPLE_WEIGHTS], n = losses.example_weights(batch["labels"], batch["position_ids"])
        return n

    def accumulate(self, batches: list[dict], counts: list[int]) -> StepResult | None:
        """Forward/backward every micro-batch with exact global normalization; gradients are then final.

        Returns ``None`` for a step whose micro-batches hold no loss token on any rank (nothing to
        learn; the caller counts and skips it).
        """
        ce_tokens, kl_tokens, real_tokens = counts
        if ce_tokens == 0 and kl_tokens == 0:
            return None
        ce_norm = self.step_examples if self.example_norm else ce_tokens  # the mean over examples, or over tokens
        sums = self.step_sums(batches, lambda b: self._loss_step(b, ce_norm, kl_tokens, real_tokens))
        ce = float(sums[0]) / ce_norm if ce_norm else None
        kl = float(sums[1]) / kl_tokens if (self.distill and kl_tokens) else None
        w = self.spec.distillation.kl_weight if self.distill else 0.0
        loss = (1 - w) * (ce or 0.0) + w * (kl or 0.0) if self.distill else ce
        aux = None
        if self.moe is not None:
            self.moe.check_gradients()  # the first steps: expert LoRA gradients are non-zero (collective)
            if self.moe.aux_fn is not None:
                aux = float(sums[2]) / real_tokens
                loss = (loss or 0.0) + self.job.student.moe.aux_loss_coef * aux
        return StepResult.unclipped(loss, (ce_tokens, kl_tokens, real_tokens), ce=ce, kl=kl, aux=aux)

    def step_sums(self, batches: list[dict], loss_step) -> torch.Tensor:
        """``loss_step(batch)`` (forward and backward of one micro-batch, returning its loss sums) on each of this
        rank's micro-batches, gradients reduced once, after the last; the sums added up in order and all-reduced over
        the ranks (float64: the step's global sums, the same on every rank)."""
        total: list[float] = []
        for i, b in enumerate(batches):
            self._set_grad_sync(i == len(batches) - 1)  # reduce gradients once, after the last micro-batch
            part = loss_step(b)
            total = [t + x for t, x in zip(total or [0.0] * len(part), part, strict=True)]
        sums = torch.tensor(total, dtype=torch.float64)
        self._all_reduce(sums)
        return sums

    def _clip(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in self.named_trainable], self.spec.max_grad_norm)
        return float(full_tensor(norm))

    def _describe_step_rows(self, step: int) -> str:
        rows = [
            i for a in range(self.plan.accumulation) for r in range(self.world) for i in self.plan.step_rows(step, r)[a]
        ]
        return f"dataset rows {rows[:16]}{' …' if len(rows) > 16 else ''}"

    # ------------------------------------------------------------------ the step's parts (a recipe overrides them)
    def _prepare_step(
        self, step: int, control: tuple[float, ...], t0: float
    ) -> tuple[list[dict], list[int], list[float], float]:
        """This rank's micro-batches of ``step``, the step's global counts and control sums (:meth:`prepare`), and
        when the step's own time starts (``t0`` unless the batches took work that is not training)."""
        return *self.prepare(step, control), t0

    def _accumulate_step(self, step: int, batches: list[dict], counts: list[int]) -> StepResult | None:
        """Forward and backward of the step's micro-batches (:meth:`accumulate`)."""
        return self.accumulate(batches, counts)

    def _step_metrics(self, step: int, result: StepResult) -> dict:
        """Columns of the step's metrics row beyond the common ones."""
        return {"aux_loss": result.aux} if self.moe is not None else {}

    def _step_note(self, step: int, result: StepResult) -> str:
        """What the step's log line adds after tokens/s."""
        return ""

    def _end_step(self, step: int) -> None:
        """After the optimizer step (or a skipped step), before the step's checkpoint."""

    def _before_final_checkpoint(self) -> None:
        """After the last step, before the final checkpoint."""

    def train(self) -> dict:
        spec = self.spec
        self.report.log(
            f"training {self.job.campaign}: steps {self.start_step}→{self.total_steps}, world {self.world} "
            f"({spec.nodes} node(s) × {spec.processes_per_node}), sharding "
            f"{spec.sharding if self.world > 1 else 'none (one process)'}, effective batch "
            f"{spec.micro_batch_size} × {self.world} × {spec.gradient_accumulation_steps} = {spec.effective_batch}, "
            f"loss {spec.distillation.loss}, attention {self.attn_implementation}, "
            f"trainable {self.trainable:,} of {self.total_params:,} parameters"
            + (f"; resumed from checkpoint step {self.resumed_from}" if self.resumed_from is not None else "")
        )
        if self.start_step == 0 and self.eval_loss_before is None:
            self.eval_loss_before = self.evaluate()
        every_s = spec.checkpoint.every_minutes * 60 if spec.checkpoint.every_minutes else None
        stop = self.total_steps if self.job.stop_at_step is None else min(self.job.stop_at_step, self.total_steps)
        t_start, cpu_start = time.perf_counter(), time.process_time()
        with RunProfiler(spec, self.out, self.report.log) as prof:
            for step in range(self.start_step, stop):
                t0 = time.perf_counter()
                compiled_before = compile_count() if self.compiled else 0
                due = float(self.is_main and every_s is not None and time.monotonic() - self._last_save_time >= every_s)
                control = (due, float(self._stop_signal is not None))
                batches, counts, (due_all, stop_all), t0 = self._prepare_step(step, control, t0)
                if due_all or stop_all:  # the state after `step` completed steps, before any forward of this one
                    self.save_checkpoint(step, reason="preempted" if stop_all else "time")
                    if stop_all:
                        raise TrainingError(
                            f"stopped by SIGTERM before step {step + 1}; checkpoint {self.store.path(step)} written, "
                            f"a relaunch resumes from it"
                        )
                result = self._accumulate_step(step, batches, counts)
                if result is None:
                    self.skipped += 1
                    self.report.log(
                        f"step {step + 1}: no loss token in any micro-batch on any rank "
                        f"({self._describe_step_rows(step)}); skipped, not logged as loss 0"
                    )
                    self.scheduler.step()
                    self._end_step(step)
                    self._maybe_checkpoint(step + 1)
                    continue
                result.grad_norm = self._clip()
                if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
                    last = self._last_saved_step
                    raise TrainingError(
                        f"step {step + 1}: non-finite loss {result.loss} or gradient norm {result.grad_norm} "
                        f"({self._describe_step_rows(step)}); stopped before the optimizer step. Last good checkpoint: "
                        + (f"{self.store.path(last)}" if last is not None else "none")
                        + ". A relaunch resumes there and meets the same batch: lower training.learning_rate, check "
                        "the data, or use compute_dtype float32"
                    )
                lr = self.scheduler.get_last_lr()[0]
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                row = {
                    "step": step + 1,
                    "loss": result.loss,
                    "ce_loss": result.ce,
                    "kl_loss": result.kl,
                    "lr": lr,
                    "grad_norm": result.grad_norm,
                    "loss_tokens": result.loss_tokens,
                    "tokens": result.real_tokens,
                    "tokens_per_s": result.real_tokens / dt,
                    "step_s": dt,
                    "peak_memory_mb": _peak_memory_mb(self.device),
                } | self._step_metrics(step, result)
                if self.compiled:  # a step that compiled graphs is warm-up, reported apart from the timed steps
                    row["compiling"] = compile_count() > compiled_before
                self.metrics.append(row)
                if self.is_main and (
                    (step + 1) % spec.log_every == 0 or step == self.start_step or step + 1 == self.total_steps
                ):
                    self.report.log(
                        f"step {step + 1}/{self.total_steps} loss {result.loss:.4f} lr {lr:.2e} "
                        f"grad_norm {result.grad_norm:.3f} tokens/s {row['tokens_per_s']:.0f}"
                        + self._step_note(step, result)
                    )
                    self.report.metrics(row)
                self._end_step(step)
                self._maybe_checkpoint(step + 1)
                if self.moe is not None:  # collective, at the same steps on every rank
                    self.moe.log_routing(step + 1, force=step + 1 == self.total_steps, every=spec.log_every)
                prof.step()
                if self._stopped_at:  # training.selection.patience: no improvement for N evaluations
                    break
        seconds, self.cpu_seconds = time.perf_counter() - t_start, time.process_time() - cpu_start
        prof.finish()
        if stop < self.total_steps:
            return self._finish_rung(stop, seconds)
        self._before_final_checkpoint()
        self.save_checkpoint(self._stopped_at or self.total_steps, reason="final")
        return self._finish(seconds)

    def _finish_rung(self, stop: int, seconds: float) -> dict:
        """A sweep rung ends: checkpoint at ``stop`` (the next rung resumes there), eval loss, a short summary."""
        self.save_checkpoint(stop, reason="rung")
        eval_loss = self.evaluate()
        if not self.is_main:
            return {}
        new = [r for r in self.metrics if self.resumed_from is None or r["step"] > self.resumed_from]
        checkpoint.write_metrics(self.metrics, self.out / "metrics.parquet")
        summary = {
            "rung": True,
            "steps": stop,
            "total_steps": self.total_steps,
            "trained_steps": len(new),
            "resumed_from_step": self.resumed_from,
            "eval_loss_before": self.eval_loss_before,
            "eval_loss": eval_loss,
            "eval_source": self.eval_source,
            "train_seconds": seconds,
            "final_loss": self.metrics[-1]["loss"] if self.metrics else None,
            "tokens": sum(r["tokens"] for r in new),
            "device": self.device.type,
            "world_size": self.world,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.report.log(
            f"rung done at step {stop}/{self.total_steps} ({len(new)} steps trained here, resumed from "
            f"{self.resumed_from}): eval loss ({self.eval_source}) {_r4(eval_loss)}"
        )
        return summary

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, rows: list[list[int]] | None = None) -> float | None:
        """Mean token cross-entropy on the first ``eval_rows`` rows of the validation split (the training
        rows when there is none), in eval mode (no dropout); ``rows``: other rows of it, per rank."""
        mine = (self.eval_rows if rows is None else rows)[self.rank]
        if not mine:
            return None
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        bs = self.spec.micro_batch_size
        for i in range(0, len(mine), bs):
            batch = {
                k: v.to(self.device) for k, v in data.collate(self.eval_data, mine[i : i + bs], self.pad_id).items()
            }
            batch = self._scored(batch)
            s, n = losses.cross_entropy_sum(self._forward(batch), batch["labels"])
            total += torch.tensor([float(s), n], dtype=torch.float64)
        self.model.train()
        self._all_reduce(total)
        return float(total[0] / total[1]) if total[1] else None

    # ------------------------------------------------------------------ checkpoints
    def _maybe_checkpoint(self, completed: int) -> None:
        every = self.spec.checkpoint.every_steps
        if every and completed % every == 0 and completed < self.total_steps:
            self.save_checkpoint(completed, reason="step")
        self._select(completed)

    def _select(self, completed: int) -> None:
        """``training.selection``: held-out task and replay loss every ``every_steps``; the best checkpoint's adapter
        is copied to ``<out>/best_adapter`` (the rule: training/selection.py)."""
        sel = self.spec.selection
        if sel.rule != "best_heldout_loss" or (completed % sel.every_steps and completed != self.total_steps):
            return
        if self.selector is None:
            import pyarrow.parquet as pq

            self.selector = selection.Selector(sel.replay_weight, sel.min_delta, sel.patience)
            src = self.job.validation_path if self.eval_source == "validation" else self.job.dataset_path
            ids = [
                x
                for f in data.parquet_files(src)
                for x in pq.read_table(f, columns=["example_ids"]).column("example_ids").to_pylist()
            ]
            split = selection.split_rows(ids)
            self.selection_rows = {}
            for kind, idx in split.items():
                per_rank = min(self.spec.eval_rows, len(idx)) // self.world
                self.selection_rows[kind] = [idx[r * per_rank : (r + 1) * per_rank] for r in range(self.world)]
        task, replay = self.evaluate(self.selection_rows["task"]), self.evaluate(self.selection_rows["replay"])
        self.save_checkpoint(completed, reason="selection")
        if self.selector.observe(completed, task, replay) and self.is_main:
            best = self.out / "best_adapter"
            shutil.rmtree(best, ignore_errors=True)
            shutil.copytree(self.store.path(completed), best)
        if self.is_main:
            self.report.log(
                f"step {completed}: held-out loss task {_r4(task)}, replay {_r4(replay)}; kept step "
                f"{self.selector.best.step if self.selector.best else None}"
            )
        if self.selector.should_stop:
            self._stopped_at = completed

    def _trainer_state(self, step: int) -> dict:
        return {
            "step": step,
            "skipped_steps": self.skipped,
            "rows_per_step": self.plan.rows_per_step,
            "dataset_rows": self.plan.rows,
            "seed": self.spec.seed,
            "world_size": self.world,
            "total_steps": self.total_steps,
            "eval_loss_before": self.eval_loss_before,
            "scheduler": self.scheduler.state_dict(),
            "saved_at": time.time(),
            "moe": self.moe.state() if self.moe is not None else None,  # collective: routed-token counts so far
            "on_policy": None,
        }

    def save_checkpoint(self, step: int, reason: str) -> None:
        """Collective: gather full adapter and optimizer state on rank 0, write atomically, mirror, prune."""
        if step == self._last_saved_step:
            return
        saved = checkpoint.save_training_state(
            self.store,
            step,
            self.model.peft_config["default"],
            self.named_trainable,
            self.optimizer,
            self._trainer_state(step),
            self.metrics,
            self.is_main,
            self.world,
        )
        if self.is_main:
            self.report.log(
                f"checkpoint {step} ({reason}) at {saved}"
                + (f", mirrored to {self.store.remote_uri}" if self.store.remote_uri else "")
            )
        self._last_saved_step = step
        self._last_save_time = time.monotonic()

    def load_checkpoint(self) -> None:
        """Resume from the newest complete checkpoint, if any (every start is a resume)."""
        restored = checkpoint.load_training_state(
            self.store,
            self.named_trainable,
            self.optimizer,
            self.scheduler,
            self.is_main,
            self.rank,
            self.world,
            expect={"rows_per_step": self.plan.rows_per_step, "dataset_rows": self.plan.rows, "seed": self.spec.seed},
        )
        if restored is None:
            return
        step, state, metrics = restored
        if self.is_main:
            self.metrics = metrics
        self.skipped = state["skipped_steps"]
        self.eval_loss_before = state.get("eval_loss_before")
        self._restore_state(state)
        self.start_step = self.resumed_from = step
        self._last_saved_step = step
        self.report.log(f"resumed from checkpoint {self.store.path(step)} (step {step} of {self.total_steps})")

    def _restore_state(self, state: dict) -> None:
        """What a resumed checkpoint's trainer state restores beyond step, skipped steps and eval loss."""
        if self.moe is not None:
            self.moe.load_state(state.get("moe"), self.is_main)

    # ------------------------------------------------------------------ output
    def _finish(self, seconds: float) -> dict:
        eval_loss = self.evaluate()
        moe_report = self.moe.final_report() if self.moe is not None else None  # collective
        adapter_dir = self.out / "adapter"
        if not self.is_main:
            return {}
        last = self._stopped_at or self.total_steps
        # training.selection: the kept checkpoint, not the last
        ckpt = self.out / "best_adapter" if self.selector is not None and self.selector.best else self.store.path(last)
        shutil.rmtree(adapter_dir, ignore_errors=True)
        adapter_dir.mkdir(parents=True)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy2(ckpt / name, adapter_dir / name)
        copy_serving_files(Path(self.job.base_model_path), adapter_dir)
        write_reproducibility_card(self, adapter_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        checkpoint.write_metrics(self.metrics, self.out / "metrics.parquet")
        merged = None
        if self.spec.export_merged:
            from training.export import export_merged

            merged = export_merged(self.job.base_model_path, adapter_dir, self.out / "merged", self.compute_dtype)
        summary = run_summary(self, seconds, eval_loss, adapter_dir, ckpt, merged)
        if self.selector is not None:
            summary["selection"] = self.selector.summary(last)
        if moe_report is not None:
            summary["moe"] = moe_report
        summary |= self._summary_extras()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.report.materialization({k: v for k, v in summary.items() if v is not None})
        self.report.log(
            f"done: {len(self.metrics)} steps ({self.skipped} skipped) in {seconds:.1f}s, loss "
            f"{summary['first_loss'] if summary['first_loss'] is None else round(summary['first_loss'], 4)} → "
            f"{summary['final_loss'] if summary['final_loss'] is None else round(summary['final_loss'], 4)}, "
            f"eval loss ({self.eval_source}) {_r4(self.eval_loss_before)} → {_r4(eval_loss)}, adapter at {adapter_dir}"
        )
        return summary

    def _summary_extras(self) -> dict:
        """Sections of ``summary.json`` beyond training/summary.py's (global rank 0): the activation policy and
        memory policy used, FSDP2's resharding, and torch.compile's warm-up apart from the timed steps."""
        return {
            "activation_policy": self.activation_policy,
            "memory_policy": self.memory_policy.as_dict() if self.memory_policy is not None else None,
            "training_policy": self.training_policy.as_dict(),
            "reshard_after_forward": self.spec.resharding_after_forward if self.mesh is not None else None,
            "compile": self._compile_report(),
            "fused_cross_entropy": self.fused_ce.report() if self.fused_ce is not None else None,
        }

    def _compile_report(self) -> dict:
        auto = {"auto": self.compile_auto.as_dict()} if self.compile_auto is not None else {}
        if not self.compiled:
            return {"enabled": False} | auto
        new = [r for r in self.metrics if self.resumed_from is None or r["step"] > self.resumed_from]
        warm = [r for r in new if r.get("compiling")]
        timed = [r for r in new if not r.get("compiling")]
        seconds = sum(r["step_s"] for r in timed)
        return {
            "enabled": True,
            "layers": self.compiled_layers,
            "warmup_steps": len(warm),
            "warmup_seconds": sum(r["step_s"] for r in warm),
            "timed_steps": len(timed),
            "timed_seconds": seconds,
            "timed_tokens_per_s": sum(r["tokens"] for r in timed) / seconds if seconds > 0 else None,
        } | auto

    def cleanup(self, ok: bool = True) -> None:
        self.report.close()
        if self._out_lock is not None:
            self._out_lock.release()
            self._out_lock = None
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        # After a failure a peer may be gone and NCCL's teardown can block on it: leave that to process
        # exit. Gloo's teardown is local, so it always runs (in-process callers can start again).
        if dist.is_initialized() and (ok or dist.get_backend() == "gloo"):
            dist.destroy_process_group()
