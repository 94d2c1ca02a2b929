"""The teacher's top-k log-probabilities on tokenized rows (logit distillation), torch-free.

A teacher generation with ``teacher.sampling.logprobs = k`` carries ``completion_token_ids``
(the ids it generated, its stop token included when it stopped) and ``top_logprobs`` (one list
of ``{token_id, token, logprob}`` per generated token; ``campaign_orchestrator/generation/rows.py``). The tokenized
dataset carries them per input position, aligned with ``input_ids``:

    teacher_topk_ids       list<list<int32>>    one list per input token, empty where the
    teacher_topk_logprobs  list<list<float32>>  teacher said nothing (prompt, template tokens)

Index ``t`` holds the teacher's distribution over the token *at* ``t`` (the loss shifts it
exactly like the labels). :func:`locate_teacher_topk` finds the teacher's completion tokens in
an assembled row and places the lists with :func:`align_top_logprobs`; the trainer
(``training.losses``) pads them into ``[B, T, K]`` tensors.

A row's lists are only placed where the row holds *exactly the tokens the teacher generated*:
the completion is re-tokenized like every other example, and a row whose completion tokens
differ from the teacher's own ids (a non-canonical tokenization, a chat template that rewrites
the answer, another tokenizer) keeps its cross-entropy labels but gets no teacher lists; it is
counted under its ``teacher_status`` instead of being silently misaligned.
"""

from __future__ import annotations

from collections.abc import Sequence

IGNORE = -100
TEACHER_IDS = "teacher_topk_ids"
TEACHER_LOGPROBS = "teacher_topk_logprobs"
TEACHER_COLUMNS = (TEACHER_IDS, TEACHER_LOGPROBS)
# Columns of a source row (the distillation set) that carry the teacher's generation.
SOURCE_TOP_LOGPROBS = "top_logprobs"
SOURCE_TOKEN_IDS = "completion_token_ids"
SOURCE_COLUMNS = (SOURCE_TOKEN_IDS, SOURCE_TOP_LOGPROBS)

# Per-example outcome of the placement (``teacher_status``); only ``aligned`` rows carry lists.
ALIGNED = "aligned"
TEACHER_STATUSES = (
    ALIGNED,
    "none",  # the example has no top-k lists (another source, or a row without logprobs)
    "no_token_ids",  # top-k entries without token ids (HTTP teachers return token text only)
    "not_found",  # the row does not hold the teacher's generated tokens where its answer is
    "count_mismatch",  # the numbers of generated ids, top-k lists and answer tokens disagree
)


class AlignmentError(ValueError):
    """A teacher generation's top-k lists cannot be placed on a tokenized row's label positions."""


def align_top_logprobs(
    labels: Sequence[int],
    top_logprobs: Sequence[Sequence[dict]],
    generated_ids: Sequence[int] | None = None,
    row: str = "",
) -> tuple[list[list[int]], list[list[float]]]:
    """Place a generation's per-token top-k lists on a tokenized row's label positions.

    ``labels`` is the row's label list (-100 on prompt tokens; the completion's tokens then EOS
    carry labels, as ``campaign_orchestrator.dataset.formatting`` writes them for the plain template). ``top_logprobs``
    holds one
    list per generated token of ``{"token_id": int, "logprob": float}``. The generation either
    includes the EOS token (one list per label position) or stopped without it (one list fewer:
    the appended EOS gets no teacher distribution). With ``generated_ids`` each paired label is
    checked against the token the teacher produced, which catches a completion whose
    re-tokenization differs from the teacher's own tokens.

    Returns ``(ids, logprobs)``, one list per input position (empty where there is no teacher
    distribution), ready for the ``teacher_topk_ids`` / ``teacher_topk_logprobs`` columns.
    """
    where = f" (row {row})" if row else ""
    positions = [i for i, lab in enumerate(labels) if lab != IGNORE]
    n, m = len(positions), len(top_logprobs)
    if m not in (n, n - 1):
        raise AlignmentError(
            f"cannot align teacher top-k{where}: the row has {n} label tokens but the generation has {m} top-k "
            f"lists (expected {n}, or {n - 1} when the teacher stopped without EOS); logit distillation needs "
            f"labels on the completion and EOS only, tokenized with the teacher's tokenizer"
        )
    if generated_ids is not None:
        if len(generated_ids) != m:
            raise AlignmentError(f"{len(generated_ids)} generated ids but {m} top-k lists{where}")
        for j, (pos, gid) in enumerate(zip(positions, generated_ids, strict=False)):
            if labels[pos] != gid:
                raise AlignmentError(
                    f"completion token {j}{where} is {labels[pos]} in the tokenized row but the teacher generated "
                    f"{gid}: the completion was re-tokenized differently, so the teacher's distributions do not "
                    f"line up; tokenize with the teacher's own token ids"
                )
    ids: list[list[int]] = [[] for _ in labels]
    lps: list[list[float]] = [[] for _ in labels]
    for pos, entries in zip(positions, top_logprobs, strict=False):
        ids[pos] = [int(e["token_id"]) for e in entries]
        lps[pos] = [float(e["logprob"]) for e in entries]
    return ids, lps


def _find(seq: Sequence[int], sub: Sequence[int], lo: int, hi: int) -> int:
    """First start ``s`` in ``lo..hi-len(sub)`` with ``seq[s:s+len(sub)] == sub``, else -1."""
    n = len(sub)
    sub = list(sub)
    for s in range(lo, hi - n + 1):
        if seq[s : s + n] == sub:
            return s
    return -1


def locate_teacher_topk(
    input_ids: Sequence[int],
    labels: Sequence[int],
    answer: tuple[int, int],
    top_logprobs: Sequence[Sequence[dict]] | None,
    generated_ids: Sequence[int] | None = None,
    row: str = "",
) -> tuple[list[list[int]] | None, list[list[float]] | None, str]:
    """The teacher lists of one full (untruncated) row, and its ``teacher_status``.

    ``answer`` is the ``[start, end)`` token span of the row's last assistant turn (the
    completion, plus the EOS the template appends). With ``generated_ids`` the teacher's tokens
    are searched in that span (its stop token included, else without it and without its list);
    without them the lists are paired with the span's label positions by count. Returns
    ``(None, None, status)`` when nothing can be placed.
    """
    if not top_logprobs:
        return None, None, "none"
    if any(e.get("token_id") is None for pos in top_logprobs for e in pos):
        return None, None, "no_token_ids"
    lo, hi = answer
    top = list(top_logprobs)
    span_labels = [IGNORE] * len(input_ids)
    if generated_ids is not None:
        gen = [int(g) for g in generated_ids]
        if len(gen) != len(top):
            return None, None, "count_mismatch"
        s = _find(input_ids, gen, lo, hi)
        if s < 0 and len(gen) > 1:  # the turn ends with another token than the teacher's stop token
            gen, top = gen[:-1], top[:-1]
            s = _find(input_ids, gen, lo, hi)
        if s < 0:
            return None, None, "not_found"
        for p in range(s, s + len(gen)):
            span_labels[p] = input_ids[p]
    else:
        gen = None
        for p in range(lo, hi):
            if labels[p] != IGNORE or p == 0:
                span_labels[p] = input_ids[p]
    try:
        ids, lps = align_top_logprobs(span_labels, top, gen, row=row)
    except AlignmentError:
        return None, None, "count_mismatch"
    return ids, lps, ALIGNED
