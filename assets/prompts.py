"""prompts: the campaign's prompt source read, validated and split into train and held-out (``stages.prompts``)."""

from dagster import AssetExecutionContext, MetadataValue, Output, asset

from assets.common import base_metadata, dagster_failures, for_people, key, stage_context
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore
from stages import prompts as stage


def build(spec: CampaignSpec):
    d = spec.data

    @asset(
        key=key(spec, "prompts"),
        group_name=spec.name,
        kinds={"python", "parquet"},
        description=f"Prompts from `{d.source}`, split into train and held-out ({d.heldout.fraction:.0%}).",
    )
    def prompts(context: AssetExecutionContext, storage: ArtifactStore) -> Output[dict]:
        with dagster_failures():
            out = stage.run(spec, {}, stage_context(context, storage))
        m = out.manifest
        md = base_metadata(m, out.cached) | {
            "train_rows": m["train_rows"],
            "heldout_rows": m["heldout_rows"],
            "source_files": MetadataValue.json(m["files"]),
        }
        return Output(m, metadata=for_people(md))

    return prompts
