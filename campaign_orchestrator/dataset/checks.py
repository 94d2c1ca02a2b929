"""Checks on a tokenized dataset that block training when they fail (the tokenized_dataset asset's checks).

* :func:`stop_token_report`: every example's loss mask must end on a stop token (EOS / end of turn).
  A model whose end-of-turn token is outside the loss never learns to stop, the field's most common
  silent failure (pad set to EOS and masked with it, a collator that drops the last token, a chat
  template whose turn ends after the label span: TRL #1623, #734, #2059). Examples cut by
  ``dataset.too_long: truncate`` lose their stop token by construction: counted apart, named in the
  report, never passed silently.
* :func:`vocabulary_report`: whether a teacher's token ids mean the student's: one tokenizer (same content
  hash) and one vocabulary size; Qwen-style embeddings padded to a multiple of 64/128 make two ``vocab_size``
  figures differ for the same tokenizer, which would misalign every distribution. Logit distillation compares
  ids when it passes, and aligns the teacher's tokens by bytes otherwise (``campaign_orchestrator.dataset.xtok``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

IGNORE = -100


def last_label_tokens(labels: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """The last labelled token id of every row (``IGNORE`` for a row without labels)."""
    arr = labels.combine_chunks() if isinstance(labels, pa.ChunkedArray) else labels
    if len(arr) == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(np.int64)
    pos = np.where(values != IGNORE, np.arange(len(values)), -1)
    starts = offsets[:-1]
    nonempty = offsets[1:] > starts
    last = np.full(len(starts), -1, dtype=np.int64)
    if nonempty.any():
        last[nonempty] = np.maximum.reduceat(pos, starts[nonempty])
    return np.where(last >= 0, values[np.maximum(last, 0)], IGNORE)


def stop_token_report(table: pa.Table, stop_ids: list[int], truncated_status: str = "truncated") -> dict:
    """Per-example outcome of the stop-token check on the encoded (unpacked) examples of ``table``
    (columns ``id``, ``labels``, ``status``)."""
    last = last_label_tokens(table.column("labels"))
    ends = np.isin(last, np.asarray(stop_ids, dtype=np.int64))
    truncated = np.asarray(pc.equal(table.column("status"), truncated_status).to_numpy(zero_copy_only=False))
    missing = ~ends & ~truncated
    ids = table.column("id").to_pylist()
    return {
        "stop_token_ids": list(stop_ids),
        "examples": int(len(last)),
        "ends_on_stop_token": int(ends.sum()),
        "missing": int(missing.sum()),
        "truncated_without_stop": int((~ends & truncated).sum()),
        "missing_examples": [str(ids[i]) for i in np.flatnonzero(missing)[:5]],
        "passed": bool(missing.sum() == 0),
    }


def describe_stop_tokens(r: dict) -> str:
    if r["passed"]:
        text = f"all {r['ends_on_stop_token']:,} examples' loss ends on a stop token {r['stop_token_ids']}"
    else:
        text = (
            f"{r['missing']:,} of {r['examples']:,} examples' loss does not end on a stop token {r['stop_token_ids']} "
            f"(e.g. {', '.join(r['missing_examples'])}): the student would not learn to stop. Check the chat "
            "template (the end-of-turn token must be inside the assistant turn) and that pad is not masked as EOS"
        )
    if r["truncated_without_stop"]:
        text += (
            f"; {r['truncated_without_stop']:,} examples were cut by dataset.too_long: truncate and end without it "
            "(raise training.max_seq_len or use too_long: drop)"
        )
    return text


def _vocab(model_dir: Path) -> int | None:
    cfg = model_dir / "config.json"
    if not cfg.exists():
        return None
    c = json.loads(cfg.read_text())
    return c.get("vocab_size") or (c.get("text_config") or {}).get("vocab_size")


def vocabulary_report(teacher_dir: str | Path, student_dir: str | Path) -> dict:
    """Whether the teacher's token ids mean what the student's mean (logit distillation)."""
    from campaign_orchestrator.dataset.tokenizer_files import tokenizer_hash

    t, s = Path(teacher_dir), Path(student_dir)
    th, sh = tokenizer_hash(t), tokenizer_hash(s)
    tv, sv = _vocab(t), _vocab(s)
    reasons = []
    if th != sh:
        reasons.append(
            f"the teacher's tokenizer ({t}, hash {th[:12]}) differs from the student's ({s}, hash {sh[:12]})"
        )
    if tv is not None and sv is not None and tv != sv:
        reasons.append(
            f"vocabulary sizes differ: teacher {tv:,}, student {sv:,} (embeddings padded to another multiple "
            "misalign every top-k id); distil from a teacher with the same vocabulary size"
        )
    return {
        "teacher_tokenizer_hash": th,
        "student_tokenizer_hash": sh,
        "teacher_vocab_size": tv,
        "student_vocab_size": sv,
        "passed": not reasons,
        "reasons": reasons,
    }
