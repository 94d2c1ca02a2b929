"""LoRA / QLoRA fine-tuning under FSDP2, one process or many (torchrun), CPU (gloo) or CUDA (NCCL).

Features
  * 4-bit NF4 or bf16 base, PEFT LoRA adapters, FSDP2 ``fully_shard`` with a mixed-precision
    policy; topology ``full`` / ``hybrid`` / ``none`` from ``training.sharding``; optional
    activation checkpointing.
  * Exact loss: every optimizer step divides summed token losses by the *global* count of loss
    tokens across ranks and accumulation micro-steps (one all-reduce per step), so the gradient
    equals a single process's gradient on the whole batch. Effective batch = micro × ranks × accumulation.
  * Distillation: cross-entropy on the teacher's text, or forward KL against the teacher's stored
    top-k log-probabilities mixed with cross-entropy (``training.distillation``), or on-policy (GKD): rounds
    in which the student samples completions with its current weights, the teacher scores every sampled
    token (in process beside the student, or a server) and the loss is the generalized JSD on those tokens
    (``training.on_policy``); rounds are logged, reported and resumable mid-round.
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
from campaign_orchestrator.process_memory import peak_rss_mb
from campaign_orchestrator.hardware import resolve_compute_dtype
from training import checkpoint, head, losses
from training import on_policy as opol
from training import data as tdata
from training import moe as tmoe
from training.checkpoint import CheckpointStore
from training.ownership import OutputDirLock, OutputDirLocked, die_with_launcher
from training.config import TrainJob
from training.errors import TrainingError
from training.model import (
    attention_kernel, build_mesh, device_for, full_tensor, load_student, packed_4bit_checksums, shard,
    trainable_parameters, verify_sharded_4bit,
)
from training.net import free_port
from training.profiling import RunProfiler
from training.reporting import Reporter
from training.export import copy_serving_files
from training.summary import run_summary, write_reproducibility_card


# Batch tensors aligned with ``labels`` position by position (gathered with them by ``head.compact``).
LABEL_ALIGNED = frozenset({"labels", *losses.TEACHER_KEYS})


def _r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)



def _ensure_dist_env() -> None:
    """Allow ``python -m training`` without torchrun: a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


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


class LoraTrainer:
    # The LM head and loss at labelled positions only (training.head); False computes them everywhere
    # (benchmarks/train_throughput.py measures both).
    labelled_head = True
    # Recompute the SwiGLU products, the norms' outputs and PEFT's input casts in backward instead of keeping
    # them (exact: training/recompute.py); False keeps what autograd keeps (benchmarks/train_throughput.py
    # measures both).
    recompute_cheap = True
    # FSDP2 even in a world of one (benchmarks/train_gpu_step.py times the sharded path, NCCL, on one GPU).
    shard_single_process = False

    def __init__(self, job: TrainJob):
        self.job = job
        self.spec = job.training
        self.out = Path(job.output_dir)
        self.report = Reporter(False)
        self.distill = self.spec.distillation.loss == "logits"
        self.on_policy = self.spec.distillation.loss == "on_policy"
        self.op = self.spec.distillation.on_policy
        self.schedule: opol.Schedule | None = None
        self.scorer = None
        self.rounds: dict[int, list[opol.ScoredSample]] = {}  # this rank's scored samples, by round (current only)
        self.round_stats: list[dict] = []  # every finished round (global figures)
        self._round_acc: dict[int, opol.RoundStats] = {}  # rounds in progress: reverse KL accumulated per step
        self._round_ready = 0.0  # when the current round's samples were ready (perf_counter)
        self.metrics: list[dict] = []
        self.moe: tmoe.MoeMonitor | None = None  # set by _setup_model for a mixture-of-experts student
        self.skipped = 0
        self.start_step = 0
        self.resumed_from: int | None = None
        self.eval_loss_before: float | None = None
        self._last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        self._stop_signal: int | None = None
        self._old_sigterm = None
        self._out_lock: OutputDirLock | None = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        _ensure_dist_env()
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = device_for(self.local_rank, self.job.gpu_required, self.spec.allow_cpu_fallback, self.spec.hardware)
        if self.job.gpu_required and self.device.type == "cpu":
            print(f"training.hardware {self.spec.hardware!r} is a GPU but none is visible: training on the CPU "
                  f"(training.allow_cpu_fallback), billed as CPU time at {self.spec.cpu_hardware!r}", flush=True)
        if not dist.is_initialized():
            # On GPUs, NCCL moves the model's tensors and gloo the small CPU ones (token counts, flags,
            # checkpoint metadata); every collective carries the timeout, so a dead peer fails the job.
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=self.spec.collective_timeout_s))
        self.is_main = self.rank == 0
        self.report = Reporter(self.is_main)
        if self.is_main:  # one trainer per output directory (the kernel drops the lock when this process dies)
            try:
                self._out_lock = OutputDirLock(self.out).acquire()
            except OutputDirLocked as e:
                raise TrainingError(str(e)) from None
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
        self._setup_data()
        self._check_teacher_tokenizer()
        self._setup_model()
        if self.on_policy:
            self._setup_on_policy()
        self._setup_optimizer()
        self.store = CheckpointStore(self.out / "checkpoints", self.job.checkpoint_uri, self.spec.checkpoint.keep_last)
        self.load_checkpoint()

    def _on_sigterm(self, signum, _frame) -> None:
        self._stop_signal = signum

    def _setup_data(self) -> None:
        from campaign_orchestrator.dataset.tokenize import tokenizer_hash

        if self.on_policy:
            if self.job.on_policy is None:
                raise TrainingError("training.distillation.loss is 'on_policy' but the job has no `on_policy` part "
                                    "(prompts and teacher); the student_adapter stage writes it")
            from campaign_orchestrator.dataset.prompts import read_prompt_table

            self.prompts = read_prompt_table(self.job.on_policy.prompts_path)
            if not self.prompts:
                raise TrainingError(f"no training prompts in {self.job.on_policy.prompts_path}")
        if self.on_policy and not self.job.dataset_path:  # teacher_generations: none: the prompts are the data
            return self._setup_prompts_only()
        model_hash = tokenizer_hash(self.job.base_model_path)
        try:
            tdata.check_tokenizer(tdata.dataset_tokenizer_hash(self.job.dataset_path), model_hash,
                                  self.job.dataset_path, self.job.base_model_path)
        except tdata.DatasetMismatch as e:
            raise TrainingError(str(e)) from e
        self.rows = tdata.load_rows(self.job.dataset_path)
        self.eval_data, self.eval_source = self._validation_rows(model_hash)
        n = len(self.rows["input_ids"])
        if self.distill:
            self.teacher = self._load_teacher_topk()
        self.plan = tdata.BatchPlan(n, self.spec.micro_batch_size, self.world, self.spec.gradient_accumulation_steps,
                                    self.spec.seed)
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

    def _setup_prompts_only(self) -> None:
        """A fully on-policy run without a teacher stage: no tokenized rows, no eval loss; the plan counts prompts."""
        self.rows = self.eval_data = None
        self.eval_source = "none (teacher_generations: none: no teacher text to measure the loss on)"
        n = len(self.prompts)
        self.plan = tdata.BatchPlan(n, self.spec.micro_batch_size, self.world, self.spec.gradient_accumulation_steps,
                                    self.spec.seed)
        if self.spec.max_steps is not None:
            self.total_steps = self.spec.max_steps
        else:
            self.total_steps = max(1, math.ceil(self.spec.epochs * n / self.plan.rows_per_step))
        from transformers import AutoConfig

        self.pad_id = AutoConfig.from_pretrained(self.job.base_model_path).pad_token_id or 0
        self.eval_rows = [[] for _ in range(self.world)]

    def _setup_on_policy(self) -> None:
        """The teacher scorer, the student's tokenizer and stop ids, the step schedule and the round files."""
        from transformers import AutoTokenizer, GenerationConfig

        from campaign_orchestrator.dataset.formatting import prompt_token_ids

        job, op = self.job.on_policy, self.op
        self.student_tok = AutoTokenizer.from_pretrained(self.job.base_model_path)
        self.stop_ids = []
        try:
            eos = GenerationConfig.from_pretrained(self.job.base_model_path).eos_token_id
            self.stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
        except OSError:  # no generation_config.json
            pass
        if self.student_tok.eos_token_id is not None and self.student_tok.eos_token_id not in self.stop_ids:
            self.stop_ids.append(self.student_tok.eos_token_id)
        if self.moe is not None:
            raise TrainingError("training.distillation.loss 'on_policy' does not train mixture-of-experts students yet "
                                "(no load-balancing loss on sampled batches): use loss 'logits' or 'sequence'")
        self._prompt_token_ids = prompt_token_ids
        self.student_prompt_ids: dict[int, list[int]] = {}
        chat = bool(job.teacher.get("chat", False))
        self.teacher_prompts = [opol.teacher_prompt(p["prompt"], p.get("category"), job.context,
                                                    job.context_categories, chat) for p in self.prompts]
        per_step = self.spec.micro_batch_size * self.world * self.spec.gradient_accumulation_steps
        self.schedule = opol.Schedule(op.lambda_, op.warmup_steps, self.spec.seed, op.samples_per_round // per_step,
                                      len(self.prompts), op.samples_per_round // self.world, self.world)
        self.round_store = opol.RoundStore(self.out / "rounds")
        try:
            self.scorer = opol.make_scorer(job, self.job.teacher_tokenizer_path, self.device, self.report.log)
        except ValueError as e:
            raise TrainingError(str(e)) from e
        self.report.log(
            f"on-policy (GKD): lambda {op.lambda_}, beta {op.beta}, {op.samples_per_round} samples per round "
            f"({self.schedule.steps_per_round} steps), teacher top-{op.top_k} ({job.teacher_backend}), student "
            f"sampling temperature {op.temperature}, max_new_tokens {op.max_new_tokens}"
            + (f", {op.warmup_steps} sequence-KD warmup steps" if op.warmup == "sequence_kd" else ""))

    def _validation_rows(self, model_hash: str):
        """The eval-loss rows: the validation split when the dataset has one, else the training rows."""
        path = self.job.validation_path
        if not path or not any(Path(path).glob("*.parquet")):
            return self.rows, "train (the dataset has no validation split)"
        try:
            tdata.check_tokenizer(tdata.dataset_tokenizer_hash(path), model_hash, path, self.job.base_model_path)
        except tdata.DatasetMismatch as e:
            raise TrainingError(str(e)) from e
        val = tdata.load_rows(path)
        if len(val["input_ids"]) < self.world:
            return self.rows, f"train (the validation split has {len(val['input_ids'])} rows for {self.world} ranks)"
        return val, "validation"

    def _load_teacher_topk(self) -> dict[str, Any]:
        """The teacher's top-k columns as Arrow arrays (compact buffers, decoded per batch by ``take``)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols = [losses.TEACHER_IDS, losses.TEACHER_LOGPROBS]
        parts: dict[str, list] = {c: [] for c in cols}
        for f in tdata.parquet_files(self.job.dataset_path):
            names = pq.read_schema(f).names
            if not all(c in names for c in cols):
                raise TrainingError(
                    f"training.distillation.loss is 'logits' but {f} has no {cols} columns; the tokenized rows must "
                    f"carry the teacher's top-k log-probabilities aligned with input_ids (the tokenized_dataset stage "
                    f"writes them when the distillation set has top_logprobs: set teacher.sampling.logprobs; see "
                    f"campaign_orchestrator.dataset.topk), or use loss 'sequence'"
                )
            t = pq.read_table(f, columns=cols, memory_map=True)
            for c in cols:
                parts[c] += t.column(c).chunks
        return {c: pa.chunked_array(parts[c]) for c in cols}

    def _check_teacher_tokenizer(self) -> None:
        """Logit and on-policy distillation compare token ids: teacher and student must share one vocabulary."""
        if not (self.distill or self.on_policy):
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
        model = load_student(self.job.base_model_path, self.job.student, self.device,
                             activation_checkpointing=self.spec.activation_checkpointing,
                             attn_implementation=self.attn_implementation, compute_dtype=self.precision.dtype,
                             recompute_cheap=self.recompute_cheap)
        self.trainable = sum(p.numel() for p in trainable_parameters(model))
        self.total_params = sum(p.numel() for p in model.parameters())
        self.param_breakdown = tmoe.parameter_breakdown(model)  # by kind; refuses routed experts left frozen
        tmoe.refuse_frozen_experts(self.param_breakdown, self.job.student, self.job.base_model_path)
        if self.world > 1 or self.shard_single_process:
            before = packed_4bit_checksums(model)
            self.mesh = build_mesh(self.spec, self.device)
            self.model = shard(model, self.mesh, self.compute_dtype)
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
        self.named_trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.moe = tmoe.MoeMonitor.attach(self.model, self.job.student, self.param_breakdown, self.report.log,
                                          self.world, self.compute_dtype)
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
            shape = {"config": AutoConfig.from_pretrained(self.job.base_model_path), "row_tokens": row_tokens,
                     "seq_len": seq_len, "dtype": self.compute_dtype}
        kernel = [attention_kernel(self.job.student, self.device, self.spec.max_seq_len, shape)]
        if self.world > 1:
            dist.broadcast_object_list(kernel, src=0)
        return kernel[0]

    def _setup_optimizer(self) -> None:
        params = [p for _, p in self.named_trainable]
        # foreach: one multi-tensor kernel per Adam op instead of one per parameter (CPU included).
        self.optimizer = torch.optim.AdamW(params, lr=self.spec.learning_rate, weight_decay=self.spec.weight_decay,
                                           foreach=True)
        warm, total = self.spec.warmup_steps, self.total_steps

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = (step - warm) / max(1, total - warm)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    # ------------------------------------------------------------------ batches and steps
    def _batch(self, idx: list[int]) -> dict[str, torch.Tensor]:
        batch = tdata.collate(self.rows, idx, self.pad_id)
        if self.distill:
            t_ids = self.teacher[losses.TEACHER_IDS].take(idx).to_pylist()
            t_lps = self.teacher[losses.TEACHER_LOGPROBS].take(idx).to_pylist()
            n, width = batch["input_ids"].shape
            if n == 1 and len(idx) > 1:  # padding-free collation: the rows laid end to end in one row
                t_ids, t_lps = [[p for r in t_ids for p in r]], [[p for r in t_lps for p in r]]
            ids, lps = losses.teacher_topk_tensors(t_ids, t_lps, width)
            batch[losses.TEACHER_IDS], batch[losses.TEACHER_LOGPROBS] = ids, lps
        if self.moe is not None:
            batch[tmoe.MASK] = tmoe.token_mask(batch, [len(self.rows["input_ids"][i]) for i in idx])
        return batch

    @staticmethod
    def _kl_token_count(batch: dict[str, torch.Tensor]) -> int:
        if losses.TEACHER_IDS not in batch:
            return 0
        return int(((batch["labels"][:, 1:] != -100) & (batch[losses.TEACHER_IDS][:, 1:, 0] >= 0)).sum())

    def _scored(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """With ``labelled_head``, the batch the LM head and loss see at the labelled positions only
        (``training.head``: ``logits_to_keep`` and the label-aligned tensors gathered to match)."""
        if not self.labelled_head:
            return batch
        keep, batch = head.compact(batch, LABEL_ALIGNED)
        return batch | {"logits_to_keep": keep}

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        skip = tdata.NON_MODEL_KEYS | losses.TEACHER_KEYS | tmoe.BATCH_KEYS
        inputs = {k: v for k, v in batch.items() if k not in skip}
        inputs["use_cache"] = False  # training never reuses a KV cache; building one costs time and memory
        return self.model(**inputs).logits

    def _loss_step(self, batch: dict[str, torch.Tensor], ce_tokens: int, kl_tokens: int,
                   real_tokens: int = 0) -> tuple[float, float, float]:
        """Forward + backward of one micro-batch against global token counts; returns its (CE, KL) sums and,
        for a MoE, its load-balancing loss times its real tokens (``real_tokens``: the step's, global)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        if self.moe is not None:
            self.moe.begin()
        batch = self._scored(batch)
        sums = losses.loss_sums(self._forward(batch), batch, self.distill)
        w = self.spec.distillation.kl_weight if self.distill else 0.0
        loss = losses.mix(sums["ce_sum"], ce_tokens, sums.get("kl_sum"), kl_tokens, w)
        aux = 0.0
        if self.moe is not None:  # + coef · aux_micro · real_micro / real_step (global): a token-weighted mean
            term, aux = self.moe.end(batch[tmoe.MASK], real_tokens)
            loss = loss + term if term is not None else loss
        # FSDP averages gradients over the data-parallel ranks; scale by world so the sum is exact.
        # Every rank runs backward, even on a micro-batch without loss tokens (FSDP's collectives need it).
        (loss * self.world).backward()
        return float(sums["ce_sum"].detach()), float(sums["kl_sum"].detach()) if self.distill else 0.0, aux

    # ------------------------------------------------------------------ on-policy rounds
    def _student_prompt(self, i: int) -> list[int]:
        ids = self.student_prompt_ids.get(i)
        if ids is None:
            ids = self._prompt_token_ids(self.student_tok, self.prompts[i]["prompt"], self.job.on_policy.template)
            self.student_prompt_ids[i] = ids
        return ids

    def _all_done(self, local_done: bool) -> bool:
        """Whether every rank's samples are done (collective: every rank calls it once per decoding step). A stop
        requested on any rank (SIGTERM) interrupts the round on every rank (``RoundInterrupted``)."""
        stop = float(self._stop_signal is not None)
        if self.world == 1:
            if stop:
                raise opol.RoundInterrupted
            return local_done
        flag = torch.tensor([0.0 if local_done else 1.0, stop], dtype=torch.float64)
        dist.all_reduce(flag)
        if float(flag[1]) > 0:
            raise opol.RoundInterrupted
        return float(flag[0]) == 0.0

    def _sample_round(self, r: int) -> tuple[list[opol.ScoredSample], dict]:
        """This rank's share of round ``r``: the student samples with its current weights, the teacher scores."""
        op = self.op
        idx = self.schedule.round_prompts(r, self.rank)
        prompt_ids = [self._student_prompt(i) for i in idx]
        gen = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + r * 1_009 + self.rank)
        t0 = time.perf_counter()
        self.model.eval()
        try:
            with opol.decoding_attention(self.model):
                completions, steps = opol.sample(
                    self.model, prompt_ids, max_new_tokens=op.max_new_tokens, temperature=op.temperature,
                    stop_ids=self.stop_ids, pad_id=self.pad_id, generator=gen, device=self.device,
                    all_done=self._all_done)
        finally:
            self.model.train()
        t1 = time.perf_counter()
        self._all_done(True)  # a stop that came while sampling: leave before the teacher scores (collective)
        generated = getattr(self.scorer, "completion_tokens", 0)
        scored = opol.score_samples(self.scorer, [self.teacher_prompts[i] for i in idx], idx, prompt_ids, completions,
                                    op.top_k)
        generated = getattr(self.scorer, "completion_tokens", 0) - generated
        t2 = time.perf_counter()
        stops = set(self.stop_ids)
        stats = {"samples": len(scored), "sampled_tokens": sum(len(c) for c in completions),
                 "teacher_prefill_tokens": sum(x.prefill_tokens for x in scored),
                 "stopped": sum(1 for c in completions if c and c[-1] in stops), "decode_steps": steps,
                 "sampling_seconds": t1 - t0, "scoring_seconds": t2 - t1, "unscored": len(completions) - len(scored),
                 "teacher_completion_tokens": generated}
        return scored, stats

    def _round(self, r: int) -> list[opol.ScoredSample]:
        """This rank's scored samples of round ``r``: read back from its round file (a relaunch mid-round), else
        sampled and scored now and written (collective: every rank enters at the same step)."""
        if r in self.rounds:
            return self.rounds[r]
        self.rounds.clear()
        loaded = self.round_store.load(r, self.rank)
        have = torch.tensor([float(loaded is not None)], dtype=torch.float64)
        self._all_reduce(have)
        if int(have[0]) == self.world:
            samples, stats = loaded
            self.report.log(f"round {r + 1}: samples read back from {self.round_store.dir} (a relaunch mid-round)")
        else:
            samples, stats = self._sample_round(r)
            self.round_store.save(r, self.rank, samples, stats)
        totals = torch.tensor([stats["samples"], stats["sampled_tokens"], stats["teacher_prefill_tokens"],
                               stats["stopped"], stats["unscored"], stats.get("teacher_completion_tokens", 0)],
                              dtype=torch.float64)
        self._all_reduce(totals)
        secs = torch.tensor([stats["sampling_seconds"], stats["scoring_seconds"], stats["decode_steps"]],
                            dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(secs, op=dist.ReduceOp.MAX)  # ranks sample and score side by side: the slowest counts
        n, sampled, prefill, stopped, unscored, generated = (int(x) for x in totals.tolist())
        if not samples:
            raise TrainingError(f"round {r + 1}: the teacher scored none of rank {self.rank}'s samples (each prompt "
                                f"+ sample longer than its context?); lower "
                                f"training.distillation.on_policy.max_new_tokens")
        acc = self._round_acc.setdefault(r, opol.RoundStats(round=r + 1))
        acc.samples, acc.sampled_tokens, acc.teacher_prefill_tokens, acc.stopped = n, sampled, prefill, stopped
        acc.teacher_completion_tokens = generated
        acc.sampling_seconds, acc.scoring_seconds, acc.decode_steps = secs[0].item(), secs[1].item(), int(secs[2])
        acc.extra["unscored"] = unscored
        self.report.log(f"round {r + 1}: {n} samples ({sampled} tokens, {stopped} stopped, mean "
                        f"{sampled / max(1, n):.1f} tokens) in {acc.sampling_seconds:.1f}s; teacher scored {prefill} "
                        f"prefill tokens in {acc.scoring_seconds:.1f}s"
                        + (f"; {unscored} unscored" if unscored else ""))
        self.rounds[r] = samples
        self._round_ready = time.perf_counter()
        return samples

    def prepare_on_policy(self, step: int, control: tuple[float, ...] = ()
                          ) -> tuple[list[dict], list[int], list[float]]:
        """This rank's micro-batches of on-policy ``step`` (its round's samples, in order) and the step's global
        [KL tokens, real tokens]; ``control`` as in :meth:`prepare`."""
        r, offset = self.schedule.round_of(step)
        samples = self._round(r)
        micro, accum = self.spec.micro_batch_size, self.spec.gradient_accumulation_steps
        batches = []
        for a in range(accum):
            lo = (offset * accum + a) * micro
            part = samples[lo:lo + micro]
            b = opol.batch(part or samples[:1], self.pad_id, self.spec.max_seq_len)
            if not part:  # fewer scored samples than planned: a forward and backward with no loss token
                b["labels"].fill_(losses.IGNORE)
            batches.append(b)
        counts = torch.tensor([sum(self._kl_token_count(b) for b in batches),
                               sum(tdata.real_token_count(b) for b in batches), *control], dtype=torch.float64)
        self._all_reduce(counts)
        return batches, [int(c) for c in counts[:2].tolist()], counts[2:].tolist()

    def accumulate_on_policy(self, batches: list[dict], counts: list[int]) -> StepResult | None:
        """Forward/backward of the generalized JSD on the sampled positions, normalized by the global count."""
        kl_tokens, real_tokens = counts
        if kl_tokens == 0:
            return None
        beta = self.op.beta
        jsd_sum = rkl_sum = 0.0
        for i, b in enumerate(batches):
            self._set_grad_sync(i == len(batches) - 1)
            b = self._scored({k: v.to(self.device) for k, v in b.items()})
            log_p, log_q, valid, _ = losses.topk_buckets(self._forward(b), b["labels"], b[losses.TEACHER_IDS],
                                                         b[losses.TEACHER_LOGPROBS])
            jsd = losses.generalized_jsd(log_p, log_q, valid, beta).sum()
            with torch.no_grad():
                rkl = losses.generalized_jsd(log_p, log_q, valid, 1.0).sum()
            (jsd * (self.world / kl_tokens)).backward()  # FSDP averages over ranks: scale by world (exact sum)
            jsd_sum, rkl_sum = jsd_sum + float(jsd.detach()), rkl_sum + float(rkl)
        sums = torch.tensor([jsd_sum, rkl_sum], dtype=torch.float64)
        self._all_reduce(sums)
        jsd_mean, rkl_mean = float(sums[0]) / kl_tokens, float(sums[1]) / kl_tokens
        return StepResult(loss=jsd_mean, ce=None, kl=jsd_mean, grad_norm=float("nan"), loss_tokens=kl_tokens,
                          kl_tokens=kl_tokens, real_tokens=real_tokens, reverse_kl=rkl_mean)

    def _finish_round(self, r: int, completed: int) -> None:
        """A round's last step is done: log and report it (samples, mean reverse KL, teacher tokens), checkpoint."""
        acc = self._round_acc.pop(r)
        row = acc.as_row() | {"step": completed, "unscored": acc.extra.get("unscored", 0)}
        self.round_stats.append(row)
        self.rounds.pop(r, None)
        mean = acc.mean_reverse_kl
        self.report.log(f"round {r + 1} done at step {completed}: {acc.samples} samples, mean reverse KL "
                        f"{'n/a' if mean is None else f'{mean:.4f}'}, teacher scored {acc.teacher_prefill_tokens} "
                        f"tokens")
        if self.is_main:
            self.report.metrics({"kind": "on_policy_round", **row})  # the whole round (a budget guard charges it)
            # and as an observation of the asset (the launcher turns train_metrics into AssetObservations)
            self.report.metrics({"step": completed, "round": r + 1, "round_samples": acc.samples,
                                 "round_sampled_tokens": acc.sampled_tokens, "round_mean_reverse_kl": mean,
                                 "round_teacher_prefill_tokens": acc.teacher_prefill_tokens})
        if completed < self.total_steps:
            self.save_checkpoint(completed, reason="round")
        # a relaunch resumes from the newest checkpoint, at this round's end or later: earlier rounds' files go (one
        # resumed from an older checkpoint inside an earlier round would sample that round again)
        self.round_store.prune(r, self.rank)

    def _on_policy_summary(self) -> dict:
        rows = self.round_stats
        on = sum(1 for s in range(self.total_steps) if self.schedule.on_policy(s))
        kl_tokens = sum(r["kl_tokens"] for r in rows)
        rkl = sum((r["mean_reverse_kl"] or 0.0) * r["kl_tokens"] for r in rows)
        total = {k: sum(r.get(k, 0) for r in rows) for k in ("samples", "sampled_tokens", "teacher_prefill_tokens",
                                                             "teacher_completion_tokens", "sampling_seconds",
                                                             "scoring_seconds")}
        return {"rounds": len(rows), "on_policy_steps": on, "off_policy_steps": self.total_steps - on,
                "lambda": self.op.lambda_, "beta": self.op.beta, "samples_per_round": self.op.samples_per_round,
                "top_k": self.op.top_k, "teacher_backend": self.job.on_policy.teacher_backend, **total,
                "mean_reverse_kl": rkl / kl_tokens if kl_tokens else None,
                "first_round_reverse_kl": rows[0]["mean_reverse_kl"] if rows else None,
                "last_round_reverse_kl": rows[-1]["mean_reverse_kl"] if rows else None, "per_round": rows}

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
        counts = torch.tensor([sum(tdata.loss_token_count(b) for b in batches),
                               sum(self._kl_token_count(b) for b in batches),
                               sum(tdata.real_token_count(b) for b in batches), *control], dtype=torch.float64)
        self._all_reduce(counts)
        return batches, [int(c) for c in counts[:3].tolist()], counts[3:].tolist()

    def accumulate(self, batches: list[dict], counts: list[int]) -> StepResult | None:
        """Forward/backward every micro-batch with exact global normalization; gradients are then final.

        Returns ``None`` for a step whose micro-batches hold no loss token on any rank (nothing to
        learn; the caller counts and skips it).
        """
        ce_tokens, kl_tokens, real_tokens = counts
        if ce_tokens == 0 and kl_tokens == 0:
            return None
        ce_sum = kl_sum = aux_sum = 0.0
        for i, b in enumerate(batches):
            self._set_grad_sync(i == len(batches) - 1)  # reduce gradients once, after the last micro-batch
            c, k, a = self._loss_step(b, ce_tokens, kl_tokens, real_tokens)
            ce_sum, kl_sum, aux_sum = ce_sum + c, kl_sum + k, aux_sum + a
        sums = torch.tensor([ce_sum, kl_sum, aux_sum], dtype=torch.float64)
        self._all_reduce(sums)
        ce = float(sums[0]) / ce_tokens if ce_tokens else None
        kl = float(sums[1]) / kl_tokens if (self.distill and kl_tokens) else None
        w = self.spec.distillation.kl_weight if self.distill else 0.0
        loss = (1 - w) * (ce or 0.0) + w * (kl or 0.0) if self.distill else ce
        aux = None
        if self.moe is not None:
            self.moe.check_gradients()  # the first steps: expert LoRA gradients are non-zero (collective)
            if self.moe.aux_fn is not None:
                aux = float(sums[2]) / real_tokens
                loss = (loss or 0.0) + self.job.student.moe.aux_loss_coef * aux
        return StepResult(loss=loss, ce=ce, kl=kl, grad_norm=float("nan"), loss_tokens=ce_tokens,
                          kl_tokens=kl_tokens, real_tokens=real_tokens, aux=aux)

    def _clip(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in self.named_trainable], self.spec.max_grad_norm)
        return float(full_tensor(norm))

    def _describe_step_rows(self, step: int) -> str:
        if self.on_policy and self.schedule.on_policy(step):
            r, offset = self.schedule.round_of(step)
            return f"on-policy round {r + 1}, its step {offset + 1}, samples in {self.round_store.dir}"
        rows = [i for a in range(self.plan.accumulation) for r in range(self.world)
                for i in self.plan.step_rows(step, r)[a]]
        return f"dataset rows {rows[:16]}{' …' if len(rows) > 16 else ''}"

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
                due = float(self.is_main and every_s is not None and time.monotonic() - self._last_save_time >= every_s)
                control = (due, float(self._stop_signal is not None))
                on = self.on_policy and self.schedule.on_policy(step)
                if on:
                    try:
                        batches, counts, (due_all, stop_all) = self.prepare_on_policy(step, control)
                    except opol.RoundInterrupted:  # no round file was written: a relaunch samples it again, the same
                        self.save_checkpoint(step, reason="preempted")
                        raise TrainingError(
                            f"stopped by SIGTERM while round {self.schedule.round_of(step)[0] + 1} sampled, before "
                            f"step {step + 1}; checkpoint {self.store.path(step)} written, a relaunch samples the "
                            "round again with the same weights and seed") from None
                    t0 = max(t0, self._round_ready)  # a round's sampling and scoring is not this step's training time
                else:
                    batches, counts, (due_all, stop_all) = self.prepare(step, control)
                if due_all or stop_all:  # the state after `step` completed steps, before any forward of this one
                    self.save_checkpoint(step, reason="preempted" if stop_all else "time")
                    if stop_all:
                        raise TrainingError(
                            f"stopped by SIGTERM before step {step + 1}; checkpoint {self.store.path(step)} written, "
                            f"a relaunch resumes from it"
                        )
                result = self.accumulate_on_policy(batches, counts) if on else self.accumulate(batches, counts)
                if on:
                    r, offset = self.schedule.round_of(step)
                    if result is not None:
                        acc = self._round_acc[r]
                        acc.reverse_kl_sum += result.reverse_kl * result.kl_tokens
                        acc.kl_tokens += result.kl_tokens
                if result is None:
                    self.skipped += 1
                    self.report.log(f"step {step + 1}: no loss token in any micro-batch on any rank "
                                    f"({self._describe_step_rows(step)}); skipped, not logged as loss 0")
                    self.scheduler.step()
                    if on and offset + 1 == self.schedule.steps_per_round:
                        self._finish_round(r, step + 1)
                    self._maybe_checkpoint(step + 1)
                    continue
                result.grad_norm = self._clip()
                if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
                    last = self._last_saved_step
                    raise TrainingError(
                        f"step {step + 1}: non-finite loss {result.loss} or gradient norm {result.grad_norm} "
                        f"({self._describe_step_rows(step)}); stopped before the optimizer step. Last good checkpoint: "
                        + (f"{self.store.path(last)}" if last is not None else "none")
                        + ". A relaunch resumes there and meets the same batch: lower training.learning_rate, check the "
                        "data, or use compute_dtype float32"
                    )
                lr = self.scheduler.get_last_lr()[0]
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                row = {"step": step + 1, "loss": result.loss, "ce_loss": result.ce, "kl_loss": result.kl, "lr": lr,
                       "grad_norm": result.grad_norm, "loss_tokens": result.loss_tokens, "tokens": result.real_tokens,
                       "tokens_per_s": result.real_tokens / dt, "step_s": dt,
                       "peak_memory_mb": _peak_memory_mb(self.device)}
                if self.moe is not None:
                    row["aux_loss"] = result.aux
                if self.on_policy:
                    row |= {"kind": "on_policy" if on else "off_policy", "round": r + 1 if on else None,
                            "reverse_kl": result.reverse_kl}
                self.metrics.append(row)
                if self.is_main and ((step + 1) % spec.log_every == 0 or step == self.start_step
                                     or step + 1 == self.total_steps):
                    self.report.log(f"step {step + 1}/{self.total_steps} loss {result.loss:.4f} lr {lr:.2e} "
                                    f"grad_norm {result.grad_norm:.3f} tokens/s {row['tokens_per_s']:.0f}"
                                    + (f" (on-policy, round {r + 1}, reverse KL {result.reverse_kl:.4f})" if on
                                       else " (off-policy)" if self.on_policy else ""))
                    self.report.metrics(row)
                if on and offset + 1 == self.schedule.steps_per_round:
                    self._finish_round(r, step + 1)
                self._maybe_checkpoint(step + 1)
                if self.moe is not None:  # collective, at the same steps on every rank
                    self.moe.log_routing(step + 1, force=step + 1 == self.total_steps, every=spec.log_every)
                prof.step()
                if getattr(self, "_stopped_at", None):  # training.selection.patience: no improvement for N evaluations
                    break
        seconds, self.cpu_seconds = time.perf_counter() - t_start, time.process_time() - cpu_start
        prof.finish()
        if stop < self.total_steps:
            return self._finish_rung(stop, seconds)
        for r in sorted(self._round_acc):  # a last round cut short by max_steps: its samples were paid for all the same
            self._finish_round(r, self.total_steps)
        self.save_checkpoint(getattr(self, "_stopped_at", None) or self.total_steps, reason="final")
        return self._finish(seconds)

    def _finish_rung(self, stop: int, seconds: float) -> dict:
        """A sweep rung ends: checkpoint at ``stop`` (the next rung resumes there), eval loss, a short summary."""
        self.save_checkpoint(stop, reason="rung")
        eval_loss = self.evaluate()
        if not self.is_main:
            return {}
        new = [r for r in self.metrics if self.resumed_from is None or r["step"] > self.resumed_from]
        checkpoint.write_metrics(self.metrics, self.out / "metrics.parquet")
        summary = {"rung": True, "steps": stop, "total_steps": self.total_steps, "trained_steps": len(new),
                   "resumed_from_step": self.resumed_from, "eval_loss_before": self.eval_loss_before,
                   "eval_loss": eval_loss, "eval_source": self.eval_source, "train_seconds": seconds,
                   "final_loss": self.metrics[-1]["loss"] if self.metrics else None,
                   "tokens": sum(r["tokens"] for r in new), "device": self.device.type, "world_size": self.world}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.report.log(f"rung done at step {stop}/{self.total_steps} ({len(new)} steps trained here, resumed from "
                        f"{self.resumed_from}): eval loss ({self.eval_source}) {_r4(eval_loss)}")
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
            batch = {k: v.to(self.device) for k, v in tdata.collate(self.eval_data, mine[i:i + bs], self.pad_id).items()}
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
        from training import selection

        if getattr(self, "selector", None) is None:
            self.selector = selection.Selector(sel.replay_weight, sel.min_delta, sel.patience)
            src = self.job.validation_path if self.eval_source == "validation" else self.job.dataset_path
            import pyarrow.parquet as pq

            ids = [x for f in tdata.parquet_files(src) for x in pq.read_table(f, columns=["example_ids"])
                   .column("example_ids").to_pylist()]
            split = selection.split_rows(ids)
            self.selection_rows = {}
            for kind, idx in split.items():
                per_rank = min(self.spec.eval_rows, len(idx)) // self.world
                self.selection_rows[kind] = [idx[r * per_rank:(r + 1) * per_rank] for r in range(self.world)]
        task, replay = self.evaluate(self.selection_rows["task"]), self.evaluate(self.selection_rows["replay"])
        self.save_checkpoint(completed, reason="selection")
        if self.selector.observe(completed, task, replay) and self.is_main:
            best = self.out / "best_adapter"
            shutil.rmtree(best, ignore_errors=True)
            shutil.copytree(self.store.path(completed), best)
        if self.is_main:
            self.report.log(f"step {completed}: held-out loss task {_r4(task)}, replay {_r4(replay)}; kept step "
                            f"{self.selector.best.step if self.selector.best else None}")
        if self.selector.should_stop:
            self._stopped_at = completed

    def _trainer_state(self, step: int) -> dict:
        return {"step": step, "skipped_steps": self.skipped, "rows_per_step": self.plan.rows_per_step,
                "dataset_rows": self.plan.rows, "seed": self.spec.seed, "world_size": self.world,
                "total_steps": self.total_steps, "eval_loss_before": self.eval_loss_before,
                "scheduler": self.scheduler.state_dict(), "saved_at": time.time(),
                "moe": self.moe.state() if self.moe is not None else None,  # collective: routed-token counts so far
                "on_policy": {"rounds": self.round_stats, "in_progress": {
                    str(r): {k: v for k, v in vars(a).items()} for r, a in self._round_acc.items()}}
                if self.on_policy else None}

    def save_checkpoint(self, step: int, reason: str) -> None:
        """Collective: gather full adapter and optimizer state on rank 0, write atomically, mirror, prune."""
        if step == self._last_saved_step:
            return
        saved = checkpoint.save_training_state(
            self.store, step, self.model.peft_config["default"], self.named_trainable, self.optimizer,
            self._trainer_state(step), self.metrics, self.is_main, self.world)
        if self.is_main:
            self.report.log(f"checkpoint {step} ({reason}) at {saved}"
                            + (f", mirrored to {self.store.remote_uri}" if self.store.remote_uri else ""))
        self._last_saved_step = step
        self._last_save_time = time.monotonic()

    def load_checkpoint(self) -> None:
        """Resume from the newest complete checkpoint, if any (every start is a resume)."""
        restored = checkpoint.load_training_state(
            self.store, self.named_trainable, self.optimizer, self.scheduler, self.is_main, self.rank, self.world,
            expect={"rows_per_step": self.plan.rows_per_step, "dataset_rows": self.plan.rows, "seed": self.spec.seed})
        if restored is None:
            return
        step, state, metrics = restored
        if self.is_main:
            self.metrics = metrics
        self.skipped = state["skipped_steps"]
        self.eval_loss_before = state.get("eval_loss_before")
        if self.moe is not None:
            self.moe.load_state(state.get("moe"), self.is_main)
        if self.on_policy and state.get("on_policy"):
            self.round_stats = list(state["on_policy"]["rounds"])
            self._round_acc = {int(r): opol.RoundStats(**a) for r, a in state["on_policy"]["in_progress"].items()}
        self.start_step = self.resumed_from = step
        self._last_saved_step = step
        self.report.log(f"resumed from checkpoint {self.store.path(step)} (step {step} of {self.total_steps})")

    # ------------------------------------------------------------------ output
    def _finish(self, seconds: float) -> dict:
        eval_loss = self.evaluate()
        moe_report = self.moe.final_report() if self.moe is not None else None  # collective
        adapter_dir = self.out / "adapter"
        if not self.is_main:
            return {}
        selector = getattr(self, "selector", None)  # training.selection: the kept checkpoint, not the last
        last = getattr(self, "_stopped_at", None) or self.total_steps
        ckpt = self.out / "best_adapter" if selector is not None and selector.best else self.store.path(last)
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
        if selector is not None:
            summary["selection"] = selector.summary(last)
        if moe_report is not None:
            summary["moe"] = moe_report
        if self.on_policy:
            summary["on_policy"] = self._on_policy_summary()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.report.materialization({k: v for k, v in summary.items() if v is not None})
        self.report.log(
            f"done: {len(self.metrics)} steps ({self.skipped} skipped) in {seconds:.1f}s, loss "
            f"{summary['first_loss'] if summary['first_loss'] is None else round(summary['first_loss'], 4)} → "
            f"{summary['final_loss'] if summary['final_loss'] is None else round(summary['final_loss'], 4)}, "
            f"eval loss ({self.eval_source}) {_r4(self.eval_loss_before)} → {_r4(eval_loss)}, adapter at {adapter_dir}")
        return summary

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


def run(config_path: str | Path) -> dict:
    die_with_launcher()  # under the local launcher: die with torchrun (its workers are in their own sessions)
    job = TrainJob.read(config_path)
    trainer = LoraTrainer(job)
    ok = False
    try:
        trainer.setup()
        summary = trainer.train()
        ok = True
        return summary
    finally:
        trainer.cleanup(ok)
