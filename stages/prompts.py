"""prompts: the campaign's prompt source read, validated and split into train and held-out."""

from __future__ import annotations

import time

from campaign_orchestrator.content import file_sha256
from campaigns.spec import CampaignSpec
from stages.common import stage_key
from stages.outcome import Outcome


def prompt_files(spec: CampaignSpec, ctx) -> list:
    """The source's files (a local glob or an ``s3://`` prefix; a copy of a file's exact content is read once)."""
    from campaign_orchestrator.triggers.sources import prompt_files as files_of

    return files_of(spec.data.source, spec.project_dir, ctx.store.root_path() / "_sources" / spec.name)


def content_key(spec: CampaignSpec, files: list) -> str:
    """The files' names and content, and the data settings (not its filters, decontamination or training targets:
    the distillation set reads those)."""
    return stage_key(
        "prompts/v1",
        [(f.name, file_sha256(f)) for f in files],
        spec.data.model_dump(exclude={"filters", "decontamination", "targets"}),
    )


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """The prompts split into ``train.parquet`` and ``heldout.parquet``, unless the stage's content key is
    complete (no inputs)."""
    files = prompt_files(spec, ctx)
    sd = ctx.store.stage(spec.name, "prompts", content_key(spec, files))
    cached = sd.is_complete()
    if not cached:
        _split_prompts(spec, files, sd)
    return Outcome(sd.manifest(), cached)


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
