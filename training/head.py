"""The LM head only where a label needs it: logits at the labelled positions of a batch, never the rest.

A distillation row is mostly prompt: on the smollm2 campaign's packed rows 12% of the tokens carry a
label. The next-token loss at position ``t`` needs the logits at ``t`` only when ``labels[t + 1]`` is
not -100, so the LM head (a 49,152 × 576 matmul per token on SmolLM2-135M, a fifth of the forward)
runs on those positions alone: transformers' ``logits_to_keep`` (a 1-D tensor of positions, the same
for every row of the batch: their union) slices the hidden states before the head. Its backward
then runs on those positions alone too.

:func:`compact` returns the positions to keep and the batch's label-aligned tensors (``labels``, the
teacher's top-k columns) gathered so that the trainer's loss functions (``training.losses``, which
shift by one inside) see exactly the pairs (logits at ``t``, label at ``t + 1``) of the full
computation: kept positions ``p_1 < ... < p_K`` plus one trailing position (never scored) and labels
at ``0, p_1 + 1, ..., p_K + 1`` (the first is dropped by the shift). The sums, and therefore the
gradients, equal the full computation's (``tests/training/test_head.py``).
"""

from __future__ import annotations

import torch

IGNORE = -100


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """Sorted positions ``t`` (``0 ≤ t < T - 1``) whose next label is set in any row of ``labels`` [B, T]."""
    return torch.nonzero((labels[:, 1:] != IGNORE).any(0), as_tuple=True)[0]


def compact(batch: dict[str, torch.Tensor], label_keys: frozenset[str] | set[str]) -> tuple[torch.Tensor, dict]:
    """``(logits_to_keep, batch')``: the positions the head must score (the labelled ones plus the last
    position, so that the shift inside the loss functions lines up) and ``batch`` with every tensor named
    in ``label_keys`` (aligned with ``labels`` on dim 1) gathered at ``0`` and the labelled positions + 1."""
    labels = batch["labels"]
    width = labels.size(1)
    p = label_positions(labels)
    last = torch.tensor([width - 1], dtype=p.dtype, device=p.device)
    keep = torch.cat([p, last])
    targets = torch.cat([torch.zeros(1, dtype=p.dtype, device=p.device), p + 1])
    out = dict(batch)
    for k in label_keys:
        if k in batch:
            out[k] = batch[k].index_select(1, targets)
    return keep, out
