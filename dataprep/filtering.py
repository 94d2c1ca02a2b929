"""Turn teacher generations into the distillation set; every rule's drops are counted."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class FilterRules:
    drop_empty: bool = True
    drop_truncated: bool = True
    format_regex: str | None = None
    dedupe: bool = True
    min_chars: int = 1
    max_chars: int | None = None


def filter_generations(rows: list[dict], rules: FilterRules) -> tuple[list[dict], dict[str, int]]:
    """Keep rows that pass every rule, in input order. Rules apply in the order listed in
    the returned counts; a row is counted under the first rule that drops it."""
    counts: Counter[str] = Counter()
    pattern = re.compile(rules.format_regex) if rules.format_regex else None
    seen: set[tuple[str, str]] = set()
    kept = []
    for r in rows:
        text = (r.get("completion") or "").strip()
        if r.get("error"):
            counts["error"] += 1
        elif rules.drop_empty and not text:
            counts["empty"] += 1
        elif rules.drop_truncated and r.get("finish_reason") == "length":
            counts["truncated"] += 1
        elif len(text) < rules.min_chars or (rules.max_chars is not None and len(text) > rules.max_chars):
            counts["length"] += 1
        elif pattern is not None and not pattern.fullmatch(text):
            counts["format"] += 1
        elif rules.dedupe and (r["prompt"], text) in seen:
            counts["duplicate"] += 1
        else:
            seen.add((r["prompt"], text))
            kept.append(r)
    out = {k: counts.get(k, 0) for k in ("error", "empty", "truncated", "length", "format", "duplicate")}
    out["kept"] = len(kept)
    out["input"] = len(rows)
    return kept, out
