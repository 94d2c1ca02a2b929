"""Run a suite's items through a model and score them; results as rows for Parquet.

The model is any callable ``generate(prompts, max_new_tokens) -> completions`` whose items have
``text``, ``latency_s`` and ``error`` (a local model, or an HTTP endpoint): evaluation does not
care what answers, only that every compared model answers the same items with the same settings.
An item whose completion carries an ``error`` (timeout, crash, refused request) is stored with
``score`` null: it is an error, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from campaign_orchestrator.dataset.jsonl import jsonl_objects
from evaluation.gate import ItemResult
from evaluation.scorers import Scorer, build_scorer


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


class SuiteSourceError(ValueError):
    pass


def load_items(source: str, heldout_rows: list[dict], base_dir: str | Path, scorer: Scorer | None = None) -> list[dict]:
    """Items of a suite: the held-out split, or a JSONL file of {id, prompt, reference, category}.

    Every problem names the file and line (and, with ``scorer``, references it cannot score)."""
    if source == "heldout":
        items = [
            {
                "id": str(r["id"]),
                "prompt": r["prompt"],
                "reference": str(r["reference"]),
                "category": str(r.get("category") or "all"),
            }
            for r in heldout_rows
            if r.get("reference") is not None
        ]
        where = ["held-out split"] * len(items)
    else:
        p = Path(source) if Path(source).is_absolute() else Path(base_dir) / source
        if not p.exists():
            raise SuiteSourceError(
                f"evaluation suite source {source!r} not found at {p}; give `heldout` or a JSONL file"
            )
        items, where = [], []
        for n, obj in jsonl_objects(p.read_text(encoding="utf-8"), p, SuiteSourceError):
            if not isinstance(obj.get("prompt"), str) or "reference" not in obj:
                raise SuiteSourceError(
                    f"{p}:{n}: a suite item is an object with a string 'prompt' and a 'reference' "
                    "(optional 'id', 'category')"
                )
            items.append(
                {
                    "id": str(obj.get("id", n)),
                    "prompt": obj["prompt"],
                    "reference": str(obj["reference"]),
                    "category": str(obj.get("category", "all")),
                }
            )
            where.append(f"{p}:{n}")
    seen: dict[str, str] = {}
    for it, w in zip(items, where, strict=True):
        if it["id"] in seen:
            raise SuiteSourceError(f"{w}: duplicate item id {it['id']!r} (first at {seen[it['id']]})")
        seen[it["id"]] = w
        why = scorer.check_reference(it["reference"]) if scorer else None
        if why:
            raise SuiteSourceError(f"{w}: item {it['id']!r}: {why}")
    if not items:
        raise SuiteSourceError(f"evaluation suite source {source!r} has no items with a reference")
    return items


def run_suite(
    suite: str, model_name: str, items: list[dict], generate: Generate, scorer: Scorer | str, max_new_tokens: int
) -> tuple[list[ItemResult], list[dict[str, Any]]]:
    score_fn = build_scorer(scorer) if isinstance(scorer, str) else scorer
    outs = generate([it["prompt"] for it in items], max_new_tokens)
    if len(outs) != len(items):
        raise RuntimeError(f"{model_name} returned {len(outs)} completions for {len(items)} items of suite {suite}")
    results, rows = [], []
    for it, o in zip(items, outs, strict=True):
        text = o.text or ""
        score = None if o.error else score_fn(text, it["reference"])
        results.append(
            ItemResult(
                it["id"], it["category"], text, score, float(o.latency_s), o.error, it["prompt"], it["reference"]
            )
        )
        rows.append(
            {
                "suite": suite,
                "model": model_name,
                "item_id": it["id"],
                "category": it["category"],
                "prompt": it["prompt"],
                "reference": it["reference"],
                "output": text,
                "score": score,
                "latency_s": float(o.latency_s),
                "error": o.error,
            }
        )
    return results, rows


def write_item_rows(rows: list[dict], path: str | Path) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=ITEM_SCHEMA), path)
    return Path(path)


def read_item_results(path: str | Path) -> dict[str, dict[str, list[ItemResult]]]:
    """model -> suite -> item results, from an items Parquet file."""
    out: dict[str, dict[str, list[ItemResult]]] = {}
    for r in pq.read_table(path).to_pylist():
        out.setdefault(r["model"], {}).setdefault(r["suite"], []).append(
            ItemResult(
                r["item_id"],
                r["category"],
                r["output"] or "",
                r["score"],
                r["latency_s"],
                r["error"],
                r["prompt"],
                r["reference"],
            )
        )
    return out
