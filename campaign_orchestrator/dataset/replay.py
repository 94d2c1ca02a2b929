"""Self-replay (``data.replay``): which general prompts join the training mix, and their answered rows.

Plain logic; the asset (``assets/distillation_set.py``) has them answered (the base student through the local
engine and the generation cache, the teacher through its backend, or a file) and passes the rows here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

REPLAY_PREFIX = "replay:"  # the id prefix that labels a replay example in the distillation set and the dataset


def replay_count(task_examples: int, share: float, available: int) -> int:
    """Replay examples for ``share`` of the mix: ``share / (1 - share) x task_examples``, at most ``available``."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"data.replay.share must be in (0, 1), got {share}")
    return min(available, max(1, round(share / (1.0 - share) * task_examples)))


def read_prompts(path: str | Path) -> list[dict]:
    """``{id, prompt}`` rows of a JSONL file, in id order (an id is the prompt's position when absent)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                r = json.loads(line)
                if "prompt" not in r:
                    raise ValueError(f"{path}: line {i + 1} has no `prompt` field (data.replay.source)")
                rows.append({"id": str(r.get("id", i)), "prompt": r["prompt"], "category": r.get("category")})
    return sorted(rows, key=lambda r: r["id"])


def file_rows(prompts: Sequence[dict], answers_path: str | Path) -> list[dict]:
    """Generation-shaped rows for ``prompts`` from a JSONL of ``prompt`` and ``completion`` (``answered_by: file``);
    a prompt without an answer there is an error naming it."""
    answers = {}
    with open(answers_path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                answers[r["prompt"]] = r["completion"]
    missing = [p["prompt"] for p in prompts if p["prompt"] not in answers]
    if missing:
        raise ValueError(
            f"{answers_path}: no completion for {len(missing)} replay prompt(s), e.g. {missing[0]!r} "
            "(data.replay.answers must answer every prompt of data.replay.source)"
        )
    return [
        {
            "id": p["id"],
            "sample_index": 0,
            "prompt": p["prompt"],
            "completion": answers[p["prompt"]],
            "finish_reason": "stop",
            "error": None,
            "completion_tokens": None,
        }
        for p in prompts
    ]


def label(rows: Sequence[dict]) -> list[dict]:
    """The rows with ``replay:``-prefixed ids (how the trainer and the lineage tell them from task rows)."""
    return [dict(r, id=f"{REPLAY_PREFIX}{r['id']}") for r in rows]
