"""campaign_cost: what this campaign's result cost, from every stage's cost lines."""

import json

from dagster import AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import key
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore


def primary_scores(evaluation: dict, suite: str) -> tuple[float | None, float | None]:
    s = evaluation["scores"]
    return s.get("candidate", {}).get(suite), s.get("base", {}).get(suite)


def build(spec: CampaignSpec):
    primary = spec.evaluation.suites[0].name
    stages = ("teacher_generations", "distillation_set", "tokenized_dataset", "student_adapter", "evaluation")

    @asset(key=key(spec, "campaign_cost"), group_name=spec.name, kinds={"python"},
           ins={s: AssetIn(key(spec, s)) for s in stages},
           description="Total cost and cost per result: $/M teacher tokens, $/1k accepted examples, $/point gained.")
    def campaign_cost(context: AssetExecutionContext, storage: ArtifactStore, teacher_generations: dict,
                      distillation_set: dict, tokenized_dataset: dict, student_adapter: dict,
                      evaluation: dict) -> Output[dict]:
        from costs.report import cost_per_result

        manifests = {"teacher_generations": teacher_generations, "distillation_set": distillation_set,
                     "tokenized_dataset": tokenized_dataset, "student_adapter": student_adapter, "evaluation": evaluation}

        gen = manifests["teacher_generations"]
        cand, base = primary_scores(manifests["evaluation"], primary)
        report = cost_per_result(manifests, manifests["distillation_set"]["rows"],
                                 gen["prompt_tokens"] + gen["completion_tokens"], cand, base)
        report["budget_usd"] = spec.cost.budget_usd
        path = storage.campaign_dir(spec.name) / "campaign_cost" / f"{context.run_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        md = {k: v for k, v in report.items() if isinstance(v, int | float) and v is not None}
        md["report"] = MetadataValue.path(str(path))
        md["usd_per_point_gained"] = report["usd_per_point_gained"] if report["usd_per_point_gained"] is not None else float("nan")
        return Output({"key": context.run_id, "path": str(path), **report}, metadata=md)

    return campaign_cost
