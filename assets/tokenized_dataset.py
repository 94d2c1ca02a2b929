"""tokenized_dataset: the distillation set (plus any extra sources) tokenized with the student's
tokenizer, packed and sharded into Parquet (``campaign_orchestrator.dataset.tokenize``).

A blocking check (``campaign_orchestrator.dataset.checks``): ``stop_token_trained`` (every example's
loss ends on the stop token). Logit distillation from a teacher with another tokenizer (or an API teacher, which
returns text) places its top-k by byte offsets (``campaign_orchestrator.dataset.xtok``)."""

import time

from dagster import AssetCheckResult, AssetCheckSpec, AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, key, model_deps, stage_key
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore

STAGE_VERSION = "tokenized/v3"  # v3: a chat turn's loss ends on its end-of-turn token


def build_settings(spec: CampaignSpec):
    from campaign_orchestrator.dataset.tokenize import BuildSettings

    d = spec.dataset
    return BuildSettings(
        max_seq_len=spec.training.max_seq_len,
        template=d.template,
        train_on_prompt=d.train_on_prompt,
        packing=d.packing,
        padding=d.padding,
        too_long=d.too_long,
        shard_size_bytes=int(d.shard_size_mb * (1 << 20)),
        validation_fraction=d.validation_fraction,
        split_seed=d.split_seed,
        num_proc=d.num_proc,
    )


# The teacher columns' format (``campaign_orchestrator.dataset.topk``): part of the key of a campaign whose teacher
# stores
# top-k log-probabilities, so a dataset built before they were written is never reused for it.
TEACHER_TOPK_FORMAT = "teacher_topk/v1"


def content_key(
    distillation_key: str,
    tokenizer: str,
    settings,
    extra_sources_hash: str | None,
    teacher_topk: bool = False,
    alignment: list | None = None,
) -> str:
    """Same inputs and settings → same key (a no-op); a new tokenizer or max length → a new dataset.
    ``alignment``: a teacher of another tokenizer (``CrossTokenizer.key``); absent, the key is as before it."""
    parts = [STAGE_VERSION, distillation_key, tokenizer, settings.key_fields(), extra_sources_hash]
    if not teacher_topk:
        return stage_key(*parts)
    return stage_key(*parts, TEACHER_TOPK_FORMAT, *([alignment] if alignment is not None else []))


def check_teacher_topk(spec: CampaignSpec, manifest: dict) -> None:
    """Logit distillation needs teacher lists on the rows: fail here, naming why, rather than train on none."""
    if spec.training.distillation.loss != "logits":
        return
    t = manifest.get("teacher_topk")
    if not t or not t["positions"]:
        examples = {k: v for k, v in (t or {}).get("examples", {}).items() if v}
        raise ValueError(
            "training.distillation.loss is 'logits' but no token of the tokenized dataset carries a teacher top-k "
            f"distribution (examples by teacher_status: {examples or 'no top_logprobs in the distillation set'}). "
            "not_found: the row's answer tokens are not the teacher's tokens (same tokenizer) or do not spell its "
            "text (a chat template that rewrites the answer: use one that keeps it verbatim); no_token_text: an API "
            "teacher's rows without their tokens' text (generated before they were kept: regenerate); "
            "teacher_text_mismatch: the teacher's tokens do not spell its completion (a stop sequence inside a token)"
        )


STOP_CHECK = "stop_token_trained"


def teacher_tokenizer_ref(spec: CampaignSpec) -> str | None:
    """Where the teacher's tokenizer is, for logit distillation (None: an endpoint without one)."""
    tr = spec.training.distillation
    if tr.teacher_tokenizer:
        return tr.teacher_tokenizer
    return spec.teacher.model if spec.teacher.backend != "openai" else None


def cross_tokenizer(spec: CampaignSpec, storage: ArtifactStore, model_path):
    """Logit distillation from a teacher whose token ids are not the student's (another tokenizer, or an API
    teacher, which returns text): the byte alignment of ``campaign_orchestrator.dataset.xtok``; None otherwise."""
    if spec.training.distillation.loss != "logits" or spec.teacher.sampling.logprobs is None:
        return None
    from campaign_orchestrator.dataset.xtok import CrossTokenizer

    ref = teacher_tokenizer_ref(spec)
    tdir = storage.resolve_model(ref, spec.project_dir) if ref else None
    return CrossTokenizer.for_teacher(model_path, spec.teacher.model, tdir, spec.teacher.api)


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
        m, cached, _model_path = materialize(spec, distillation, storage, context.log.info)
        check_teacher_topk(spec, m)
        yield Output(m, metadata=dataset_metadata(m, cached))
        yield stop_check(m["stop_token"])

    return tokenized_dataset


def materialize(spec: CampaignSpec, distillation: dict, storage: ArtifactStore, log) -> tuple[dict, bool, object]:
    """The tokenized dataset's stage, built unless its content key is complete: ``(manifest, cached, base path)``."""
    from campaign_orchestrator.dataset.sources import resolve_source, source_hash
    from campaign_orchestrator.dataset.tokenize import build_tokenized_dataset, tokenizer_hash

    d = spec.dataset
    model_path = storage.resolve_model(spec.student.base_model, spec.project_dir)
    tok_hash = tokenizer_hash(model_path)
    settings = build_settings(spec)
    extra = source_hash([resolve_source(x, spec.project_dir) for x in d.extra_sources]) if d.extra_sources else None
    xtok = cross_tokenizer(spec, storage, model_path)
    k = content_key(
        distillation["key"],
        tok_hash,
        settings,
        extra,
        teacher_topk=spec.teacher.sampling.logprobs is not None,
        alignment=xtok.key() if xtok is not None else None,
    )
    sd = storage.stage(spec.name, "tokenized_dataset", k)
    cached = sd.is_complete()
    if not cached:
        t0 = time.perf_counter()
        report = build_tokenized_dataset(
            model_path,
            [distillation["distillation_path"], *d.extra_sources],
            sd.ensure(),
            settings,
            base_dir=spec.project_dir,
            extra_metadata={"campaign.dataset_key": k, "campaign.source_key": distillation["key"]},
            log=log,
            cross_tokenizer=xtok,
        )
        sd.commit(
            report
            | {
                "dataset_path": str(sd.path / "train"),
                "validation_path": str(sd.path / "validation"),
                "tokenizer_hash": tok_hash,
                "wall_seconds": time.perf_counter() - t0,
                "cost_lines": [],
            }
        )
    return sd.manifest(), cached, model_path


def dataset_metadata(m: dict, cached: bool) -> dict:
    """The tokenized dataset's manifest as Dagster metadata."""
    tsplit, vsplit = m["splits"]["train"], m["splits"]["validation"]
    md = base_metadata(m, cached) | {
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
    from campaign_orchestrator.dataset.checks import describe_stop_tokens

    return AssetCheckResult(
        check_name=STOP_CHECK,
        passed=stop["passed"],
        description=describe_stop_tokens(stop),
        metadata={k: v for k, v in stop.items() if k != "missing_examples"}
        | {"missing_examples": MetadataValue.json(stop["missing_examples"])},
    )
