"""distillation_set: teacher generations filtered and deduplicated, each rule counted; then checked for
overlap with every gate suite's documents (the blocking ``decontamination`` check, before training):
overlapping examples are dropped and counted, or the check fails (``data.decontamination``)."""

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from dagster import AssetCheckResult, AssetCheckSpec, AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, key, model_deps, stage_key
from campaign_orchestrator.dataset.replay import REPLAY_PREFIX
from campaigns.spec import CampaignSpec
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from resources.teacher import TeacherResource


def distill_schema() -> pa.Schema:
    """id, prompt, completion; plus the teacher's generated token ids and top-k logprobs
    (null unless ``teacher.sampling.logprobs`` was set; see ``campaign_orchestrator/generation/rows.py``)."""
    from campaign_orchestrator.generation.rows import TOP_LOGPROBS_TYPE

    return pa.schema(
        [
            ("id", pa.string()),
            ("prompt", pa.string()),
            ("completion", pa.string()),
            ("completion_token_ids", pa.list_(pa.int32())),
            ("top_logprobs", TOP_LOGPROBS_TYPE),
        ]
    )


DECONTAMINATION_CHECK = "decontamination"


def build(spec: CampaignSpec):
    dc, rp = spec.data.decontamination, spec.data.replay

    @asset(
        key=key(spec, "distillation_set"),
        group_name=spec.name,
        kinds={"python", "parquet"},
        deps=model_deps(spec.student.base_model)
        if (rp is not None and rp.answered_by == "base") or spec.data.targets.content == "base"
        else None,
        ins={"generations": AssetIn(key(spec, "teacher_generations")), "prompts": AssetIn(key(spec, "prompts"))},
        check_specs=[
            AssetCheckSpec(
                DECONTAMINATION_CHECK,
                asset=key(spec, "distillation_set"),
                blocking=True,
                description=f"No training prompt or teacher output shares a {dc.ngram}-gram "
                f"with a gate suite's documents (action: {dc.action}).",
            )
        ],
        description="Teacher generations that pass the campaign's filters (errors, empty, truncated, length, "
        "format, scorer, duplicates), each rule counted, and checked against every gate suite's "
        "documents (n-gram decontamination)."
        + (
            f" Replay: {rp.share:.0%} of the mix, general prompts answered by the {rp.answered_by} (ids `replay:<id>`)."
            if rp
            else ""
        ),
    )
    def distillation_set(
        context: AssetExecutionContext,
        generations: dict,
        prompts: dict,
        storage: ArtifactStore,
        teacher: TeacherResource,
        pricing: PricingResource,
    ):
        m, cached = materialize(context, spec, generations, prompts, storage, (teacher, pricing))
        yield Output(m, metadata=distillation_metadata(m, cached))
        yield decontamination_check(m.get("decontamination"))

    return distillation_set


def materialize(
    context,
    spec: CampaignSpec,
    generations: dict,
    prompts: dict,
    storage: ArtifactStore,
    resources: tuple = (None, None),
) -> tuple[dict, bool]:
    """The teacher's generations filtered by the campaign's rules, with the self-replay rows added
    (``data.replay``; ``resources``: the teacher and pricing resources that answer them), and decontaminated
    against the gate suites, unless the stage's content key is complete: ``(manifest, cached)``."""
    from campaign_orchestrator.dataset.filtering import FilterRules, filter_generations
    from campaign_orchestrator.generation.rows import read_generations
    from evaluation.scorers import get_scorer

    f = spec.data.filters
    sd = storage.stage(spec.name, "distillation_set", _distillation_key(spec, generations, prompts, storage))
    cached = sd.is_complete()
    if not cached:
        t0 = time.perf_counter()
        rows = read_generations(generations["generations_path"])
        refs = None
        if f.scorer:
            from campaign_orchestrator.dataset.prompts import read_prompt_table

            refs = {r["id"]: r["reference"] for r in read_prompt_table(prompts["train_path"])}
        score_fn = get_scorer(f.scorer) if f.scorer else None
        kept, counts = filter_generations(rows, FilterRules(**f.model_dump()), refs, score_fn=score_fn)
        kept, targets, target_lines = with_base_targets(spec, storage, resources, kept, context)
        kept, replay, replay_lines = with_replay(spec, storage, resources, kept, context)
        kept, contamination = _decontaminate(spec, kept, prompts, storage, sd, context)
        path = _write_distillation(kept, sd.ensure() / "distillation.parquet")
        if replay is not None:  # what is left of the replay after decontamination
            replay["rows"] = sum(1 for r in kept if str(r["id"]).startswith(REPLAY_PREFIX))
            replay["share_actual"] = replay["rows"] / max(1, len(kept))
        sd.commit(
            {
                "distillation_path": str(path),
                "rows": len(kept),
                "filter_counts": counts,
                "decontamination": contamination,
                "wall_seconds": time.perf_counter() - t0,
                "cost_lines": target_lines + replay_lines,
                **({"replay": replay} if replay is not None else {}),
                **({"targets": targets} if targets is not None else {}),
            }
        )
    return sd.manifest(), cached


def _distillation_key(spec: CampaignSpec, generations: dict, prompts: dict, storage: ArtifactStore) -> str:
    """The stage's content key: the generations, the filter rules (and the references they score against), the
    decontamination settings and gate documents when on, the replay's identity when on."""
    f, dc, rp = spec.data.filters, spec.data.decontamination, spec.data.replay
    gate_docs = None
    if dc.action != "off":
        from assets.harness import gate_documents_identity

        gate_docs = gate_documents_identity(spec, storage, prompts["heldout_sha256"])
    return stage_key(
        "distill/v2",
        generations["key"],
        f.model_dump(),
        prompts["train_sha256"] if f.scorer else None,
        *([dc.model_dump(), gate_docs] if gate_docs is not None else []),
        *([replay_identity(spec, storage)] if rp is not None else []),
        *(
            [spec.data.targets.model_dump(), _base_identity(spec, storage)]
            if spec.data.targets.content == "base"
            else []
        ),
    )


def _write_distillation(kept: list[dict], path: Path) -> Path:
    """The kept rows as ``distillation.parquet`` (a row's id carries ``#<sample>`` past the first sample)."""
    table = pa.Table.from_pylist(
        [
            {
                "id": f"{r['id']}#{r['sample_index']}" if r["sample_index"] else r["id"],
                "prompt": r["prompt"],
                "completion": r["completion"],
                "completion_token_ids": r.get("completion_token_ids"),
                "top_logprobs": r.get("top_logprobs"),
            }
            for r in kept
        ],
        schema=distill_schema(),
    )
    pq.write_table(table, path)
    return path


def distillation_metadata(m: dict, cached: bool) -> dict:
    """The distillation set's manifest as Dagster metadata: rows kept, each filter rule's drops, contamination."""
    from campaign_orchestrator.dataset.filtering import RULES

    c = m["filter_counts"]
    md = base_metadata(m, cached) | {
        "rows": m["rows"],
        "input_rows": c["input"],
        "kept_fraction": m["rows"] / max(1, c["input"]),
        "filter_counts": MetadataValue.json(c),
    }
    md |= {f"dropped_{name}": c.get(name, 0) for name in RULES}
    if m.get("replay"):
        r = m["replay"]
        md |= {
            "replay_rows": r["rows"],
            "task_rows": m["rows"] - r["rows"],
            "replay_share": r["share_actual"],
            "replay_answered_by": r["answered_by"],
            "replay_generated": r.get("generated", 0),
            "replay_cache_hits": r.get("cache_hits", 0),
            "replay": MetadataValue.json(r),
        }
    if m.get("targets"):  # data.targets.content: base
        md |= {"targets_kept": m["targets"]["kept"], "targets_disagree": m["targets"]["disagree"]}
        md["targets"] = MetadataValue.json(m["targets"])
    dec = m.get("decontamination")
    if dec is not None:
        md |= {"contaminated_rows": dec["contaminated_rows"], "decontamination": MetadataValue.json(dec)}
        if dec["action"] == "drop":
            md["dropped_contaminated"] = dec["contaminated_rows"]
    return md


def _decontaminate(spec: CampaignSpec, kept: list[dict], prompts: dict, storage: ArtifactStore, sd, context):
    """(rows to keep, the decontamination summary or None when off)."""
    dc = spec.data.decontamination
    if dc.action == "off":
        return kept, None
    from assets.harness import gate_documents
    from campaign_orchestrator.dataset.decontamination import build_index, find_contamination
    from campaign_orchestrator.dataset.prompts import read_prompt_table

    docs = gate_documents(
        spec, read_prompt_table(prompts["heldout_path"]), storage, sd.ensure() / "lm_eval", log=context.log.info
    )
    found = find_contamination(kept, build_index(docs, dc.ngram, dc.min_doc_tokens))
    ids = [f"{r['id']}#{r['sample_index']}" if r.get("sample_index") else str(r["id"]) for r in kept]
    summary = found.summary(len(kept), ids=ids) | {"action": dc.action}
    context.log.info(
        f"decontamination: {found.contaminated} of {len(kept)} training rows overlap a gate suite "
        f"({dc.ngram}-grams; action {dc.action})"
    )
    if dc.action == "drop" and found.rows:
        kept = [r for i, r in enumerate(kept) if i not in found.rows]
    return kept, summary


def decontamination_check(dec: dict | None) -> AssetCheckResult:
    if dec is None:
        return AssetCheckResult(
            check_name=DECONTAMINATION_CHECK,
            passed=True,
            description="decontamination is off (data.decontamination.action: off)",
        )
    n, suites = dec["contaminated_rows"], dec["suites"]
    where = ", ".join(
        f"{s} {v['training_rows_overlapping']}" for s, v in suites.items() if v["training_rows_overlapping"]
    )
    checked = sum(v["documents_checked"] for v in suites.values())
    if n == 0:
        text = f"no training row overlaps the {checked} gate documents checked ({dec['ngram']}-grams)"
    elif dec["action"] == "drop":
        text = f"{n} of {dec['training_rows']} training rows overlapped gate documents and were dropped ({where})"
    else:
        text = (
            f"{n} of {dec['training_rows']} training rows overlap gate documents ({where}); action 'fail': "
            "nothing downstream runs until the data or data.decontamination changes"
        )
    return AssetCheckResult(
        check_name=DECONTAMINATION_CHECK,
        passed=n == 0 or dec["action"] == "drop",
        description=text,
        metadata={
            "contaminated_rows": n,
            "training_rows": dec["training_rows"],
            "documents_checked": checked,
            "action": dec["action"],
            "suites": MetadataValue.json(suites),
            "examples": MetadataValue.json(dec["examples"]),
        },
    )


def with_replay(spec: CampaignSpec, storage: ArtifactStore, resources: tuple, kept: list[dict], context):
    """``(rows, replay summary, cost lines)``: the filtered task rows with the replay rows (``data.replay``) after
    them, answered, filtered (empty, truncated, duplicates; decontaminated with the rest later) and checked for
    task/replay format conflicts (same prompt shape, other answer format); the task rows alone without replay."""
    rp = spec.data.replay
    if rp is None:
        return kept, None, []
    from campaign_orchestrator.dataset.filtering import FilterRules, filter_generations
    from evaluation.diagnosis import conflicts

    teacher, pricing = resources
    rrows, replay, lines = answer_replay(spec, storage, teacher, pricing, len(kept), context)
    rkept, rcounts = filter_generations(
        rrows, FilterRules(drop_empty=True, drop_truncated=spec.data.filters.drop_truncated, dedupe=True)
    )
    replay |= {
        "filter_counts": rcounts,
        "rows": len(rkept),
        "conflicts": conflicts(
            [(r["prompt"], r["completion"]) for r in kept], [(r["prompt"], r["completion"]) for r in rkept]
        ),
    }
    return kept + rkept, replay, lines


def replay_identity(spec: CampaignSpec, storage: ArtifactStore) -> dict:
    """What the replay rows depend on: the section, the prompts' content, and who answers (the base's content
    identity; the teacher's is in the generations key already; a file's content)."""
    from campaign_orchestrator.content import file_sha256

    rp = spec.data.replay
    out = {"replay": rp.model_dump(), "source_sha256": file_sha256(spec.path(rp.source))}
    if rp.answered_by == "base":
        out["base"] = _base_identity(spec, storage)
    elif rp.answered_by == "file":
        out["answers_sha256"] = file_sha256(spec.path(rp.answers))
    else:
        out["teacher"] = spec.teacher.model_dump(include={"backend", "model", "base_url", "revision", "chat"})
    return out


def _base_identity(spec: CampaignSpec, storage: ArtifactStore) -> str:
    from assets.evaluation import answer_identity

    return answer_identity(spec, storage.resolve_model(spec.student.base_model, spec.project_dir), None)[0]


def with_base_targets(spec: CampaignSpec, storage: ArtifactStore, resources: tuple, kept: list[dict], context):
    """``(rows, summary, cost lines)``: with ``data.targets.content: base``, the task rows with targets built from the
    base's own answers (campaign_orchestrator/dataset/targets.py; answered like base replay); as they are else."""
    if spec.data.targets.content != "base":
        return kept, None, []
    from campaign_orchestrator.dataset.targets import base_targets
    from campaign_orchestrator.generation.requests import Sampling
    from evaluation.scorers import normalize_answer

    def answer(prompts):
        sampling = Sampling(max_new_tokens=spec.data.targets.max_new_tokens)
        res, lines = _replay_by_base(spec, storage, *resources, prompts, sampling, context)
        st = res.stats
        return res.rows, lines, {"generated": st.generated, "cache_hits": st.cache_hits, "seconds": st.generate_s}

    return base_targets(kept, answer, normalize_answer, spec.data.targets.rule, context.log.info)


def answer_replay(spec: CampaignSpec, storage: ArtifactStore, teacher, pricing, task_rows: int, context):
    """``(rows, summary, cost lines)``: the replay prompts for ``data.replay.share`` of the mix, answered by the base
    student (the local engine and the generation cache, under the identity evaluation answers the base with: a
    rerun, or the evaluation of the same prompts, asks nothing; priced as local compute), the teacher (its backend,
    cache and price) or a file, with ``replay:`` ids."""
    from campaign_orchestrator.dataset.replay import file_rows, label, read_prompts, replay_count
    from campaign_orchestrator.generation.requests import Sampling

    rp = spec.data.replay
    pool = read_prompts(spec.path(rp.source))
    chosen = pool[: replay_count(task_rows, rp.share, len(pool))]
    summary = {
        "answered_by": rp.answered_by,
        "source": rp.source,
        "prompts": len(chosen),
        "available": len(pool),
        "share_asked": rp.share,
        "task_rows": task_rows,
    }
    if len(chosen) < round(rp.share / (1 - rp.share) * task_rows):
        context.log.warning(
            f"data.replay: {len(pool)} replay prompts give a share of "
            f"{len(chosen) / (len(chosen) + task_rows):.0%}, below the {rp.share:.0%} asked: add "
            f"prompts to {rp.source}"
        )
    if rp.answered_by == "file":
        return label(file_rows(chosen, spec.path(rp.answers))), summary | {"generated": 0}, []
    sampling = Sampling(max_new_tokens=rp.max_new_tokens)
    answer = _replay_by_teacher if rp.answered_by == "teacher" else _replay_by_base
    res, lines = answer(spec, storage, teacher, pricing, chosen, sampling, context)
    st = res.stats
    context.log.info(
        f"data.replay: {len(chosen)} prompts answered by the {rp.answered_by}: {st.generated} generated, "
        f"{st.cache_hits} from the cache"
    )
    summary |= {
        "generated": st.generated,
        "cache_hits": st.cache_hits,
        "generate_seconds": st.generate_s,
        "usd": sum(x["usd"] for x in lines),
    }
    return label(res.rows), summary, lines


def _replay_by_teacher(spec: CampaignSpec, storage: ArtifactStore, teacher, pricing, chosen, sampling, context):
    """The teacher answers the replay prompts through its backend and cache, billed at its price."""
    from assets.teacher_generations import teacher_setup, teacher_usage
    from campaign_orchestrator.generation.runner import run_generation

    backend, cache, _ident, _store = teacher_setup(storage, teacher, spec, sampling)
    res = run_generation(chosen, backend, sampling, cache, chat=spec.teacher.chat, log=context.log.info)
    return res, pricing.bill(spec, "teacher_generations", teacher_usage(res.stats))["lines"] or []


def _replay_by_base(spec: CampaignSpec, storage: ArtifactStore, teacher, pricing, chosen, sampling, context):
    """The student's base answers the replay prompts locally, cached under the identity evaluation answers the
    base with; billed as local compute where it ran (cache hits cost nothing)."""
    from assets.evaluation import answer_identity
    from campaign_orchestrator.generation.backends import TransformersBackend
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.requests import namespace
    from campaign_orchestrator.generation.runner import run_generation

    s, q = spec.student, spec.student.quantization
    base = storage.resolve_model(s.base_model, spec.project_dir)
    identity, precision = answer_identity(spec, base, None)
    cache = GenerationCache(storage.cache_store(), namespace(identity, sampling), storage.spool_dir())
    backend = TransformersBackend(
        base,
        f"{s.base_model} (base, replay)",
        identity,
        compute_dtype=q.compute_dtype,
        precision=precision,
        load_in_4bit=q.load_in_4bit,
        batch_size=max(x.batch_size for x in spec.evaluation.suites),
    )
    res = run_generation(chosen, backend, sampling, cache, log=context.log.info)
    lines = []
    if res.stats.generated:
        lines = pricing.bill(
            spec, "evaluation", {"seconds": res.stats.generate_s, "device": precision.split(":", 1)[0]}
        )["lines"]
    return res, lines
