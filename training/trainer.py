"""LoRA / QLoRA fine-tuning under FSDP2, one process or many (torchrun), CPU (gloo) or CUDA (NCCL).

Features
  * 4-bit NF4 or bf16 base, PEFT LoRA adapters, FSDP2 ``fully_shard`` (full / hybrid / none).
  * Exact loss: every optimizer step's loss is the sum of token losses divided by the *global*
    count of loss tokens across ranks and accumulation micro-steps (one all-reduce per step),
    so the gradient equals a single process's gradient on the whole batch.
  * Guards: a non-finite loss or gradient norm stops training (``TrainingError``); a step whose
    micro-batches hold no loss token anywhere is counted and skipped, never logged as loss 0.
  * Output: a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``),
    ``metrics.parquet`` (one row per step) and ``summary.json``; metrics stream through Pipes.

Raises
  ``TrainingError`` for a configuration or data problem found before or during training.
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from training import data as tdata
from training.config import TrainJob
from training.model import build_mesh, device_for, load_student, shard, trainable_parameters
from training.profiling import RunProfiler
from training.reporting import Reporter


class TrainingError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_dist_env() -> None:
    """Allow ``python -m training`` without torchrun: a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class LoraTrainer:
    def __init__(self, job: TrainJob):
        self.job = job
        self.spec = job.training
        self.out = Path(job.output_dir)
        self.report = Reporter(False)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        _ensure_dist_env()
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = device_for(self.local_rank)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=int(os.environ.get("TRAIN_PG_TIMEOUT_S", "300"))))
        self.is_main = self.rank == 0
        self.report = Reporter(self.is_main)
        if self.world != self.spec.world_size:
            raise TrainingError(
                f"launched with {self.world} processes but the campaign asks for nodes × processes_per_node = "
                f"{self.spec.nodes} × {self.spec.processes_per_node} = {self.spec.world_size}"
            )
        self._setup_data()
        self._setup_model()
        self._setup_optimizer()

    def _setup_data(self) -> None:
        from dataprep.tokenize import tokenizer_hash

        ds_hash = tdata.dataset_tokenizer_hash(self.job.dataset_path)
        model_hash = tokenizer_hash(self.job.base_model_path)
        if ds_hash is not None and ds_hash != model_hash:
            raise TrainingError(
                f"dataset {self.job.dataset_path} was tokenized with tokenizer {ds_hash[:12]} but the student "
                f"{self.job.base_model_path} has tokenizer {model_hash[:12]}; rebuild the tokenized dataset"
            )
        self.rows = tdata.load_rows(self.job.dataset_path)
        n = len(self.rows["input_ids"])
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

    def _setup_model(self) -> None:
        torch.manual_seed(self.spec.seed)  # identical LoRA init on every rank
        model = load_student(self.job.base_model_path, self.job.student, self.device)
        self.trainable = sum(p.numel() for p in trainable_parameters(model))
        self.total_params = sum(p.numel() for p in model.parameters())
        self.mesh = build_mesh(self.spec, self.device)
        self.model = shard(model, self.mesh)
        self.model.train()
        torch.manual_seed(self.spec.seed + 1 + self.rank)  # dropout differs per rank

    def _setup_optimizer(self) -> None:
        params = trainable_parameters(self.model)
        self.optimizer = torch.optim.AdamW(params, lr=self.spec.learning_rate, weight_decay=self.spec.weight_decay)
        warm, total = self.spec.warmup_steps, self.total_steps

        def schedule(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            progress = (step - warm) / max(1, total - warm)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    # ------------------------------------------------------------------ steps
    def _loss_step(self, batch: dict[str, torch.Tensor], global_tokens: int) -> float:
        """Forward + backward of one micro-batch; returns its summed token loss (unscaled)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        inputs = {k: v for k, v in batch.items() if k not in tdata.NON_MODEL_KEYS}
        logits = self.model(**inputs).logits
        labels = batch["labels"][:, 1:]
        loss_sum = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                                   ignore_index=-100, reduction="sum")
        # FSDP averages gradients over data-parallel ranks; scale by world so the sum is exact.
        (loss_sum * self.world / global_tokens).backward()
        return float(loss_sum.detach())

    def train(self) -> dict:
        spec = self.spec
        self.report.log(
            f"training {self.job.campaign}: {self.total_steps} steps, world {self.world} "
            f"({spec.nodes} node(s) × {spec.processes_per_node}), sharding {spec.sharding}, effective batch "
            f"{spec.micro_batch_size} × {self.world} × {spec.gradient_accumulation_steps} = {spec.effective_batch}, "
            f"trainable {self.trainable:,} of {self.total_params:,} parameters"
        )
        metrics: list[dict] = []
        skipped = 0
        t_start = time.perf_counter()
        with RunProfiler(spec, self.out, self.report.log) as prof:
            for step, micro in tdata.iter_steps(self.plan, 0, self.total_steps, self.rank):
                t0 = time.perf_counter()
                batches = [tdata.collate(self.rows, idx, self.pad_id) for idx in micro]
                local = torch.tensor([sum(tdata.loss_token_count(b) for b in batches),
                                      sum(tdata.real_token_count(b) for b in batches)], dtype=torch.float64)
                dist.all_reduce(local)
                global_tokens, global_real = int(local[0]), int(local[1])
                if global_tokens == 0:
                    skipped += 1
                    self.report.log(f"step {step}: every micro-batch is fully masked on all ranks; skipped")
                    self.scheduler.step()
                    continue
                loss_sum = sum(self._loss_step(b, global_tokens) for b in batches)
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(self.model), spec.max_grad_norm)
                grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                loss_t = torch.tensor([loss_sum], dtype=torch.float64)
                dist.all_reduce(loss_t)
                loss = float(loss_t) / global_tokens
                if not math.isfinite(loss) or not math.isfinite(grad_norm):
                    raise TrainingError(f"step {step}: non-finite loss {loss} or gradient norm {grad_norm}; stopping")
                lr = self.scheduler.get_last_lr()[0]
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                row = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "loss_tokens": global_tokens,
                       "tokens": global_real, "tokens_per_s": global_real / dt, "step_s": dt,
                       "peak_memory_mb": _peak_memory_mb(self.device)}
                metrics.append(row)
                if self.is_main and ((step + 1) % spec.log_every == 0 or step == 0 or step + 1 == self.total_steps):
                    self.report.log(f"step {step + 1}/{self.total_steps} loss {loss:.4f} lr {lr:.2e} "
                                    f"grad_norm {grad_norm:.3f} tokens/s {row['tokens_per_s']:.0f}")
                    self.report.metrics(row)
                prof.step()
        seconds = time.perf_counter() - t_start
        prof.finish()
        return self._finish(metrics, skipped, seconds)

    # ------------------------------------------------------------------ output
    def save_adapter(self) -> Path:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        adapter_dir = self.out / "adapter"
        if self.is_main:
            lora_sd = {k: v for k, v in sd.items() if "lora_" in k}
            self.model.save_pretrained(str(adapter_dir), state_dict=lora_sd, safe_serialization=True)
        dist.barrier()
        return adapter_dir

    def _finish(self, metrics: list[dict], skipped: int, seconds: float) -> dict:
        adapter_dir = self.save_adapter()
        if not self.is_main:
            return {}
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.out.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(metrics), self.out / "metrics.parquet")
        head = [m["loss"] for m in metrics[:10]]
        tail = [m["loss"] for m in metrics[-10:]]
        tokens = sum(m["tokens"] for m in metrics)
        summary = {
            "steps": len(metrics),
            "skipped_steps": skipped,
            "world_size": self.world,
            "nodes": self.spec.nodes,
            "processes_per_node": self.spec.processes_per_node,
            "sharding": self.spec.sharding,
            "effective_batch": self.spec.effective_batch,
            "first_loss": sum(head) / len(head) if head else None,
            "final_loss": sum(tail) / len(tail) if tail else None,
            "tokens": tokens,
            "loss_tokens": sum(m["loss_tokens"] for m in metrics),
            "train_seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "peak_memory_mb": max((m["peak_memory_mb"] for m in metrics), default=0.0),
            "trainable_parameters": self.trainable,
            "total_parameters": self.total_params,
            "adapter_dir": str(adapter_dir),
            "adapter_bytes": sum(f.stat().st_size for f in adapter_dir.iterdir()),
            "device": self.device.type,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.report.materialization({k: v for k, v in summary.items() if v is not None})
        self.report.log(f"done: {summary['steps']} steps in {seconds:.1f}s, loss {summary['first_loss']:.4f} → "
                        f"{summary['final_loss']:.4f}, adapter at {adapter_dir}")
        return summary

    def cleanup(self) -> None:
        self.report.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run(config_path: str | Path) -> dict:
    job = TrainJob.read(config_path)
    trainer = LoraTrainer(job)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.cleanup()
