"""Shared bits of the dataset benchmarks: demo-like pairs, the demo student, load average, JSON out."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def demo_student() -> Path:
    from campaign_orchestrator.demo.recipe import resolve

    root = Path(os.environ.get("CAMPAIGN_TEST_MODELS_ROOT", REPO / "artifacts"))
    path = resolve("@demo/student", root)
    if not (path / "tokenizer.json").exists():
        raise SystemExit(f"demo student not built at {path}; run `python -m campaign_app.cli build-models` first")
    return path


def demo_pairs(n: int, seed: int = 2024) -> list[dict]:
    """Prompt/completion pairs with the demo's length mix (cipher words of 3-8 letters)."""
    from campaign_orchestrator.demo import cipher

    return [
        {"id": it["id"], "prompt": it["prompt"], "completion": " " + it["reference"]}
        for it in cipher.items(n, seed=seed, id_prefix="b")
    ]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def emit(result: dict) -> int:
    result["cpu_count"] = len(os.sched_getaffinity(0))
    print(json.dumps(result, indent=2))
    return 0 if result.get("pass", True) else 1
