"""tokenized_dataset: the distillation set (plus any extra sources) tokenized with the student's
tokenizer, packed and sharded into Parquet (``campaign_orchestrator.dataset.tokenize``).

What its blocking check judges (``campaign_orchestrator.dataset.checks``): every example's loss ends on the stop
token (the manifest's ``stop_token``). Logit distillation from a teacher whose token ids are not the student's
places the teacher's top-k by byte offsets (:func:`cross_tokenizer`)."""

from __future__ import annotations

import time

from campaigns.spec import CampaignSpec
from stages.common import stage_key
from stages.outcome import Outcome

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


def teacher_tokenizer_ref(spec: CampaignSpec) -> str | None:
    """Where the teacher's tokenizer is, for logit distillation (None: an endpoint without one)."""
    tr = spec.training.distillation
    if tr.teacher_tokenizer:
        return tr.teacher_tokenizer
    return spec.teacher.model if spec.teacher.backend != "openai" else None


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """The tokenized dataset's stage (``inputs["distillation"]``: the distillation set's manifest), built unless its
    content key is complete; ``notes["model_path"]``: the student's base (its tokenizer), checked teacher top-k
    (:func:`check_teacher_topk`)."""
    from campaign_orchestrator.dataset.sources import resolve_source, source_hash
    from campaign_orchestrator.dataset.tokenize import build_tokenized_dataset
    from campaign_orchestrator.dataset.tokenizer_files import tokenizer_hash

    distillation, storage, log = inputs["distillation"], ctx.store, ctx.log.info
    d = spec.dataset
    model_path = storage.resolve_model(spec.student.base_model, spec.project_dir)
    tok_hash = tokenizer_hash(model_path)
    settings = build_settings(spec).resolved(model_path)  # `template: auto` as the tokenizer resolves it, keyed so
    extra = source_hash([resolve_source(x, spec.project_dir) for x in d.extra_sources]) if d.extra_sources else None
    xtok = cross_tokenizer(spec, storage, model_path)
    k = content_key(
        distillation["key"],
        tok_hash,
        settings,
        extra,
        teacher_topk=any(e.sampling.logprobs is not None for e in spec.teachers),
        alignment=xtok.key() if xtok is not None else None,
    )
    sd = storage.stage(spec.name, "tokenized_dataset", k)
    cached = sd.is_complete()
    if not cached:
        t0 = time.perf_counter()
        if spec.data.targets.prefix_space:  # checked when the rows are built (a built dataset passed it)
            _check_prefix_space(model_path, settings.template)
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
    m = sd.manifest()
    check_teacher_topk(spec, m)
    return Outcome(m, cached, {"model_path": model_path})


def _check_prefix_space(model_path, template: str) -> None:
    """The student's chat template keeps the space ``data.targets.prefix_space`` writes before each target."""
    from transformers import AutoTokenizer

    from campaign_orchestrator.dataset.formatting import check_prefix_space, resolve_template

    tok = AutoTokenizer.from_pretrained(str(model_path))
    check_prefix_space(tok, resolve_template(tok, template))


def cross_tokenizer(spec: CampaignSpec, storage, model_path):
    """Logit distillation from a teacher whose token ids are not the student's (another tokenizer, or an API
    teacher, which returns text), or from several teachers (each by its own tokenizer): the byte alignment of
    ``campaign_orchestrator.dataset.xtok``; None otherwise."""
    if spec.training.distillation.loss != "logits" or spec.teacher.sampling.logprobs is None:
        return None
    from campaign_orchestrator.dataset.xtok import CrossTokenizer

    if spec.several_teachers:  # each teacher's tokenizer by its name (the rows' `teacher`)
        views = [(e.name, spec.for_teacher(e)) for e in spec.teachers]
        refs = [(n, v.teacher, teacher_tokenizer_ref(v)) for n, v in views]
        dirs = [(n, t.model, storage.resolve_model(r, spec.project_dir) if r else None, t.api) for n, t, r in refs]
        return CrossTokenizer.for_teachers(model_path, dirs, spec.teacher.default.name)
    ref = teacher_tokenizer_ref(spec)
    tdir = storage.resolve_model(ref, spec.project_dir) if ref else None
    return CrossTokenizer.for_teacher(model_path, spec.teacher.model, tdir, spec.teacher.api)


def describe_stop_tokens(stop: dict) -> str:
    from campaign_orchestrator.dataset.checks import describe_stop_tokens as describe

    return describe(stop)
