"""prompts: the campaign's prompt source read, validated and split into train and held-out."""

import time

from dagster import AssetExecutionContext, MetadataValue, Output, asset

from assets.common import base_metadata, key, stage_key
from campaign_orchestrator.content import file_sha256
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore


def _split_prompts(spec: CampaignSpec, files: list, sd) -> None:
    """Read the prompt files, split them into train and held-out, commit both to the stage ``sd``."""
    from campaign_orchestrator.dataset import prompts as P

    d = spec.data
    t0 = time.perf_counter()
    rows = P.read_prompts(files, P.SourceFields(d.id_field, d.prompt_field, d.reference_field, d.category_field))
    train, held = P.split(rows, d.heldout.fraction, d.heldout.seed, d.heldout.max_items)
    out = sd.ensure()
    P.write_prompts(train, out / "train.parquet")
    P.write_prompts(held, out / "heldout.parquet")
    sd.commit(
        {
            "train_path": str(out / "train.parquet"),
            "heldout_path": str(out / "heldout.parquet"),
            "train_rows": len(train),
            "heldout_rows": len(held),
            "files": [f.name for f in files],
            "train_sha256": file_sha256(out / "train.parquet"),
            "heldout_sha256": file_sha256(out / "heldout.parquet"),
            "wall_seconds": time.perf_counter() - t0,
            "cost_lines": [],
        }
    )


def build(spec: CampaignSpec):
    d = spec.data

    @asset(
        key=key(spec, "prompts"),
        group_name=spec.name,
        kinds={"python", "parquet"},
        description=f"Prompts from `{d.source}`, split into train and held-out ({d.heldout.fraction:.0%}).",
    )
    def prompts(context: AssetExecutionContext, storage: ArtifactStore) -> Output[dict]:
        from campaign_orchestrator.triggers.sources import prompt_files

        # local glob or s3:// prefix; a copy of a file's exact content is read once
        files = prompt_files(d.source, spec.project_dir, storage.root_path() / "_sources" / spec.name)
        k = stage_key(
            "prompts/v1",
            [(f.name, file_sha256(f)) for f in files],
            d.model_dump(exclude={"filters", "decontamination"}),
        )
        sd = storage.stage(spec.name, "prompts", k)
        cached = sd.is_complete()
        if not cached:
            _split_prompts(spec, files, sd)
        m = sd.manifest()
        md = base_metadata(m, cached) | {
            "train_rows": m["train_rows"],
            "heldout_rows": m["heldout_rows"],
            "source_files": MetadataValue.json(m["files"]),
        }
        return Output(m, metadata=md)

    return prompts
