"""Run a suite's items through a model and score them; results as rows for Parquet.

The model is any callable ``generate(prompts, max_new_tokens) -> completions`` whose items have
``text``, ``latency_s`` and ``error`` (local model, or an HTTP endpoint): evaluation does not
care what answers, only that every compared model answers the same items with the same settings.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from evaluation.gate import ItemResult
from evaluation.scorers import get_scorer


class CompletionLike(Protocol):
    text: str
    latency_s: float
    error: str | None


Generate = Callable[[Sequence[str], int], Sequence[CompletionLike]]

ITEM_SCHEMA = pa.schema(
    [
        ("suite", pa.string()),
        ("model", pa.string()),
        ("item_id", pa.string()),
        ("category", pa.string()),
        ("prompt", pa.string()),
        ("reference", pa.string()),
        ("output", pa.string()),
        ("score", pa.float64()),
        ("latency_s", pa.float64()),
        ("error", pa.string()),
    ]
)


def load_items(source: str, heldout_rows: list[dict], base_dir: str | Path) -> list[dict]:
    """Items of a suite: the held-out split, or a JSONL file of {id, prompt, reference, category}."""
    if source == "heldout":
        return [r for r in heldout_rows if r.get("reference") is not None]
    p = Path(source) if Path(source).is_absolute() else Path(base_dir) / source
    if not p.exists():
        raise FileNotFoundError(f"evaluation suite source {source!r} not found at {p}")
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            obj = json.loads(line)
            if "prompt" not in obj or "reference" not in obj:
                raise ValueError(f"{p}:{n}: a suite item needs 'prompt' and 'reference'")
            out.append({"id": str(obj.get("id", n)), "prompt": obj["prompt"], "reference": str(obj["reference"]),
                        "category": str(obj.get("category", "all"))})
    return out


def run_suite(suite: str, model_name: str, items: list[dict], generate: Generate, scorer: str,
              max_new_tokens: int) -> tuple[list[ItemResult], list[dict[str, Any]]]:
    score_fn = get_scorer(scorer)
    outs = generate([it["prompt"] for it in items], max_new_tokens)
    results, rows = [], []
    for it, o in zip(items, outs, strict=True):
        score = None if o.error else score_fn(o.text, it["reference"])
        results.append(ItemResult(it["id"], it["category"], o.text, score, o.latency_s, o.error))
        rows.append({"suite": suite, "model": model_name, "item_id": it["id"], "category": it["category"],
                     "prompt": it["prompt"], "reference": it["reference"], "output": o.text, "score": score,
                     "latency_s": o.latency_s, "error": o.error})
    return results, rows


def write_item_rows(rows: list[dict], path: str | Path) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=ITEM_SCHEMA), path)
    return Path(path)
