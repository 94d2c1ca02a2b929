"""tokenized_dataset: the distillation set (plus any extra sources) tokenized with the student's
tokenizer, packed and sharded into Parquet (``stages/tokenized_dataset.py``).

A blocking check: ``stop_token_trained`` (every example's loss ends on the stop token). Logit distillation from a
teacher with another tokenizer (or an API teacher, which returns text) places its top-k by byte offsets
(``campaign_orchestrator.dataset.xtok``)."""

from dagster import AssetCheckResult, AssetCheckSpec, AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, dagster_failures, for_people, key, model_deps, stage_context
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore
from stages import tokenized_dataset as stage

STOP_CHECK = "stop_token_trained"


def build(spec: CampaignSpec):
    s, tr, d = spec.student, spec.training, spec.dataset
    checks = [
        AssetCheckSpec(
            STOP_CHECK,
            asset=key(spec, "tokenized_dataset"),
            blocking=True,
            description="Every example's loss mask ends on the stop token (EOS / end of turn), so the "
            "student learns to stop; rows cut by too_long: truncate are counted apart.",
        )
    ]

    @asset(
        key=key(spec, "tokenized_dataset"),
        group_name=spec.name,
        kinds={"python", "parquet"},
        ins={"distillation": AssetIn(key(spec, "distillation_set"))},
        deps=model_deps(s.base_model),
        check_specs=checks,
        description=(
            f"Pre-tokenized Parquet shards (input_ids, labels, position_ids), max {tr.max_seq_len} tokens, "
            f"{'packed' if d.packing else 'one example per row'}, padding {d.padding}."
        ),
    )
    def tokenized_dataset(context: AssetExecutionContext, distillation: dict, storage: ArtifactStore):
        ctx = stage_context(context, storage)
        with dagster_failures():
            out = stage.run(spec, {"distillation": distillation}, ctx)
        m = out.manifest
        yield Output(m, metadata=for_people(dataset_metadata(m, out.cached)))
        yield stop_check(m["stop_token"])

    return tokenized_dataset


def dataset_metadata(m: dict, reused: bool) -> dict:
    """The tokenized dataset's manifest as Dagster metadata."""
    tsplit, vsplit = m["splits"]["train"], m["splits"]["validation"]
    md = base_metadata(m, reused) | {
        "examples_in": m["examples_in"],
        "examples_out": m["examples_out"],
        "dropped_total": m["dropped_total"],
        "truncated": m["truncated"],
        "rows": m["rows"],
        "train_rows": tsplit["rows"],
        "validation_rows": vsplit["rows"],
        "validation_examples": vsplit["examples"],
        "total_tokens": m["total_tokens"],
        "loss_tokens": m["loss_tokens"],
        "packing_efficiency": float(m["packing_efficiency"]),
        "unpacked_padded_efficiency": float(m["unpacked_padded_efficiency"]),
        "shards": m["shards"],
        "bytes": m["bytes"],
        "template": m["template"],
        "tokenizer_hash": m["tokenizer_hash"][:16],
        "source_hash": m["source_hash"][:16],
        "drops": MetadataValue.json(m["dropped"]),
        "sequence_lengths": MetadataValue.md(m["length_histogram"]),
        "row_fill": MetadataValue.md(m["row_fill_histogram"]),
        "dataset": MetadataValue.path(m["dataset_path"]),
    }
    if m.get("teacher_topk"):
        t = m["teacher_topk"]
        md |= {
            "teacher_topk_k": t["k"],
            "teacher_topk_positions": t["positions"],
            "teacher_topk_examples": MetadataValue.json(t["examples"]),
        }
        if t.get("alignment"):  # by byte offsets (a teacher of another tokenizer): the share of each part
            a = t["alignment"]
            md |= {f"teacher_{k}_positions": v for k, v in a["positions"].items()}
            md |= {f"teacher_{k}_share": float(v) for k, v in a["shares"].items()}
    stop = m["stop_token"]
    md |= {
        "stop_token_ids": MetadataValue.json(stop["stop_token_ids"]),
        "stop_token_missing": stop["missing"],
        "truncated_without_stop": stop["truncated_without_stop"],
    }
    return md


def stop_check(stop: dict) -> AssetCheckResult:
    return AssetCheckResult(
        check_name=STOP_CHECK,
        passed=stop["passed"],
        description=stage.describe_stop_tokens(stop),
        metadata={k: v for k, v in stop.items() if k != "missing_examples"}
        | {"missing_examples": MetadataValue.json(stop["missing_examples"])},
    )
