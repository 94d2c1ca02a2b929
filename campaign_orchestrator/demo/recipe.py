"""What the demo models are, as data, and where they live. Pure Python (no torch).

A model reference ``@demo/teacher`` or ``@demo/student`` resolves to
``<artifact_root>/models/demo-<recipe hash>/<name>``; changing the recipe changes the hash,
so a stale model is never reused. ``@demo/moe_student`` (a tiny Qwen3-MoE) has a recipe and a
hash of its own, ``<artifact_root>/models/demo-moe-<moe recipe hash>/moe_student``: adding it did
not rebuild the others, and changing it never rebuilds them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

RECIPE = {
    "version": 1,
    "tokenizer": {
        "kind": "char-bpe",
        "special_tokens": ["<pad>", "<s>", "</s>", "<unk>"],
        "corpus_items": 4000,
        "seed": 11,
    },
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

# The mixture-of-experts student: a Qwen3-MoE built from a config with the demo tokenizer (the same
# recipe, so it shares the teacher's vocabulary) and trained on the identity mapping like the demo
# student. Every layer is sparse (as in Qwen3-30B-A3B): 4 routed experts, top-2, so its total MLP
# width (4 × 48) equals the dense student's 192 and its active width is half of it.
MOE_RECIPE = {
    "version": 1,
    "tokenizer": RECIPE["tokenizer"],
    "max_position_embeddings": RECIPE["max_position_embeddings"],
    "moe_student": {
        "mapping": "identity",
        "architecture": "qwen3_moe",
        "config": {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "intermediate_size": 192,
            "router_aux_loss_coef": 0.001,
        },
        "steps": 200,
        "batch_size": 64,
        "lr": 3e-3,
        "seed": 3,
    },
    "eval_items": 200,
}

# A second teacher of the same cipher with another tokenizer: byte-level BPE (every byte is a token, so any
# text encodes) trained with ``tokenizers`` on the task's text, whose merges join the space and the first letter
# of an answer and frequent letter pairs, so its tokens straddle the student's character tokens: the student of
# campaigns/demo_xtok.yaml learns from it by cross-tokenizer logit distillation (campaign_orchestrator.dataset.xtok).
XTOK_RECIPE = {
    "version": 1,
    "tokenizer": {
        "kind": "byte-bpe",
        "special_tokens": ["<pad>", "<s>", "</s>", "<unk>"],
        "vocab_size": 600,
        "corpus_items": 4000,
        "seed": 13,
    },
    "max_position_embeddings": RECIPE["max_position_embeddings"],
    "teacher_bpe": {
        "mapping": "cipher",
        "config": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3, "num_attention_heads": 4},
        "steps": 900,
        "batch_size": 64,
        "lr": 3e-3,
        "seed": 4,
    },
    "eval_items": 200,
}

MODEL_NAMES = ("teacher", "student", "moe_student", "teacher_bpe")
MOE_NAMES = ("moe_student",)
XTOK_NAMES = ("teacher_bpe",)
PREFIX = "@demo/"


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12]


def moe_recipe_hash() -> str:
    return hashlib.sha256(json.dumps(MOE_RECIPE, sort_keys=True).encode()).hexdigest()[:12]


def models_dir(artifact_root: str | Path) -> Path:
    """The teacher's and the student's directory (one recipe, one hash)."""
    return Path(artifact_root) / "models" / f"demo-{recipe_hash()}"


def xtok_recipe_hash() -> str:
    return hashlib.sha256(json.dumps(XTOK_RECIPE, sort_keys=True).encode()).hexdigest()[:12]


def xtok_models_dir(artifact_root: str | Path) -> Path:
    """The byte-level BPE teacher's directory (its own recipe and hash)."""
    return Path(artifact_root) / "models" / f"demo-xtok-{xtok_recipe_hash()}"


def moe_models_dir(artifact_root: str | Path) -> Path:
    """The MoE student's directory (its own recipe and hash)."""
    return Path(artifact_root) / "models" / f"demo-moe-{moe_recipe_hash()}"


def model_dirs(artifact_root: str | Path) -> list[Path]:
    """Every demo build directory of the current recipes (built or not)."""
    return [models_dir(artifact_root), moe_models_dir(artifact_root), xtok_models_dir(artifact_root)]


def is_demo_ref(ref: str) -> bool:
    return ref.startswith(PREFIX)


def resolve(ref: str, artifact_root: str | Path) -> Path:
    """Filesystem path of a demo model reference; raises ValueError for an unknown name."""
    name = ref[len(PREFIX) :]
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown demo model {ref!r}; expected one of {[PREFIX + n for n in MODEL_NAMES]}")
    if name in MOE_NAMES:
        return moe_models_dir(artifact_root) / name
    return (xtok_models_dir(artifact_root) if name in XTOK_NAMES else models_dir(artifact_root)) / name


def cached_report(artifact_root: str | Path) -> dict | None:
    """The build report of the dense demo models already built under ``artifact_root`` (None: not built)."""
    d = models_dir(artifact_root)
    if not (d / "_SUCCESS").exists():
        return None
    return json.loads((d / "build_report.json").read_text()) | {"cached": True}
