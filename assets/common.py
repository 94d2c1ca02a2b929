"""Helpers shared by the stage asset factories: keys, model dependencies, costs, metadata."""

from pathlib import Path
from typing import Any

from dagster import AssetKey, MetadataValue

from campaign_orchestrator import content
from campaign_orchestrator.content import HashCache, model_fingerprint
from campaign_orchestrator.demo import recipe
from campaigns import paths
from campaigns.spec import CampaignSpec

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
    return content.stage_key(*parts)  # warns when an input holds `auto` (campaign_orchestrator/content.py)


def model_identity(path: Path, revision: str | None = None) -> str:
    """Content fingerprint of a model directory (every byte; each file version read once, digests kept
    in the per-user hash cache), plus its revision."""
    return f"{model_fingerprint(path, HashCache(paths.hash_cache_file()))}@{revision or ''}"


def usd(lines: list[dict]) -> float:
    return float(sum(line["usd"] for line in lines))


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def for_people(md: dict[str, Any]) -> dict[str, Any]:
    """Metadata with its plain floats rounded for reading in the UI (the manifests and report files keep the raw
    values programs read): seconds to 0.1 s, scores, ratios and fractions to 4 decimals, dollars and the rest to
    4 significant digits. Other values (text, markdown, paths, ints) pass as they are."""
    out: dict[str, Any] = {}
    for k, v in md.items():
        if isinstance(v, float) and not isinstance(v, bool) and v == v and v not in (float("inf"), float("-inf")):
            if k.endswith(("_seconds", "_s")):
                v = round(v, 1)
            elif k.endswith(("_score", "_ratio", "fraction", "_share")):
                v = round(v, 4)
            else:
                v = _sig(v)
        out[k] = v
    return out


def base_metadata(manifest: dict, cached: bool) -> dict[str, Any]:
    """What every stage's materialization shows: where its output is, its content key, and (for people) its time
    and cost with units. A cache hit shows the time it took when it was produced, not as this run's time."""
    from resources.pricing import dollars, seconds

    wall, cost = float(manifest.get("wall_seconds", 0.0)), usd(manifest.get("cost_lines", []))
    md: dict[str, Any] = {
        "path": MetadataValue.path(manifest["path"]),
        "content_key": manifest["key"],
        "cached": cached,
        "time": f"reused (took {seconds(wall)} when produced)" if cached else seconds(wall),
        "cost": f"{dollars(cost)} (paid when produced; nothing in this run)" if cached and cost else dollars(cost),
        "wall_seconds": 0.0 if cached else round(wall, 1),
        "cost_usd": _sig(cost),
        "spent_this_run_usd": 0.0 if cached else _sig(cost),
    }
    if cached:
        md["produced_in_seconds"] = round(wall, 1)
    return md


def tag_run(context, **tags: str) -> None:
    """Add tags a person scans the runs list for (``verdict``, ``cost``) to the running run."""
    context.instance.add_run_tags(context.run_id, {k: str(v) for k, v in tags.items()})
