"""Turn teacher generations into the distillation set; every rule's drops are counted.

Rules, in the order they apply (a row is counted under the first rule that drops it):

- ``error``: the teacher produced nothing (a skipped or failed request);
- ``empty``: the completion is blank;
- ``truncated``: ``finish_reason == "length"`` (stopped on ``max_new_tokens``);
- ``length``: fewer than ``min_chars`` / more than ``max_chars`` characters (stripped), or
  more than ``max_completion_tokens`` tokens;
- ``format``: the stripped completion does not fully match ``format_regex``;
- ``scorer``: the task's scorer rates the completion below ``min_score`` against the prompt's
  reference (``no_reference`` counts rows whose prompt has none: they cannot be checked);
- ``duplicate``: the same (prompt, completion) pair was already kept.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

RULES = ("error", "empty", "truncated", "length", "format", "scorer", "no_reference", "duplicate")


@dataclass(frozen=True)
class FilterRules:
    drop_empty: bool = True
    drop_truncated: bool = True
    format_regex: str | None = None
    dedupe: bool = True
    min_chars: int = 1
    max_chars: int | None = None
    scorer: str | None = None
    min_score: float = 1.0
    max_completion_tokens: int | None = None


def filter_generations(
    rows: list[dict],
    rules: FilterRules,
    references: Mapping[str, str | None] | None = None,
    score_fn: Callable[[str, str], float] | None = None,
) -> tuple[list[dict], dict[str, int]]:
    """Keep rows that pass every rule, in input order; returns (kept, counts per rule + kept +
    input). ``references`` maps prompt id to its reference answer and ``score_fn`` is the scorer
    named by ``rules.scorer`` (``evaluation.scorers.get_scorer``; both needed by that rule)."""
    counts: Counter[str] = Counter()
    pattern = re.compile(rules.format_regex) if rules.format_regex else None
    if rules.scorer and score_fn is None:
        raise ValueError(
            f"filter rule `scorer: {rules.scorer}` needs its score function (evaluation.scorers.get_scorer)"
        )
    if rules.scorer and references is None:
        raise ValueError("filter rule `scorer` needs the prompts' references")
    seen: set[tuple[str, str]] = set()
    kept = []
    for r in rows:
        raw = r.get("completion") or ""
        text = raw.strip()
        ntok = r.get("completion_tokens")
        if r.get("error"):
            counts["error"] += 1
        elif rules.drop_empty and not text:
            counts["empty"] += 1
        elif rules.drop_truncated and r.get("finish_reason") == "length":
            counts["truncated"] += 1
        elif (
            len(text) < rules.min_chars
            or (rules.max_chars is not None and len(text) > rules.max_chars)
            or (rules.max_completion_tokens is not None and ntok is not None and ntok > rules.max_completion_tokens)
        ):
            counts["length"] += 1
        elif pattern is not None and not pattern.fullmatch(text):
            counts["format"] += 1
        elif score_fn is not None and (references or {}).get(r["id"]) is None:
            counts["no_reference"] += 1
        elif score_fn is not None and score_fn(raw, references[r["id"]]) < rules.min_score:
            counts["scorer"] += 1
        elif rules.dedupe and (r["prompt"], text) in seen:
            counts["duplicate"] += 1
        else:
            seen.add((r["prompt"], text))
            kept.append(r)
    out = {k: counts.get(k, 0) for k in RULES}
    out["kept"] = len(kept)
    out["input"] = len(rows)
    return kept, out
