"""What the demo models are, as data, and where they live. Pure Python (no torch).

A model reference ``@demo/teacher`` or ``@demo/student`` resolves to
``<artifact_root>/models/demo-<recipe hash>/<name>``; changing the recipe changes the hash,
so a stale model is never reused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

RECIPE = {
    "version": 1,
    "tokenizer": {"kind": "char-bpe", "special_tokens": ["<pad>", "<s>", "</s>", "<unk>"], "corpus_items": 4000, "seed": 11},
    "teacher": {
        "mapping": "cipher",
        "config": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3, "num_attention_heads": 4},
        "steps": 700,
        "batch_size": 64,
        "lr": 3e-3,
        "seed": 1,
    },
    "student": {
        "mapping": "identity",
        "config": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4},
        "steps": 600,
        "batch_size": 64,
        "lr": 3e-3,
        "seed": 2,
    },
    "max_position_embeddings": 64,
    "eval_items": 200,
}

MODEL_NAMES = ("teacher", "student")
PREFIX = "@demo/"


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12]


def models_dir(artifact_root: str | Path) -> Path:
    return Path(artifact_root) / "models" / f"demo-{recipe_hash()}"


def is_demo_ref(ref: str) -> bool:
    return ref.startswith(PREFIX)


def resolve(ref: str, artifact_root: str | Path) -> Path:
    """Filesystem path of a demo model reference; raises ValueError for an unknown name."""
    name = ref[len(PREFIX):]
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown demo model {ref!r}; expected one of {[PREFIX + n for n in MODEL_NAMES]}")
    return models_dir(artifact_root) / name


def cached_report(artifact_root: str | Path) -> dict | None:
    """The build report of the demo models already built under ``artifact_root`` (None: not built)."""
    d = models_dir(artifact_root)
    if not (d / "_SUCCESS").exists():
        return None
    return json.loads((d / "build_report.json").read_text()) | {"cached": True}
