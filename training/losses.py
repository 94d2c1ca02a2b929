"""Token losses for LoRA training: cross-entropy on the teacher's text, and logit distillation.

Every loss function returns a *sum* over tokens and the number of tokens summed, never a mean:
the trainer divides by the global token count across ranks and accumulation micro-steps, which
is what makes a multi-rank gradient equal to a single process's gradient on the whole batch.

Logit distillation is the forward KL from the teacher to the student, restricted to the
teacher's stored top-k log-probabilities plus one tail bucket holding the remaining mass. For a
label position with teacher ids ``i_1..i_k`` and log-probabilities ``l_1..l_k``::

    p_j = exp(l_j)          p_tail = 1 - sum_j p_j
    q_j = softmax(z)[i_j]   q_tail = 1 - sum_j q_j
    KL  = sum_j p_j (l_j - log q_j) + p_tail (log p_tail - log q_tail)

With ``k`` equal to the vocabulary the tail is empty and this is the exact KL(p || q).

Batch keys, aligned with ``labels`` (index ``t`` holds the teacher's distribution over the
token *at* ``t``, so they are shifted exactly like the labels)::

    teacher_topk_ids       int64   [B, T, K]   -1 where a position has no teacher distribution
    teacher_topk_logprobs  float32 [B, T, K]   log p of each id (ignored where the id is -1)

The tokenized dataset carries them as ``teacher_topk_ids: list<list<int32>>`` and
``teacher_topk_logprobs: list<list<float32>>`` (one list per input token, empty where the
teacher said nothing); :func:`campaign_orchestrator.dataset.topk.align_top_logprobs` builds those lists from a teacher generation's
``top_logprobs`` (one list per generated token of ``{token_id, logprob}``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# The alignment of a generation's top-k lists onto tokenized rows is data preparation (torch-free, in
# campaign_orchestrator.dataset.topk); re-exported here because the loss and the columns it reads are one contract.
from campaign_orchestrator.dataset.topk import TEACHER_IDS, TEACHER_LOGPROBS, AlignmentError, align_top_logprobs  # noqa: F401

IGNORE = -100
TEACHER_KEYS = frozenset({TEACHER_IDS, TEACHER_LOGPROBS})


# --------------------------------------------------------------------------- losses


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over positions whose label is not -100, and their count."""
    shifted = labels[:, 1:]
    flat = logits[:, :-1].float().reshape(-1, logits.size(-1))
    loss = F.cross_entropy(flat, shifted.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, int((shifted != IGNORE).sum())


def topk_kl_sum(
    logits: torch.Tensor, labels: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
    min_tail: float = 1e-12,
) -> tuple[torch.Tensor, int]:
    """Summed forward KL(teacher || student) over label positions that carry a teacher distribution.

    ``logits`` [B, T, V]; ``labels`` [B, T]; ``topk_ids`` / ``topk_logprobs`` [B, T, K] aligned with
    ``labels``. Returns the sum and the number of positions it covers. ``min_tail`` bounds the
    student's tail probability away from 0 so a confident student never makes the loss infinite.
    """
    if topk_ids.shape[:2] != labels.shape or topk_logprobs.shape != topk_ids.shape:
        raise ValueError(
            f"teacher top-k tensors {tuple(topk_ids.shape)} / {tuple(topk_logprobs.shape)} do not match labels "
            f"{tuple(labels.shape)} (expected [B, T, K] aligned with labels)"
        )
    vocab = logits.size(-1)
    ids = topk_ids[:, 1:].long()
    if ids.numel() and int(ids.max()) >= vocab:
        raise ValueError(f"teacher token id {int(ids.max())} is outside the student's vocabulary of {vocab}")
    lp_t = topk_logprobs[:, 1:].float()
    valid = ids >= 0
    positions = (labels[:, 1:] != IGNORE) & valid.any(-1)
    if not bool(positions.any()):
        return logits.sum() * 0.0, 0
    z = logits[:, :-1][positions].float()  # [N, V]
    ids, lp_t, valid = ids[positions], lp_t[positions], valid[positions]
    log_q_all = torch.log_softmax(z, dim=-1)
    safe_ids = ids.clamp(min=0)
    log_q = log_q_all.gather(-1, safe_ids)  # [N, K]
    zero = torch.zeros_like(lp_t)
    p = torch.where(valid, lp_t.exp(), zero)
    top = (p * (torch.where(valid, lp_t, zero) - torch.where(valid, log_q, zero))).sum(-1)
    # The student's tail mass is the sum over the tokens outside the teacher's top-k, taken directly (a
    # finite fill instead of -inf keeps the gradient finite when the top-k covers the whole vocabulary).
    in_top = torch.zeros_like(log_q_all).scatter_add(-1, safe_ids, valid.to(log_q_all.dtype)) > 0
    log_q_tail = torch.logsumexp(log_q_all.masked_fill(in_top, -1e30), dim=-1)
    log_q_tail = log_q_tail.clamp(min=math.log(min_tail))
    p_tail = (1.0 - p.sum(-1)).clamp(min=0.0)
    tail = torch.xlogy(p_tail, p_tail) - p_tail * log_q_tail
    return (top + tail).sum(), int(positions.sum())


def loss_sums(logits: torch.Tensor, batch: dict[str, torch.Tensor], distill: bool) -> dict[str, torch.Tensor | int]:
    """The per-micro-batch sums the trainer normalizes globally: CE always, KL when distilling logits."""
    ce, n_ce = cross_entropy_sum(logits, batch["labels"])
    out: dict[str, torch.Tensor | int] = {"ce_sum": ce, "ce_tokens": n_ce}
    if distill:
        kl, n_kl = topk_kl_sum(logits, batch["labels"], batch[TEACHER_IDS], batch[TEACHER_LOGPROBS])
        out |= {"kl_sum": kl, "kl_tokens": n_kl}
    return out


def mix(ce_sum: torch.Tensor, ce_tokens: int, kl_sum: torch.Tensor | None, kl_tokens: int, kl_weight: float) -> torch.Tensor:
    """(1 - w) * CE / ce_tokens + w * KL / kl_tokens, with global token counts; a term without tokens drops out."""
    loss = ce_sum * ((1.0 - kl_weight) / ce_tokens if ce_tokens else 0.0)
    if kl_sum is not None:
        loss = loss + kl_sum * (kl_weight / kl_tokens if kl_tokens else 0.0)
    return loss


# --------------------------------------------------------------------------- data alignment


def teacher_topk_tensors(
    rows_ids: Sequence[Sequence[Sequence[int]]], rows_logprobs: Sequence[Sequence[Sequence[float]]], width: int,
    k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad per-row, per-position top-k lists into ``[B, width, K]`` tensors (-1 / 0 where absent)."""
    k = k or max((len(p) for r in rows_ids for p in r), default=1) or 1
    ids = torch.full((len(rows_ids), width, k), -1, dtype=torch.long)
    lps = torch.zeros((len(rows_ids), width, k), dtype=torch.float32)
    for b, (r_ids, r_lps) in enumerate(zip(rows_ids, rows_logprobs)):
        for t, (p_ids, p_lps) in enumerate(zip(r_ids[:width], r_lps[:width])):
            if p_ids:
                kk = min(k, len(p_ids))
                ids[b, t, :kk] = torch.as_tensor(list(p_ids[:kk]), dtype=torch.long)
                lps[b, t, :kk] = torch.as_tensor(list(p_lps[:kk]), dtype=torch.float32)
    return ids, lps
