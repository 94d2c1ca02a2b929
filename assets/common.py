"""What every asset adapter shares: asset keys, model dependencies, the stage context built from the resources,
stage errors as Dagster failures, and metadata for people."""

from __future__ import annotations

import math
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


def _is_seconds(k: str) -> bool:
    return k.endswith(("_seconds", "_latency_s"))


def rounded(md: dict[str, Any]) -> dict[str, Any]:
    """Metadata with its plain floats rounded for reading and kept numeric (what Dagster plots across
    materializations): seconds to 0.1 s, scores, ratios and fractions to 4 decimals, the rest to 4 significant
    digits. Other values (text, markdown, paths, ints) pass as they are."""
    out: dict[str, Any] = {}
    for k, v in md.items():
        if isinstance(v, float) and math.isfinite(v):
            if _is_seconds(k) or k.endswith("_s"):
                v = round(v, 1)
            elif k.endswith(("_score", "_ratio", "fraction", "_share")):
                v = round(v, 4)
            else:
                v = _sig(v)
        out[k] = v
    return out


def for_people(md: dict[str, Any]) -> dict[str, Any]:
    """Metadata as a person reads it in the UI (the manifests and report files keep the raw values programs read):
    dollars (``*_usd``) and seconds (``*_seconds``, ``*_latency_s``) as text with their unit (``$0.00052``,
    ``21.8 s``: the project's ``dollars`` and ``seconds``), other floats :func:`rounded`. Ints stay ints."""
    out: dict[str, Any] = {}
    for k, v in md.items():
        if isinstance(v, float) and math.isfinite(v):
            if k.endswith("_usd"):
                v = dollars(v)
            elif _is_seconds(k):
                v = seconds(v)
        out[k] = v
    return rounded(out)


def base_metadata(manifest: dict, reused: bool, made_from: str | None = None) -> dict[str, Any]:
    """What every stage's materialization shows first: where its output is, its content key, whether it was reused
    (one flag; the IO manager adds the run it came from, ``reused_from_run``, and corrects the flag and ``cost``
    from the ledger: ``assets/io_manager.py``), and one duration and one cost, for people. A reused output shows the
    time it took when it was produced, never as this run's; ``made_from`` says what this run made it from when it
    reused its costly input (``re-judged stored answers``: the time is the input's)."""
    wall, cost = float(manifest.get("wall_seconds", 0.0)), usd(manifest.get("cost_lines", []))
    if reused:
        took = f"reused (took {seconds(wall)} when produced)"
    elif made_from:
        took = f"{made_from} (they took {seconds(wall)} when produced)"
    else:
        took = seconds(wall)
    paid = dollars(cost) + (" (paid when produced; nothing in this run)" if reused and cost > 0 else "")
    return {
        "path": MetadataValue.path(manifest["path"]),
        "content_key": manifest["key"],
        "reused": reused,
        "time": took,
        "cost": manifest.get("cost_unknown") or paid,  # never $0 for an unpriced teacher's work
    }


def reused_metadata(produced_by: str | None, run_id: str) -> dict[str, Any]:
    """The reuse flag of an output produced by ``produced_by`` (a run id) materialized in ``run_id``, and where
    reused, that run (a link to its page)."""
    if not produced_by or produced_by == run_id:
        return {"reused": False}
    return {"reused": True, "reused_from_run": MetadataValue.dagster_run(produced_by)}


# Run tags a person scans the runs list for. Dagster stores a run's tags sorted by key and shows them in that order
# (the runs list, the run's "View tags and config"): capitalized keys sort before every lowercase one, so these two
# lead. The tags only the run reaper reads are hidden (resources/run_owner.py, assets/run_recovery.py).
VERDICT_TAG, COST_TAG = "Verdict", "Cost"


def tag_run(context, verdict: str | None = None, cost: str | None = None) -> None:
    """Tag the running run with its verdict and what its result cost (the first tags of the runs list)."""
    tags = {VERDICT_TAG: verdict, COST_TAG: cost}
    context.instance.add_run_tags(context.run_id, {k: str(v) for k, v in tags.items() if v is not None})
