"""The reference for ``training.loss_normalization: example``, written out without the trainer's code: a row's
next-token losses split by example (a run of ``position_ids`` from a 0 to the next; packed rows restart them per
example). Imported by grad_check.py (run under torchrun, this folder on its path) and by the single-process test."""

import torch


def per_example(logits: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
    """One row (``logits`` [T, V], ``labels`` and ``position_ids`` [T]): each example's next-token losses at its
    loss labels, in order; examples without a loss label are left out."""
    ce = torch.nn.functional.cross_entropy(logits[:-1].float(), labels[1:].clamp(min=0), reduction="none")
    pos = position_ids.tolist()
    out, start = [], 1
    for j in range(2, len(pos) + 1):
        if j == len(pos) or pos[j] == 0:  # an example ends where the next one's positions restart
            mine = [ce[t - 1] for t in range(start, j) if int(labels[t]) != -100]
            if mine:
                out.append(torch.stack(mine))
            start = j
    return out
