"""A tokenizer's identity: the hash over its files in a model directory (``campaign.tokenizer_hash`` in every
tokenized dataset, the trainer's check that a dataset was built with the student's tokenizer, the cross-tokenizer
alignment's key).

Below every other dataset module, so that the checks, the cross-tokenizer alignment and the tokenizer itself can all
read it without importing each other (``tests/test_layers.py`` fails on an import circle)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from campaign_orchestrator.content import file_sha256

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


class TokenizationError(ValueError):
    pass


def tokenizer_hash(model_dir: str | Path) -> str:
    """Identity of a tokenizer: hash over its files present in ``model_dir``."""
    d = Path(model_dir)
    parts = [f"{n}:{file_sha256(d / n)}" for n in TOKENIZER_FILES if (d / n).exists()]
    if not parts:
        raise TokenizationError(f"no tokenizer files in {d} (expected one of {TOKENIZER_FILES})")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()
