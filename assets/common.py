"""What every asset adapter shares: asset keys, model dependencies, the stage context built from the resources,
stage errors as Dagster failures, and metadata for people."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from dagster import AssetKey, Failure, MetadataValue
from dagster._core.errors import DagsterInvalidPropertyError

from campaigns.spec import CampaignSpec
from stages.common import STAGES, demo_model_name, usd
from stages.context import StageContext, TeacherSettings
from stages.errors import StageError
from stages.pricing import dollars, seconds

__all__ = ["STAGES", "DEMO_GROUP", "key", "demo_model_key", "model_deps", "stage_context", "dagster_failures"]

DEMO_GROUP = "demo_models"


def key(spec: CampaignSpec, stage: str) -> AssetKey:
    return AssetKey([spec.name, stage])


def demo_model_key(ref: str) -> AssetKey:
    return AssetKey([DEMO_GROUP, demo_model_name(ref) or ref])


def model_deps(*refs: str) -> list[AssetKey]:
    """Asset keys of the demo models a stage reads (other models are plain paths)."""
    return sorted({demo_model_key(r) for r in refs if demo_model_name(r) is not None}, key=lambda k: k.path)


def stage_context(context, storage, pricing=None, teacher=None, launcher=None, kuberay=None) -> StageContext:
    """The plain :class:`stages.context.StageContext` of an asset's step: the resources' plain objects (storage,
    pricing, teacher settings), the launchers bound to this run, and the run, step and attempt the ledger
    records."""
    step, attempt = _step_and_attempt(context)
    return StageContext(
        store=storage.store(),
        pricing=pricing.service() if pricing is not None else StageContext().pricing,
        run_id=context.run_id,
        step_key=step,
        attempt=attempt,
        log=context.log,
        teacher=TeacherSettings(teacher.vllm_chunk_size) if teacher is not None else TeacherSettings(),
        train=partial(launcher.launch, context) if launcher is not None else None,
        kuberay=partial(kuberay.launch, context) if kuberay is not None else None,
    )


def _step_and_attempt(context) -> tuple[str, int]:
    """The step's key and retry number the ledger records; an asset invoked directly (``build_asset_context``, no
    step) is step ``direct``, attempt 0."""
    try:
        return context.get_step_execution_context().step.key, context.retry_number
    except (DagsterInvalidPropertyError, AttributeError):
        return "direct", 0


@contextmanager
def dagster_failures() -> Iterator[None]:
    """A stage's :class:`stages.errors.StageError` (a budget stop among them) as a Dagster ``Failure`` with its
    message and metadata, retried only when a retry can help."""
    try:
        yield
    except StageError as e:
        raise Failure(description=str(e), metadata=e.metadata or None, allow_retries=e.retry) from e


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
