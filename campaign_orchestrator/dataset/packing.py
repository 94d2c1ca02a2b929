"""Best-fit-decreasing packing of tokenized sequences into rows of at most ``capacity`` tokens.

Sequences are placed longest first, each into the open row whose free space is the smallest
that still fits it, or into a new row. Sizes are integers, so rows are bucketed by free space
and a length group is placed in bulk: a row with free space ``r`` takes ``r // L`` sequences of
length ``L`` in a row (after each one it is still the best fit), which is exactly what placing
them one at a time would do. Cost: O(n + distinct lengths · log capacity), no per-row scan.

``pack_rows`` turns the bins into Arrow columns with ``position_ids`` restarting at 0 for each
sequence, so ``transformers`` finds the sequence boundaries (block-diagonal causal mask for
SDPA/eager; cu_seqlens for flash-attention varlen in a flattened batch).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np
import pyarrow as pa


def pack_bfd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of indices into ``lengths``) with each bin's total ≤ ``capacity``.

    Every index appears in exactly one bin; indices inside a bin are ascending; bins are in the
    order they were opened. Raises ValueError for a length outside ``1..capacity``.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        return []
    if lens.min() < 1 or lens.max() > capacity:
        raise ValueError(f"sequence lengths must be in 1..{capacity}, got {int(lens.min())}..{int(lens.max())}")
    order = np.argsort(-lens, kind="stable")
    sorted_lens = lens[order]
    # group boundaries of equal lengths (descending)
    cuts = np.flatnonzero(np.diff(sorted_lens)) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [lens.size]))
    bins: list[list[int]] = []
    by_free: dict[int, list[int]] = {}  # free space -> bin ids (LIFO)
    free_values: list[int] = []  # sorted free-space values that have bins

    def add(b: int, free: int) -> None:
        lst = by_free.get(free)
        if lst is None:
            by_free[free] = [b]
            insort(free_values, free)
        else:
            lst.append(b)

    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        length = int(sorted_lens[s])
        items = order[s:e].tolist()
        pos = 0
        while pos < len(items):
            j = bisect_left(free_values, length)
            if j == len(free_values):  # no open bin fits: open new ones, each filled with capacity // L items
                k = capacity // length
                first = len(bins)
                bins += [items[q : q + k] for q in range(pos, len(items), k)]
                full, rest = divmod(len(items) - pos, k)
                left = capacity - k * length
                if left > 0 and full:  # the full new bins all have the same free space
                    if left in by_free:
                        by_free[left] += range(first, first + full)
                    else:
                        by_free[left] = list(range(first, first + full))
                        insort(free_values, left)
                if rest:
                    add(len(bins) - 1, capacity - rest * length)
                break
            free = free_values[j]
            lst = by_free[free]
            b = lst.pop()
            if not lst:
                del by_free[free]
                free_values.pop(j)
            k = min(free // length, len(items) - pos)
            bins[b] += items[pos : pos + k]
            pos += k
            left = free - k * length
            if left > 0:
                add(b, left)
    for b in bins:
        b.sort()
    return bins


def pack_bfd_reference(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """One-at-a-time best-fit-decreasing (O(n · bins)); the specification ``pack_bfd`` must match."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        fits = [b for b in range(len(bins)) if free[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda x: free[x])
        else:
            bins.append([])
            free.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        free[b] -= lengths[i]
    return [sorted(b) for b in bins]


def _flat(arr: pa.ChunkedArray | pa.Array) -> pa.ListArray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr


TOKEN_ALIGNED = (
    "teacher_topk_ids",
    "teacher_topk_logprobs",
    "teacher_align",
    "teacher_span_logprob",
)  # one entry per input token (campaign_orchestrator.dataset.topk, campaign_orchestrator.dataset.xtok)


def pack_rows(examples: pa.Table, bins: list[list[int]]) -> pa.Table:
    """Rows built from ``bins`` over ``examples`` (columns id, input_ids, labels, and the teacher's
    per-token top-k lists when present).

    Output columns: input_ids, labels, position_ids (list<int32>), num_tokens, num_loss_tokens
    (int32), example_ids (list<string>), plus teacher_topk_ids / teacher_topk_logprobs (and a teacher of another
    tokenizer's teacher_align / teacher_span_logprob) when the examples have them. Each row is its bins'
    sequences back to back; a per-token column is laid out with exactly the offsets of input_ids, so its entry
    ``t`` belongs to token ``t``.
    """
    flat_order = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=sum(len(b) for b in bins))
    aligned = [c for c in TOKEN_ALIGNED if c in examples.column_names]
    taken = examples.select(["id", "input_ids", "labels", *aligned]).take(pa.array(flat_order))
    ids = _flat(taken.column("input_ids"))
    labels = _flat(taken.column("labels"))
    seq_lens = np.diff(ids.offsets.to_numpy()).astype(np.int64)
    bin_sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    bin_starts = np.concatenate(([0], np.cumsum(bin_sizes)))  # in sequences
    seq_starts = np.concatenate(([0], np.cumsum(seq_lens)))  # in tokens
    row_offsets = seq_starts[bin_starts].astype(np.int32)
    total = int(seq_starts[-1])
    positions = (np.arange(total, dtype=np.int64) - np.repeat(seq_starts[:-1], seq_lens)).astype(np.int32)
    id_values = ids.flatten().cast(pa.int32())
    label_values = labels.flatten().cast(pa.int32())
    offs = pa.array(row_offsets, type=pa.int32())
    label_np = label_values.to_numpy()
    loss_per_row = np.add.reduceat((label_np != -100).astype(np.int64), row_offsets[:-1]) if total else np.zeros(0)
    # reduceat on an empty trailing segment is not possible: bins are never empty, rows never empty
    example_offsets = pa.array(bin_starts.astype(np.int32), type=pa.int32())
    per_token = {}
    for c in aligned:
        col = _flat(taken.column(c))
        if not np.array_equal(np.diff(col.offsets.to_numpy()), seq_lens):
            raise ValueError(f"column {c} does not have one entry per input token in every example")
        per_token[c] = pa.ListArray.from_arrays(offs, col.flatten())
    return pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offs, id_values),
            "labels": pa.ListArray.from_arrays(offs, label_values),
            "position_ids": pa.ListArray.from_arrays(offs, pa.array(positions, type=pa.int32())),
            "num_tokens": pa.array(np.diff(row_offsets).astype(np.int32), type=pa.int32()),
            "num_loss_tokens": pa.array(loss_per_row.astype(np.int32), type=pa.int32()),
            "example_ids": pa.ListArray.from_arrays(example_offsets, _flat(taken.column("id")).cast(pa.string())),
            **per_token,
        }
    )
