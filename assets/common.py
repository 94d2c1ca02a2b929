"""Helpers shared by the stage asset factories: keys, model dependencies, costs, metadata."""

from pathlib import Path
from typing import Any

from dagster import AssetKey, MetadataValue

from campaigns.spec import CampaignSpec
from campaigns import paths
from campaign_orchestrator.content import HashCache, model_fingerprint, short, value_sha256
from campaign_orchestrator.demo import recipe

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

DEMO_GROUP = "demo_models"


def key(spec: CampaignSpec, stage: str) -> AssetKey:
    return AssetKey([spec.name, stage])


def demo_model_key(ref: str) -> AssetKey:
    return AssetKey([DEMO_GROUP, ref.removeprefix(recipe.PREFIX)])


def model_deps(*refs: str) -> list[AssetKey]:
    """Asset keys of the demo models a stage reads (other models are plain paths)."""
    return sorted({demo_model_key(r) for r in refs if recipe.is_demo_ref(r)}, key=lambda k: k.path)


def stage_key(*parts: Any) -> str:
    return short(value_sha256(list(parts)), 20)


def model_identity(path: Path, revision: str | None = None) -> str:
    """Content fingerprint of a model directory (every byte; each file version read once, digests kept
    in the per-user hash cache), plus its revision."""
    return f"{model_fingerprint(path, HashCache(paths.hash_cache_file()))}@{revision or ''}"


def usd(lines: list[dict]) -> float:
    return float(sum(line["usd"] for line in lines))


def base_metadata(manifest: dict, cached: bool) -> dict[str, Any]:
    md: dict[str, Any] = {
        "path": MetadataValue.path(manifest["path"]),
        "content_key": manifest["key"],
        "cached": cached,
        "wall_seconds": float(manifest.get("wall_seconds", 0.0)),
        "cost_usd": usd(manifest.get("cost_lines", [])),
        "spent_this_run_usd": 0.0 if cached else usd(manifest.get("cost_lines", [])),
    }
    return md
