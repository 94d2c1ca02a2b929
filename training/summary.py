"""What a training run reports when it ends: ``summary.json``, the asset's metadata (through Pipes).

Read off the trainer after its last step: steps (trained, skipped, resumed from), topology,
batch, first and final loss, eval loss before and after, tokens and tokens/s, attention kernel,
peak memory, parameter counts, adapter / checkpoint / base sizes, device.
"""

from __future__ import annotations

import json
import platform
import socket
from pathlib import Path

REPRODUCIBILITY = "reproducibility.json"


def run_summary(
    trainer, seconds: float, eval_loss: float | None, adapter_dir: Path, ckpt: Path, merged: Path | None
) -> dict:
    """The run's summary (global rank 0; ``trainer``: a finished :class:`training.recipes.LoraFinetuneRecipe`)."""
    m = trainer.metrics
    head = [r["loss"] for r in m[:10]]
    tail = [r["loss"] for r in m[-10:]]
    new = [r for r in m if trainer.resumed_from is None or r["step"] > trainer.resumed_from]
    tokens = sum(r["tokens"] for r in new)
    base_bytes = sum(f.stat().st_size for f in Path(trainer.job.base_model_path).glob("*.safetensors"))
    return {
        "steps": trainer.total_steps,
        "trained_steps": len(m),
        "skipped_steps": trainer.skipped,
        "resumed_from_step": trainer.resumed_from,
        "world_size": trainer.world,
        "nodes": trainer.spec.nodes,
        "processes_per_node": trainer.spec.processes_per_node,
        "sharding": trainer.spec.sharding,
        "fsdp": trainer.world > 1,
        "micro_batch_size": trainer.spec.micro_batch_size,
        "gradient_accumulation_steps": trainer.spec.gradient_accumulation_steps,
        "effective_batch": trainer.spec.effective_batch,
        "loss": trainer.spec.distillation.loss,
        "loss_normalization": trainer.spec.loss_normalization,
        # logit distillation from a teacher of another tokenizer: label positions (and shares) per part of the loss
        "distillation_alignment": getattr(trainer, "teacher_alignment", None),
        "first_loss": sum(head) / len(head) if head else None,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "eval_loss_before": trainer.eval_loss_before,
        "eval_loss": eval_loss,
        "eval_rows": sum(len(r) for r in trainer.eval_rows),
        "eval_source": trainer.eval_source,
        "tokens": tokens,
        "loss_tokens": sum(r["loss_tokens"] for r in new),
        "train_seconds": seconds,
        "train_cpu_seconds": trainer.cpu_seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "attn_implementation": trainer.attn_implementation,
        "peak_memory_mb": max((r["peak_memory_mb"] for r in m), default=0.0),
        "trainable_parameters": trainer.trainable,
        "total_parameters": trainer.total_params,
        "adapter_dir": str(adapter_dir),
        "adapter_bytes": sum(f.stat().st_size for f in adapter_dir.iterdir()),
        "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.iterdir()),
        "base_model_bytes": base_bytes,
        "merged_dir": str(merged) if merged else None,
        "device": trainer.device.type,
        "compute_dtype": trainer.precision.dtype,
        "compute_dtype_requested": trainer.precision.requested,
        "compute_dtype_reason": trainer.precision.reason,
        "cpu_capability": trainer.precision.capability,
        "allocator": trainer.allocator,
    }


def write_reproducibility_card(trainer, directory: Path) -> dict:
    """``reproducibility.json`` beside the adapter: what it takes to train it again and get the same
    numbers (seeds, resolved dtype and why, library versions, device, CPU capability, topology) and, for a
    base converted from GGUF, its model card (source package and file, sha256, quantization, dequantized)."""
    from campaign_orchestrator.hardware import library_versions
    from campaign_orchestrator.models import read_model_card

    spec = trainer.spec
    card = {
        "seed": spec.seed,
        "compute_dtype": trainer.precision.record(),
        "attn_implementation": trainer.attn_implementation,
        "allocator": trainer.allocator,
        "device": trainer.device.type,
        "device_name": _device_name(trainer.device),
        "cpu_capability": trainer.precision.capability,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "libraries": library_versions(),
        "world_size": trainer.world,
        "nodes": spec.nodes,
        "processes_per_node": spec.processes_per_node,
        "sharding": spec.sharding,
        "micro_batch_size": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "max_steps": trainer.total_steps,
        "base_model": str(trainer.job.base_model_path),
        "base_model_card": read_model_card(trainer.job.base_model_path),  # a converted model: source, quantization
        "dataset": str(trainer.job.dataset_path),
    }
    (directory / REPRODUCIBILITY).write_text(json.dumps(card, indent=2))
    return card


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()
