"""The NF4 dequantization's share of a QLoRA training step, measured with torch.profiler.

bitsandbytes trains a 4-bit base by dequantizing each packed weight to the compute dtype in every forward and
again in backward (``bitsandbytes::dequantize_4bit``, plus ``dequantize_blockwise`` for double-quantized
absmax); the matmuls then run in the compute dtype. This module times those ops against the whole step: on
CUDA by device (kernel) time, on the CPU by the ops' own CPU time. ``benchmarks/train_gpu_step.py`` reports the
share in its QLoRA sections.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DEQUANT_OPS = ("bitsandbytes::dequantize_4bit", "bitsandbytes::dequantize_blockwise")


def dequant_share(step: Callable[[], object], device: torch.device, steps: int = 3, warmup: int = 1) -> dict:
    """Run ``step`` (one training step: forward, backward, no optimizer needed) ``warmup`` times unprofiled, then
    ``steps`` times under the profiler; returns the dequantization's share of the profiled time and its parts
    per step (milliseconds), and how many dequantizations a step runs."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    if cuda:  # a dequantize op's device time is that of the kernels it launched; the step's is every kernel's
        total = sum(e.self_device_time_total for e in events)
        dequant = sum(e.device_time_total for e in events if e.key in DEQUANT_OPS)
    else:
        total = sum(e.self_cpu_time_total for e in events)
        dequant = sum(e.self_cpu_time_total for e in events if e.key in DEQUANT_OPS)
    calls = sum(e.count for e in events if e.key == DEQUANT_OPS[0])
    return {
        "dequant_share": dequant / total if total else 0.0,
        "dequant_ms_per_step": dequant / 1e3 / steps,
        "step_ms_profiled": total / 1e3 / steps,
        "dequant_calls_per_step": calls / steps,
        "steps": steps,
        "clock": "device" if cuda else "cpu",
    }


def recipe_dequant_share(recipe, steps: int = 3, warmup: int = 1) -> dict:
    """:func:`dequant_share` of a set-up recipe's first step (``training.recipes``: its micro-batches, forward and
    backward with the step's normalization; gradients dropped after each, so no weight changes)."""
    batches, counts, _ = recipe.prepare(0)

    def step() -> None:
        recipe.accumulate(batches, counts)
        recipe.optimizer.zero_grad(set_to_none=True)

    return dequant_share(step, recipe.device, steps, warmup)
