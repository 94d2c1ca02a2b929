"""What every stage shares: the content key of a stage directory, a model's content identity, the stage names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from campaign_orchestrator import content
from campaign_orchestrator.content import HashCache, model_fingerprint
from campaigns import paths

# A campaign's stages in pipeline order (the asset keys of its graph, and the ledger's ``asset`` names).
STAGES = (
    "prompts",
    "teacher_generations",
    "distillation_set",
    "tokenized_dataset",
    "student_adapter",
    "evaluation",
    "promoted_model",
    "campaign_cost",
)


def stage_key(*parts: Any) -> str:
    """A stage directory's content key: the first 20 hex digits of the sha256 of ``parts`` (never change it: every
    stored artifact is found by it; tests/stages/test_content_keys.py holds the shipped campaigns' keys). Its inputs
    hold resolved values, never ``auto``: :func:`campaign_orchestrator.content.stage_key` warns on one."""
    return content.stage_key(*parts)


def model_identity(path: Path, revision: str | None = None) -> str:
    """Content fingerprint of a model directory (every byte; each file version read once, digests kept
    in the per-user hash cache), plus its revision."""
    return f"{model_fingerprint(path, HashCache(paths.hash_cache_file()))}@{revision or ''}"


def usd(lines: list[dict]) -> float:
    return float(sum(line["usd"] for line in lines))


def demo_model_name(ref: str) -> str | None:
    """The demo model a campaign's model reference names (``@demo/<name>``: ``<name>``), None for any other model."""
    from campaign_orchestrator.demo import recipe

    return ref.removeprefix(recipe.PREFIX) if recipe.is_demo_ref(ref) else None
