"""Shared bits of the teacher benchmarks (prompts, load average, JSON output); not a benchmark."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def prompts(n: int, seed: int = 2024) -> list[dict]:
    from campaign_orchestrator.demo import cipher

    return [
        {"id": it["id"], "prompt": it["prompt"], "reference": it["reference"]}
        for it in cipher.items(n, seed=seed, id_prefix="b")
    ]


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def emit(result: dict) -> int:
    result["cpu_count"] = os.cpu_count()
    print(json.dumps(result, indent=2))
    return 0 if result.get("pass", True) else 1
