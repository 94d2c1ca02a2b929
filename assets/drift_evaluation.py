"""drift_evaluation: the Dagster asset of ``stages/drift_evaluation.py`` (the promoted model re-scored on the
freshest held-out data; what it scores, prices and compares is in that module's docstring). Run by the campaign's
drift schedule (``<campaign>_drift``), never by the campaign job; its metadata carries the verdict and reasons, and
the ``<campaign>_drift_retrain`` sensor turns a DRIFTED verdict into a retraining run."""

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from assets.common import base_metadata, dagster_failures, for_people, key, stage_context
from campaigns.spec import CampaignSpec
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from stages import drift_evaluation as stage
from stages.drift_evaluation import STAGE, max_drop


def drift_key(spec: CampaignSpec):
    return key(spec, STAGE)


def build(spec: CampaignSpec):
    @asset(
        key=drift_key(spec),
        group_name=spec.name,
        kinds={"pytorch", "parquet"},
        deps=[key(spec, "promoted_model")],
        description="The promoted adapter re-scored, through the campaign's evaluation backend and inside its "
        "budget, on held-out items of prompts it never saw (topped up to the gate's min_items with its "
        "own held-out items); DRIFTED when the interval of the change from its promotion-time score "
        "excludes every drop within the allowed one, or its fresh score is surely below the floor.",
    )
    def drift_evaluation(
        context: AssetExecutionContext, storage: ArtifactStore, pricing: PricingResource
    ) -> MaterializeResult:
        with dagster_failures():
            out = stage.run(spec, {}, stage_context(context, storage, pricing))
        return MaterializeResult(metadata=for_people(drift_metadata(spec, out.manifest, out.cached)))

    return drift_evaluation


def drift_metadata(spec: CampaignSpec, m: dict, reused: bool) -> dict:
    """The drift stage's manifest as Dagster metadata: the verdict, its reasons, the scores per suite."""
    ev, r = spec.evaluation, m["report"]
    md = base_metadata(m, reused) | {
        "verdict": r["verdict"],
        "drifted": r["verdict"] == "DRIFTED",
        "summary": r["summary"],
        "reasons": MetadataValue.md("\n".join(f"- {x}" for x in r["reasons"]) or "- none"),
        "promoted_key": m["promoted_key"],
        "heldout_items": m["heldout_items"],
        "fresh_items": m["item_selection"]["fresh_items"],
        "earlier_items": m["item_selection"]["earlier_items"],
        "item_selection": MetadataValue.json(m["item_selection"]),
        "floor": ev.gate.min_score,
        "max_drop": max_drop(spec),
        "confidence": ev.statistics.confidence,
        "backend": m["backend"],
    }
    for s in r["suites"]:
        md[f"{s['suite']}_fresh_score"] = s["score"] if s["score"] is not None else float("nan")
        if s["promoted_score"] is not None:
            md[f"{s['suite']}_promoted_score"] = s["promoted_score"]
        if s.get("delta_lo") is not None:
            md[f"{s['suite']}_change_lo"], md[f"{s['suite']}_change_hi"] = s["delta_lo"], s["delta_hi"]
    return md
