"""Pre-tokenize prompt/completion pairs into Parquet the trainer streams without a tokenizer.

Schema (one row per training sequence):
  input_ids, labels, position_ids: list<int32>   labels are -100 on prompt tokens
  num_loss_tokens: int32                          tokens with a label
  example_ids: list<string>                       source examples in the row
File metadata (``campaign.*`` keys) records the tokenizer hash, template, max length and the
source hash, so a dataset built with another tokenizer is refused by the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lineage.hashing import file_sha256

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

ROW_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("position_ids", pa.list_(pa.int32())),
        ("num_loss_tokens", pa.int32()),
        ("example_ids", pa.list_(pa.string())),
    ]
)


class TokenizationError(ValueError):
    pass


def tokenizer_hash(model_dir: str | Path) -> str:
    """Identity of a tokenizer: hash over its files present in ``model_dir``."""
    d = Path(model_dir)
    parts = [f"{n}:{file_sha256(d / n)}" for n in TOKENIZER_FILES if (d / n).exists()]
    if not parts:
        raise TokenizationError(f"no tokenizer files in {d} (expected one of {TOKENIZER_FILES})")
    import hashlib

    return hashlib.sha256("|".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class TokenizeResult:
    rows: int
    examples_in: int
    examples_out: int
    dropped_too_long: int
    total_tokens: int
    loss_tokens: int


def encode_pair(tok, prompt: str, completion: str, train_on_prompt: bool = False) -> tuple[list[int], list[int]]:
    """``<bos> prompt completion <eos>``; labels cover the completion and EOS only."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    c = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    ids = bos + p + c
    labels = (ids[:-len(c)] if train_on_prompt else [-100] * (len(bos) + len(p))) + c
    if train_on_prompt and bos:
        labels[0] = -100
    return ids, labels


def tokenize_pairs(
    tokenizer_dir: str | Path,
    pairs: Sequence[dict],
    out_path: str | Path,
    max_seq_len: int,
    extra_metadata: dict[str, str] | None = None,
) -> TokenizeResult:
    """Tokenize ``pairs`` (dicts with id, prompt, completion) into one Parquet file."""
    from transformers import AutoTokenizer

    if not pairs:
        raise TokenizationError("the distillation set is empty: nothing to tokenize (check the filter counts)")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cols: dict[str, list] = {n: [] for n in ROW_SCHEMA.names}
    dropped = total = loss = 0
    for ex in pairs:
        ids, labels = encode_pair(tok, ex["prompt"], ex["completion"])
        if len(ids) > max_seq_len:
            dropped += 1
            continue
        n_loss = sum(1 for x in labels if x != -100)
        cols["input_ids"].append(ids)
        cols["labels"].append(labels)
        cols["position_ids"].append(list(range(len(ids))))
        cols["num_loss_tokens"].append(n_loss)
        cols["example_ids"].append([ex["id"]])
        total += len(ids)
        loss += n_loss
    if not cols["input_ids"]:
        raise TokenizationError(f"every example is longer than max_seq_len={max_seq_len}; raise training.max_seq_len")
    meta = {
        "campaign.tokenizer_hash": tokenizer_hash(tokenizer_dir),
        "campaign.template": "plain: <bos> prompt completion <eos>",
        "campaign.max_seq_len": str(max_seq_len),
        "campaign.packing": "none",
        **(extra_metadata or {}),
    }
    table = pa.Table.from_pydict(cols, schema=ROW_SCHEMA.with_metadata({k: v for k, v in meta.items()}))
    pq.write_table(table, out_path)
    return TokenizeResult(
        rows=len(cols["input_ids"]),
        examples_in=len(pairs),
        examples_out=len(cols["input_ids"]),
        dropped_too_long=dropped,
        total_tokens=total,
        loss_tokens=loss,
    )


def dataset_metadata(path: str | Path) -> dict[str, str]:
    md = pq.read_schema(path).metadata or {}
    return {k.decode(): v.decode() for k, v in md.items() if k.startswith(b"campaign.")}


def length_histogram(lengths: Sequence[int], bins: int = 8) -> str:
    """A markdown table of sequence lengths (for the UI)."""
    if not lengths:
        return ""
    lo, hi = min(lengths), max(lengths)
    width = max(1, -(-(hi - lo + 1) // bins))
    counts: dict[int, int] = {}
    for n in lengths:
        b = (n - lo) // width
        counts[b] = counts.get(b, 0) + 1
    top = max(counts.values())
    lines = ["| tokens | rows | |", "|---|---:|---|"]
    for b in sorted(counts):
        lines.append(f"| {lo + b * width}–{lo + (b + 1) * width - 1} | {counts[b]} | {'█' * max(1, round(20 * counts[b] / top))} |")
    return "\n".join(lines)


def describe(path: str | Path) -> str:
    return json.dumps(dataset_metadata(path), indent=2)
