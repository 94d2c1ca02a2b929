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

On-policy distillation (``training.distillation.loss: on_policy``, GKD) uses the same top-k + tail buckets
(:func:`topk_buckets`) under the generalized Jensen-Shannon divergence (:func:`generalized_jsd_sum`): ``beta`` 0
is this forward KL, 1 the reverse KL(student || teacher), between them JSD(beta) against the mixture
``beta p + (1 - beta) q`` (TRL's ``GKDTrainer.generalized_jsd_loss`` convention).

Batch keys, aligned with ``labels`` (index ``t`` holds the teacher's distribution over the
token *at* ``t``, so they are shifted exactly like the labels)::

    teacher_topk_ids       int64   [B, T, K]   -1 where a position has no teacher distribution
    teacher_topk_logprobs  float32 [B, T, K]   log p of each id (ignored where the id is -1)

The tokenized dataset carries them as ``teacher_topk_ids: list<list<int32>>`` and
``teacher_topk_logprobs: list<list<float32>>`` (one list per input token, empty where the
teacher said nothing); :func:`campaign_orchestrator.dataset.topk.align_top_logprobs` builds those lists from a teacher
generation's
``top_logprobs`` (one list per generated token of ``{token_id, logprob}``).

**A teacher with another tokenizer** (cross-tokenizer logit distillation; the rows placed by byte offsets in
:mod:`campaign_orchestrator.dataset.xtok`) adds two label-aligned keys::

    teacher_align          int64   [B, T]      0 none, 1 exact, 2 ULD group head, 3 ULD group continuation
    teacher_span_logprob   float32 [B, T]      at a head: the teacher's log-prob of the rest of its group

and its ``teacher_topk_ids`` are padded with -2 (-1: a candidate the student's vocabulary lacks, or a ULD head's).
:func:`xtok_sums` is the top-k + tail KL above at the exact positions (the teacher's candidates that are student
tokens, the rest of its mass in the tail) plus, per ULD group, a vocabulary-free term in the style of ULD
(Boizard et al. 2024): both distributions at the group's first position, each scaled by its model's probability
of the rest of the group (the chain rule over the group's later tokens: the student's from its own logits, the
teacher's stored), sorted, compared by L1 over the teacher's top-k plus one tail bucket::

    P_j = c_T p_(j)     Q_j = c_S q_(j)      (p_(j), q_(j): the j-th largest probabilities, j <= k)
    ULD = sum_j |P_j - Q_j| + |c_T (1 - sum_j p_(j)) - c_S (1 - sum_j q_(j))|

The tail bucket is the L1 of the rest lower-bounded by its mass (the teacher's tail is known only in total). With
identical vocabularies every position is exact and the sum equals :func:`topk_kl_sum`
(tests/training/test_losses_xtok.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# The alignment of a generation's top-k lists onto tokenized rows is data preparation (torch-free, in
# campaign_orchestrator.dataset.topk); re-exported here because the loss and the columns it reads are one contract.
from campaign_orchestrator.dataset.topk import TEACHER_IDS, TEACHER_LOGPROBS, AlignmentError, align_top_logprobs  # noqa: F401
from campaign_orchestrator.dataset.xtok import EXACT, TEACHER_ALIGN, TEACHER_SPAN, ULD_CONT, ULD_HEAD

IGNORE = -100
TEACHER_KEYS = frozenset({TEACHER_IDS, TEACHER_LOGPROBS, TEACHER_ALIGN, TEACHER_SPAN})
ABSENT = -2  # a padded top-k slot, in a cross-tokenizer batch (-1 there: a candidate without a student id)


# --------------------------------------------------------------------------- losses


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over positions whose label is not -100, and their count."""
    shifted = labels[:, 1:]
    flat = logits[:, :-1].float().reshape(-1, logits.size(-1))
    loss = F.cross_entropy(flat, shifted.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, int((shifted != IGNORE).sum())


EXAMPLE_WEIGHTS = "example_weights"  # the batch key of example_weights' tensor (aligned with labels)


def example_weights(labels: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``training.loss_normalization: example``: a weight per label position ``[B, T]``, aligned with ``labels``: 1
    / the number of loss labels of the example the label belongs to (0 where the label is -100, and at position 0,
    which no logit predicts), and the number of examples with a loss label. An example is a run of
    ``position_ids`` from a 0 to the next (packed rows restart them per example; a padded row's pads are a run of
    their own without labels)."""
    starts = (position_ids == 0).long()
    starts[:, 0] = 1
    seg = starts.cumsum(1)  # 1.. per row
    seg = seg + torch.arange(seg.size(0), device=seg.device).unsqueeze(1) * (seg.size(1) + 1)
    has = labels != IGNORE
    has[:, 0] = False  # the first position's label is never predicted (the shift)
    counts = torch.bincount(seg[has], minlength=int(seg.max()) + 1)
    w = torch.where(has, 1.0 / counts[seg].clamp(min=1).float(), torch.zeros((), device=labels.device))
    return w, int((counts > 0).sum())


def weighted_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy at each label position times its weight (:func:`example_weights`, aligned with
    ``labels``), summed."""
    shifted = labels[:, 1:]
    flat = logits[:, :-1].float().reshape(-1, logits.size(-1))
    loss = F.cross_entropy(flat, shifted.reshape(-1), ignore_index=IGNORE, reduction="none")
    return (loss * weights[:, 1:].reshape(-1)).sum()


def topk_kl_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
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


def topk_buckets(
    logits: torch.Tensor,
    labels: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    min_tail: float = 1e-12,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Teacher and student log-probabilities over the teacher's top-k plus one tail bucket, at the label
    positions that carry a teacher distribution: ``(log_p, log_q, valid, n)`` with ``[N, K + 1]`` tensors
    (bucket ``K`` is the tail: the mass outside the top-k) and ``valid`` False for absent ids and for a
    tail that holds no token (a top-k that covers the vocabulary). Shapes and alignment as
    :func:`topk_kl_sum`; ``min_tail`` bounds both tails away from 0 in log space."""
    if topk_ids.shape[:2] != labels.shape or topk_logprobs.shape != topk_ids.shape:
        raise ValueError(
            f"teacher top-k tensors {tuple(topk_ids.shape)} / {tuple(topk_logprobs.shape)} do not match labels "
            f"{tuple(labels.shape)} (expected [B, T, K] aligned with labels)"
        )
    vocab = logits.size(-1)
    ids = topk_ids[:, 1:].long()
    if ids.numel() and int(ids.max()) >= vocab:
        raise ValueError(f"teacher token id {int(ids.max())} is outside the student's vocabulary of {vocab}")
    valid = ids >= 0
    positions = (labels[:, 1:] != IGNORE) & valid.any(-1)
    k = ids.size(-1)
    if not bool(positions.any()):
        empty = logits.new_zeros((0, k + 1), dtype=torch.float32) + logits.sum() * 0.0
        return empty, empty, torch.zeros((0, k + 1), dtype=torch.bool, device=logits.device), 0
    log_q_all = torch.log_softmax(logits[:, :-1][positions].float(), dim=-1)  # [N, V]
    ids, lp_t, valid = ids[positions], topk_logprobs[:, 1:][positions].float(), valid[positions]
    safe_ids = ids.clamp(min=0)
    log_q_top = log_q_all.gather(-1, safe_ids)
    in_top = torch.zeros_like(log_q_all).scatter_add(-1, safe_ids, valid.to(log_q_all.dtype)) > 0
    has_tail = ~in_top.all(-1)
    # the student's tail taken directly over the tokens outside the top-k (a finite fill keeps gradients finite)
    log_q_tail = torch.logsumexp(log_q_all.masked_fill(in_top, -1e30), dim=-1).clamp(min=math.log(min_tail))
    p_top = torch.where(valid, lp_t.exp(), torch.zeros_like(lp_t))
    log_p_tail = torch.log((1.0 - p_top.sum(-1)).clamp(min=min_tail))
    log_p = torch.cat([torch.where(valid, lp_t, torch.zeros_like(lp_t)), log_p_tail[:, None]], dim=-1)
    log_q = torch.cat([log_q_top, log_q_tail[:, None]], dim=-1)
    return log_p, log_q, torch.cat([valid, has_tail[:, None]], dim=-1), int(positions.sum())


def generalized_jsd(log_p: torch.Tensor, log_q: torch.Tensor, valid: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-position generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024, eq. 1) between the
    teacher ``p`` and the student ``q`` over the buckets marked ``valid``::

        JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m),   m = beta p + (1 - beta) q

    ``beta`` 0 is the forward KL(p || q), 1 the reverse KL(q || p) (taken directly at both ends, where the
    formula degenerates); TRL's ``GKDTrainer.generalized_jsd_loss`` uses the same convention."""
    zero = torch.zeros_like(log_q)

    def kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:  # sum_valid a (log a - log b)
        return torch.where(valid, log_a.exp() * (log_a - log_b), zero).sum(-1)

    if beta <= 0.0:
        return kl(log_p, log_q)
    if beta >= 1.0:
        return kl(log_q, log_p)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * kl(log_p, log_m) + (1.0 - beta) * kl(log_q, log_m)


def generalized_jsd_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    beta: float,
    min_tail: float = 1e-12,
) -> tuple[torch.Tensor, int]:
    """Summed generalized JSD (:func:`generalized_jsd`) over label positions that carry a teacher distribution,
    on the teacher's top-k plus one tail bucket (as :func:`topk_kl_sum`, which it equals at ``beta`` 0), and
    the number of positions. With ``k`` equal to the vocabulary it is the exact divergence."""
    log_p, log_q, valid, n = topk_buckets(logits, labels, topk_ids, topk_logprobs, min_tail)
    return generalized_jsd(log_p, log_q, valid, beta).sum(), n


def uld_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    topk_logprobs: torch.Tensor,
    present: torch.Tensor,
    align: torch.Tensor,
    span: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """Summed vocabulary-free (ULD) term over the ULD groups of a cross-tokenizer batch, and the number of groups.

    ``logits`` [B, T, V]; ``labels``, ``align``, ``span`` [B, T]; ``topk_logprobs`` / ``present`` [B, T, K] (the
    teacher's sorted log-probabilities at each group head, ``present`` False on padded slots), all aligned with
    ``labels``. A group is its head (``align`` 2) and the continuations (3) that follow it in its row."""
    lab, kind = labels[:, 1:], align[:, 1:]
    labelled = lab != IGNORE
    head = (kind == ULD_HEAD) & labelled
    if not bool(head.any()):
        return logits.sum() * 0.0, 0
    member = (head | (kind == ULD_CONT)) & labelled
    vocab = logits.size(-1)
    flat = member.reshape(-1).nonzero(as_tuple=True)[0]
    log_q = torch.log_softmax(logits[:, :-1].reshape(-1, vocab)[flat].float(), dim=-1)  # [N, V], row order
    is_head = head.reshape(-1)[flat]
    group = torch.cumsum(is_head.long(), 0) - 1  # a continuation follows its head in flattened row order
    n_groups = int(is_head.sum())
    cont = ~is_head
    cont_lp = log_q[cont].gather(-1, lab.reshape(-1)[flat][cont].long()[:, None])[:, 0]
    log_c_s = torch.zeros(n_groups, dtype=log_q.dtype, device=log_q.device).index_add(0, group[cont], cont_lp)
    hsel = head.reshape(-1)
    lp_t = topk_logprobs[:, 1:].reshape(-1, topk_logprobs.size(-1))[hsel].float()  # [G, K], most likely first
    ok = present[:, 1:].reshape(-1, present.size(-1))[hsel]
    log_c_t = span[:, 1:].reshape(-1)[hsel].float()
    k = lp_t.size(-1)
    log_q_top = log_q[is_head].topk(min(k, vocab), dim=-1).values
    if log_q_top.size(-1) < k:  # a student vocabulary smaller than the teacher's top-k: zero-probability slots
        log_q_top = torch.cat([log_q_top, log_q_top.new_full((n_groups, k - log_q_top.size(-1)), -1e30)], -1)
    zero = torch.zeros_like(lp_t)
    p = torch.where(ok, lp_t.exp(), zero)
    q = torch.where(ok, log_q_top.exp(), zero)
    c_t, c_s = log_c_t.exp(), log_c_s.exp()
    tops = (c_t[:, None] * p - c_s[:, None] * q).abs().sum(-1)
    tail = (c_t * (1.0 - p.sum(-1)).clamp(min=0.0) - c_s * (1.0 - q.sum(-1)).clamp(min=0.0)).abs()
    return (tops + tail).sum(), n_groups


def xtok_sums(
    logits: torch.Tensor,
    labels: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    align: torch.Tensor,
    span: torch.Tensor,
) -> dict[str, torch.Tensor | int]:
    """Cross-tokenizer distillation sums: the top-k + tail KL at the exact positions (:func:`topk_kl_sum` on the
    teacher's candidates that are student tokens) and the ULD term per group (:func:`uld_sum`); ``kl_sum`` /
    ``kl_tokens`` are their totals (one term per exact position and per group)."""
    exact_labels = torch.where(align == EXACT, labels, torch.full_like(labels, IGNORE))
    kl, n_exact = topk_kl_sum(logits, exact_labels, topk_ids, topk_logprobs)
    uld, n_groups = uld_sum(logits, labels, topk_logprobs, topk_ids != ABSENT, align, span)
    return {"kl_sum": kl + uld, "kl_tokens": n_exact + n_groups, "exact_tokens": n_exact, "uld_groups": n_groups}


def distill_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Terms of the distillation loss in a batch (label positions with a teacher distribution; across
    tokenizers, exact positions and ULD groups); the trainer sums them over ranks and micro-batches."""
    if TEACHER_IDS not in batch:
        return 0
    labelled = batch["labels"][:, 1:] != IGNORE
    if TEACHER_ALIGN in batch:
        kind = batch[TEACHER_ALIGN][:, 1:]
        return int((labelled & ((kind == EXACT) | (kind == ULD_HEAD))).sum())
    return int((labelled & (batch[TEACHER_IDS][:, 1:, 0] >= 0)).sum())


def loss_sums(logits: torch.Tensor, batch: dict[str, torch.Tensor], distill: bool) -> dict[str, torch.Tensor | int]:
    """The per-micro-batch sums the trainer normalizes globally: CE always, KL when distilling logits (across
    tokenizers: :func:`xtok_sums`)."""
    ce, n_ce = cross_entropy_sum(logits, batch["labels"])
    out: dict[str, torch.Tensor | int] = {"ce_sum": ce, "ce_tokens": n_ce}
    if distill and TEACHER_ALIGN in batch:
        out |= xtok_sums(
            logits,
            batch["labels"],
            batch[TEACHER_IDS],
            batch[TEACHER_LOGPROBS],
            batch[TEACHER_ALIGN],
            batch[TEACHER_SPAN],
        )
    elif distill:
        kl, n_kl = topk_kl_sum(logits, batch["labels"], batch[TEACHER_IDS], batch[TEACHER_LOGPROBS])
        out |= {"kl_sum": kl, "kl_tokens": n_kl}
    return out


def mix(
    ce_sum: torch.Tensor, ce_tokens: int, kl_sum: torch.Tensor | None, kl_tokens: int, kl_weight: float
) -> torch.Tensor:
    """(1 - w) * CE / ce_tokens + w * KL / kl_tokens, with global token counts; a term without tokens drops out."""
    loss = ce_sum * ((1.0 - kl_weight) / ce_tokens if ce_tokens else 0.0)
    if kl_sum is not None:
        loss = loss + kl_sum * (kl_weight / kl_tokens if kl_tokens else 0.0)
    return loss


# --------------------------------------------------------------------------- data alignment


def teacher_topk_tensors(
    rows_ids: Sequence[Sequence[Sequence[int]]],
    rows_logprobs: Sequence[Sequence[Sequence[float]]],
    width: int,
    k: int | None = None,
    absent: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad per-row, per-position top-k lists into ``[B, width, K]`` tensors (``absent`` / 0 where absent)."""
    k = k or max((len(p) for r in rows_ids for p in r), default=1) or 1
    ids = torch.full((len(rows_ids), width, k), absent, dtype=torch.long)
    lps = torch.zeros((len(rows_ids), width, k), dtype=torch.float32)
    for b, (r_ids, r_lps) in enumerate(zip(rows_ids, rows_logprobs, strict=False)):
        for t, (p_ids, p_lps) in enumerate(zip(r_ids[:width], r_lps[:width], strict=False)):
            if p_ids:
                kk = min(k, len(p_ids))
                ids[b, t, :kk] = torch.as_tensor(list(p_ids[:kk]), dtype=torch.long)
                lps[b, t, :kk] = torch.as_tensor(list(p_lps[:kk]), dtype=torch.float32)
    return ids, lps


def teacher_batch(columns: dict, idx: list[int], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The teacher's batch tensors for dataset rows ``idx`` from their Arrow columns (``columns``: the
    ``teacher_*`` columns present, chunked arrays), laid out as the collated batch of ``shape`` ``[B, T]`` (one row
    of the rows end to end when ``B`` is 1 and ``idx`` several: padding-free collation)."""
    n, width = shape
    rows = {c: columns[c].take(idx).to_pylist() for c in columns}
    if n == 1 and len(idx) > 1:
        rows = {c: [[p for r in v for p in r]] for c, v in rows.items()}
    xtok = TEACHER_ALIGN in rows
    ids, lps = teacher_topk_tensors(rows[TEACHER_IDS], rows[TEACHER_LOGPROBS], width, absent=ABSENT if xtok else -1)
    out = {TEACHER_IDS: ids, TEACHER_LOGPROBS: lps}
    if xtok:
        align = torch.zeros((n, width), dtype=torch.long)
        span = torch.zeros((n, width), dtype=torch.float32)
        for b, (a, s) in enumerate(zip(rows[TEACHER_ALIGN], rows[TEACHER_SPAN], strict=True)):
            m = min(width, len(a))
            align[b, :m] = torch.as_tensor(a[:m], dtype=torch.long)
            span[b, :m] = torch.as_tensor(s[:m], dtype=torch.float32)
        out |= {TEACHER_ALIGN: align, TEACHER_SPAN: span}
    return out
