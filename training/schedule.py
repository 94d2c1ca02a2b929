"""The learning-rate schedule: linear warmup, then cosine decay to zero (a multiplier of the peak rate)."""

from __future__ import annotations

import math
from collections.abc import Callable


def cosine_with_warmup(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The factor of the peak learning rate at each optimizer step (``torch.optim.lr_scheduler.LambdaLR``'s
    ``lr_lambda``): ``(step + 1) / warmup_steps`` during the warmup (so the first step already trains), then
    ``0.5 * (1 + cos(pi * progress))`` with ``progress`` from 0 at the end of the warmup to 1 at ``total_steps``,
    and 0 after it."""
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"warmup_steps must be >= 0 and total_steps >= 1, got {warmup_steps} and {total_steps}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor
