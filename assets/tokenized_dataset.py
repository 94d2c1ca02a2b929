"""tokenized_dataset: the distillation set (plus any extra sources) tokenized with the student's
tokenizer, packed and sharded into Parquet (``stages/tokenized_dataset.py``).

Two blocking checks (``campaign_orchestrator.dataset.checks``): ``stop_token_trained`` (every example's
loss ends on the stop token) and, for logit distillation, ``vocabularies_compatible``."""

from dagster import AssetCheckResult, AssetCheckSpec, AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, dagster_failures, for_people, key, model_deps, stage_context
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore
from stages import tokenized_dataset as stage

STOP_CHECK, VOCAB_CHECK = "stop_token_trained", "vocabularies_compatible"


def build(spec: CampaignSpec):
    s, tr, d = spec.student, spec.training, spec.dataset
    logits = tr.distillation.loss == "logits"
    checks = [
        AssetCheckSpec(
            STOP_CHECK,
            asset=key(spec, "tokenized_dataset"),
            blocking=True,
            description="Every example's loss mask ends on the stop token (EOS / end of turn), so the "
            "student learns to stop; rows cut by too_long: truncate are counted apart.",
        )
    ]
    if logits:
        checks.append(
            AssetCheckSpec(
                VOCAB_CHECK,
                asset=key(spec, "tokenized_dataset"),
                blocking=True,
                description="Teacher and student share one tokenizer and vocabulary size, so "
                "the teacher's top-k token ids mean what the student's do.",
            )
        )

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
        if logits:
            yield vocabulary_check(stage.vocabulary_report(spec, ctx, out.notes["model_path"]))

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


def vocabulary_check(v: dict | None) -> AssetCheckResult:
    """Logit distillation: the teacher's tokenizer and vocabulary are the student's (``v``: the stage's
    ``vocabulary_report``, None without the teacher's tokenizer)."""
    if v is None:
        return AssetCheckResult(
            check_name=VOCAB_CHECK,
            passed=False,
            description="logit distillation from an endpoint needs the teacher's tokenizer: "
            "set training.distillation.teacher_tokenizer",
        )
    return AssetCheckResult(
        check_name=VOCAB_CHECK,
        passed=v["passed"],
        description="; ".join(v["reasons"]) or "same tokenizer and vocabulary size",
        metadata={k: v[k] for k in ("teacher_vocab_size", "student_vocab_size") if v[k] is not None}
        | {
            "teacher_tokenizer_hash": v["teacher_tokenizer_hash"][:16],
            "student_tokenizer_hash": v["student_tokenizer_hash"][:16],
        },
    )
