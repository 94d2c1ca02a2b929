"""Read a campaign's prompt source (JSONL files, a glob) and split it into train and held-out.

Every bad input is a :class:`PromptSourceError` that names the file and line. The split is
deterministic: an item is held out when the hash of (seed, id) falls under the fraction, so
adding new prompt files never moves existing items between the splits.
"""

from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from campaign_orchestrator.dataset.jsonl import jsonl_objects

PROMPT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt", pa.string()),
        ("reference", pa.string()),
        ("category", pa.string()),
        ("source_file", pa.string()),
    ]
)


class PromptSourceError(ValueError):
    pass


@dataclass(frozen=True)
class SourceFields:
    id: str = "id"
    prompt: str = "prompt"
    reference: str = "reference"
    category: str = "category"


def source_files(pattern: str, base_dir: str | Path) -> list[Path]:
    p = Path(pattern)
    full = str(p if p.is_absolute() else Path(base_dir) / p)
    files = sorted(Path(f) for f in glob.glob(full, recursive=True) if Path(f).is_file())
    if not files:
        raise PromptSourceError(f"data.source {pattern!r}: no files match {full!r}; check the path or glob")
    return files


def read_prompts(files: list[Path], fields: SourceFields = SourceFields()) -> list[dict]:
    """Rows with id, prompt, reference (may be None), category (default 'all'), source_file."""
    rows: list[dict] = []
    seen: dict[str, str] = {}
    for f in files:
        try:
            text = f.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            line = f.read_bytes()[: e.start].count(b"\n") + 1
            raise PromptSourceError(f"{f}:{line}: not valid UTF-8 ({e.reason}); re-encode the file as UTF-8") from None
        for n, obj in jsonl_objects(text, f, PromptSourceError):
            prompt = obj.get(fields.prompt)
            if not isinstance(prompt, str) or not prompt.strip():
                raise PromptSourceError(f"{f}:{n}: field {fields.prompt!r} must be a non-empty string, got {prompt!r}")
            pid = obj.get(fields.id)
            pid = str(pid) if pid is not None else hashlib.sha256(prompt.encode()).hexdigest()[:16]
            if pid in seen:
                raise PromptSourceError(f"{f}:{n}: duplicate id {pid!r} (first seen in {seen[pid]})")
            seen[pid] = f"{f}:{n}"
            ref = obj.get(fields.reference)
            cat = obj.get(fields.category)
            rows.append(
                {
                    "id": pid,
                    "prompt": prompt,
                    "reference": None if ref is None else str(ref),
                    "category": "all" if cat is None else str(cat),
                    "source_file": f.name,
                }
            )
    if not rows:
        raise PromptSourceError(f"no prompts in {[str(f) for f in files]}: the source is empty")
    return rows


def is_heldout(item_id: str, fraction: float, seed: int) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{item_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def split(rows: list[dict], fraction: float, seed: int, max_items: int | None = None) -> tuple[list[dict], list[dict]]:
    """(train, heldout); held-out items need a reference and are capped at ``max_items``."""
    train, held = [], []
    for r in rows:
        (held if is_heldout(r["id"], fraction, seed) and r["reference"] is not None else train).append(r)
    if max_items is not None and len(held) > max_items:
        held.sort(key=lambda r: hashlib.sha256(f"{seed}:{r['id']}".encode()).hexdigest())
        held, extra = held[:max_items], held[max_items:]
        train += extra
    return train, held


def _hash_order(r: dict, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{r['id']}".encode()).hexdigest()


def fresh_heldout(
    rows: list[dict],
    fraction: float,
    seed: int,
    seen: set[str],
    seen_heldout: set[str],
    newest_first: list[str],
    max_items: int | None = None,
    min_items: int = 0,
) -> tuple[list[dict], list[dict]]:
    """Held-out items for re-scoring a model whose data was the ids ``seen`` (for drift).

    ``split`` is not used: with ``max_items`` it keeps items in hash order over the whole source,
    so new files hardly get in. Here the held-out rows (same hash rule) of ids the model never saw
    come first, newest file first (``newest_first``: file names; then hash order), capped at
    ``max_items``. When fewer than ``min_items``, they are topped up to ``min_items`` with the
    model's own held-out items (``seen_heldout``, never trained on), newest file first. A seen id
    outside ``seen_heldout`` (trained on, e.g. moved to train by the cap) is never returned.
    Returns (fresh, topped_up)."""
    rank = {name: i for i, name in enumerate(newest_first)}

    def order(r: dict) -> tuple[int, str]:
        return rank.get(r["source_file"], len(rank)), _hash_order(r, seed)

    fresh = sorted(
        (r for r in rows if r["id"] not in seen and r["reference"] is not None and is_heldout(r["id"], fraction, seed)),
        key=order,
    )
    fresh = fresh[:max_items] if max_items is not None else fresh
    need = min_items if max_items is None else min(min_items, max_items)
    if len(fresh) >= need:
        return fresh, []
    earlier = sorted((r for r in rows if r["id"] in seen_heldout and r["reference"] is not None), key=order)
    return fresh, earlier[: need - len(fresh)]


def write_prompts(rows: list[dict], path: str | Path) -> Path:
    table = pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
    pq.write_table(table, path)
    return Path(path)


def read_prompt_table(path: str | Path) -> list[dict]:
    return pq.read_table(path).to_pylist()
