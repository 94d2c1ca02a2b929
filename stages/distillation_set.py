"""distillation_set: teacher generations filtered and deduplicated, each rule counted, the self-replay rows added
(``data.replay``); then checked for overlap with every gate suite's documents (judged by the blocking
``decontamination`` check, before training): overlapping examples are dropped and counted, or the check fails
(``data.decontamination``)."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from campaign_orchestrator.dataset.replay import REPLAY_PREFIX
from campaigns.spec import CampaignSpec
from stages.common import stage_key
from stages.outcome import Outcome
from stages.storage import Store


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
            ("completion_token_strings", pa.list_(pa.string())),
            ("teacher", pa.string()),
        ]
    )


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """The teacher's generations (``inputs["generations"]``) filtered by the campaign's rules, with the self-replay
    rows added (``data.replay``: answered by the teacher or the student's base, through ``ctx``), and decontaminated
    against the gate suites, unless the stage's content key is complete (``inputs["prompts"]``: the prompts
    stage's manifest)."""
    from campaign_orchestrator.dataset.filtering import FilterRules, filter_generations
    from campaign_orchestrator.generation.rows import read_generations
    from evaluation.scorers import get_scorer

    generations, prompts, storage = inputs["generations"], inputs["prompts"], ctx.store
    f = spec.data.filters
    sd = storage.stage(spec.name, "distillation_set", content_key(spec, generations, prompts, storage))
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
        kept, targets, target_lines = with_base_targets(spec, ctx, kept, prompts)
        kept = with_prefix_space(spec, ctx, kept)
        kept, replay, replay_lines = with_replay(spec, ctx, kept)
        kept, contamination = _decontaminate(spec, kept, prompts, ctx, sd)
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
    return Outcome(sd.manifest(), cached)


def content_key(spec: CampaignSpec, generations: dict, prompts: dict, storage: Store) -> str:
    """The stage's content key: the generations, the filter rules (and the references they score against), the
    decontamination settings and gate documents when on, the replay's identity when on, the targets section and the
    base's identity with ``data.targets.content: base``, the section with ``prefix_space`` on (both left out at the
    default: the other campaigns' keys stay)."""
    f, dc, rp = spec.data.filters, spec.data.decontamination, spec.data.replay
    gate_docs = None
    if dc.action != "off":
        from stages.harness import gate_documents_identity

        gate_docs = gate_documents_identity(spec, storage, prompts["heldout_sha256"])
    return stage_key(
        "distill/v2",
        generations["key"],
        f.model_dump(),
        prompts["train_sha256"] if f.scorer else None,
        *([dc.model_dump(), gate_docs] if gate_docs is not None else []),
        *([replay_identity(spec, storage)] if rp is not None else []),
        *(
            [spec.data.targets.key_fields(), base_identity(spec, storage)]
            if targets_from_base(spec)
            else [spec.data.targets.key_fields()]
            if spec.data.targets.prefix_space
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
                "completion_token_strings": r.get("completion_token_strings"),
                "teacher": r.get("teacher") or r.get("model"),  # its name with several teachers
            }
            for r in kept
        ],
        schema=distill_schema(),
    )
    pq.write_table(table, path)
    return path


def _decontaminate(spec: CampaignSpec, kept: list[dict], prompts: dict, ctx, sd):
    """(rows to keep, the decontamination summary or None when off)."""
    dc = spec.data.decontamination
    if dc.action == "off":
        return kept, None
    from campaign_orchestrator.dataset.decontamination import build_index, find_contamination
    from campaign_orchestrator.dataset.prompts import read_prompt_table
    from stages.harness import gate_documents

    docs = gate_documents(
        spec, read_prompt_table(prompts["heldout_path"]), ctx.store, sd.ensure() / "lm_eval", log=ctx.log.info
    )
    found = find_contamination(kept, build_index(docs, dc.ngram, dc.min_doc_tokens))
    ids = [f"{r['id']}#{r['sample_index']}" if r.get("sample_index") else str(r["id"]) for r in kept]
    summary = found.summary(len(kept), ids=ids) | {"action": dc.action}
    ctx.log.info(
        f"decontamination: {found.contaminated} of {len(kept)} training rows overlap a gate suite "
        f"({dc.ngram}-grams; action {dc.action})"
    )
    if dc.action == "drop" and found.rows:
        kept = [r for i, r in enumerate(kept) if i not in found.rows]
    return kept, summary


# a warning when this share of the replay's answers is cut at its max_new_tokens and dropped: the replay loses its
# long answers and part of its share (smollm2_facts.yaml, measured: docs/results.md, "Keeping what the student
# knows")
TRUNCATED_REPLAY_WARN = 0.1


def with_replay(spec: CampaignSpec, ctx, kept: list[dict]):
    """``(rows, replay summary, cost lines)``: the filtered task rows with the replay rows (``data.replay``) after
    them, answered, filtered (empty, truncated, duplicates; decontaminated with the rest later) and checked for
    task/replay format conflicts (same prompt shape, other answer format); the task rows alone without replay."""
    rp = spec.data.replay
    if rp is None:
        return kept, None, []
    from campaign_orchestrator.dataset.filtering import FilterRules, filter_generations
    from evaluation.diagnosis import conflicts

    rrows, replay, lines = answer_replay(spec, ctx, len(kept))
    rkept, rcounts = filter_generations(
        rrows, FilterRules(drop_empty=True, drop_truncated=spec.data.filters.drop_truncated, dedupe=True)
    )
    cut = rcounts.get("truncated", 0)
    if cut >= TRUNCATED_REPLAY_WARN * max(1, len(rrows)):
        ctx.log.warning(
            f"data.replay: {cut} of {len(rrows)} replay answers reached data.replay.max_new_tokens "
            f"({rp.max_new_tokens}) and were dropped as truncated (data.filters.drop_truncated): the replay keeps "
            f"only the shorter answers and is {len(rkept) / max(1, len(kept) + len(rkept)):.0%} of the mix, not the "
            f"{rp.share:.0%} asked. Raise data.replay.max_new_tokens (and training.max_seq_len if the rows outgrow "
            'it): docs/results.md, "Keeping what the student knows"'
        )
    replay |= {
        "filter_counts": rcounts,
        "rows": len(rkept),
        "conflicts": conflicts(
            [(r["prompt"], r["completion"]) for r in kept], [(r["prompt"], r["completion"]) for r in rkept]
        ),
    }
    return kept + rkept, replay, lines


def replay_identity(spec: CampaignSpec, storage: Store) -> dict:
    """What the replay rows depend on: the section, the prompts' content, and who answers (the base's content
    identity; the teacher's is in the generations key already; a file's content)."""
    from campaign_orchestrator.content import file_sha256

    rp = spec.data.replay
    out = {"replay": rp.model_dump(), "source_sha256": file_sha256(spec.path(rp.source))}
    if rp.answered_by == "base":
        out["base"] = base_identity(spec, storage)
    elif rp.answered_by == "file":
        out["answers_sha256"] = file_sha256(spec.path(rp.answers))
    elif not spec.several_teachers:
        out["teacher"] = spec.teacher.model_dump(include={"backend", "model", "base_url", "revision", "chat"})
    else:  # each teacher answers the replay prompts of its categories
        fields = {"name", "categories", "backend", "model", "base_url", "revision", "chat"}
        out["teachers"] = [e.model_dump(include=fields) for e in spec.teachers]
    return out


def base_identity(spec: CampaignSpec, storage: Store) -> str:
    """The content identity the student's base answers under (evaluation's: the same prompts share its cache)."""
    from stages.answers import answer_identity

    return answer_identity(spec, storage.resolve_model(spec.student.base_model, spec.project_dir), None)[0]


def with_base_targets(spec: CampaignSpec, ctx, kept: list[dict], prompts: dict):
    """``(rows, summary, cost lines)``: with ``data.targets.content: base``, the task rows with targets built from the
    base's own answers to their prompts (``campaign_orchestrator/dataset/targets.py``; the base answers them as it
    answers replay prompts; ``prompts``: the prompts stage's manifest, whose training references are the task's
    answer set); the rows as they are, no summary, else."""
    if not targets_from_base(spec):
        return kept, None, []
    from campaign_orchestrator.dataset.targets import base_targets
    from campaign_orchestrator.generation.requests import Sampling
    from evaluation.scorers import normalize_answer

    t = spec.data.targets

    def answer(prompts):
        res, lines = _replay_by_base(spec, ctx, prompts, Sampling(max_new_tokens=t.max_new_tokens))
        st = res.stats
        return res.rows, lines, {"generated": st.generated, "cache_hits": st.cache_hits, "seconds": st.generate_s}

    references: list[str] = []
    row_references: dict[str, str] = {}
    if t.rule in ("short_form_or_reference", "known"):  # the task's answer set: the training prompts' references
        from campaign_orchestrator.dataset.prompts import read_prompt_table

        table = read_prompt_table(prompts["train_path"])
        references = sorted({r["reference"] for r in table if r.get("reference")})
        row_references = {r["prompt"]: r["reference"] for r in table if r.get("reference")}
        if t.rule == "known" and not row_references:
            raise ValueError(
                f"campaign {spec.name}: data.targets.rule: known keeps the rows whose base answer names their "
                f"reference, and no training prompt in {spec.data.source} has a `reference`: add references to "
                "the prompt file, or use rule: short_form"
            )
    return base_targets(kept, answer, normalize_answer, t.rule, ctx.log.info, references, row_references)


def with_prefix_space(spec: CampaignSpec, ctx, kept: list[dict]) -> list[dict]:
    """``data.targets.prefix_space``: each task target written after one space, as the word stands inside a sentence
    (the replay rows, added after, stay as they are); the rows as they are, else."""
    if not spec.data.targets.prefix_space:
        return kept
    ctx.log.info(f"data.targets.prefix_space: {len(kept)} task targets written after one space")
    return [r | {"completion": " " + r["completion"].lstrip()} if r.get("completion") else r for r in kept]


def answer_replay(spec: CampaignSpec, ctx, task_rows: int):
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
        ctx.log.warning(
            f"data.replay: {len(pool)} replay prompts give a share of "
            f"{len(chosen) / (len(chosen) + task_rows):.0%}, below the {rp.share:.0%} asked: add "
            f"prompts to {rp.source}"
        )
    if rp.answered_by == "file":
        return label(file_rows(chosen, spec.path(rp.answers))), summary | {"generated": 0}, []
    sampling = Sampling(max_new_tokens=rp.max_new_tokens)
    answer = _replay_by_teacher if rp.answered_by == "teacher" else _replay_by_base
    res, lines = answer(spec, ctx, chosen, sampling)
    st = res.stats
    ctx.log.info(
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


def _replay_by_teacher(spec: CampaignSpec, ctx, chosen, sampling):
    """The teacher answers the replay prompts in this process through its backend and cache (chat, no context
    turns), billed at its price; several teachers each answer the prompts of their categories (rows and cost lines
    named by teacher)."""
    from campaign_orchestrator.generation.runner import GenerationResult, GenerationStats, run_generation
    from stages.pricing import tag_lines
    from stages.teacher import route, teacher_setup, teacher_usage

    if not spec.several_teachers:
        backend, cache, _tm = teacher_setup(ctx, spec, sampling)
        res = run_generation(chosen, backend, sampling, cache, chat=spec.teacher.chat, log=ctx.log.info)
        return res, ctx.pricing.bill(spec, "teacher_generations", teacher_usage(res.stats))["lines"] or []
    rows, stats, lines = {}, [], []
    for name, part in route(spec, chosen).items():
        if not part:
            continue
        view = spec.for_teacher(name)
        backend, cache, _tm = teacher_setup(ctx, view, sampling)
        res = run_generation(part, backend, sampling, cache, chat=view.teacher.chat, log=ctx.log.info)
        rows |= {r["id"]: r | {"teacher": name} for r in res.rows}
        stats.append(res.stats)
        lines += tag_lines(ctx.pricing.bill(view, "teacher_generations", teacher_usage(res.stats))["lines"], name) or []
    return GenerationResult([rows[p["id"]] for p in chosen], GenerationStats.merged(stats)), lines


def _replay_by_base(spec: CampaignSpec, ctx, chosen, sampling):
    """The student's base answers the replay prompts locally, cached under the identity evaluation answers the
    base with; billed as local compute where it ran (cache hits cost nothing)."""
    from campaign_orchestrator.generation.backends import TransformersBackend
    from campaign_orchestrator.generation.runner import run_generation
    from stages.answers import answer_identity, batch_size
    from stages.teacher import teacher_cache

    storage = ctx.store
    s, q = spec.student, spec.student.quantization
    base = storage.resolve_model(s.base_model, spec.project_dir)
    identity, precision = answer_identity(spec, base, None)
    cache = teacher_cache(storage, identity, sampling)
    backend = TransformersBackend(
        base,
        f"{s.base_model} (base, replay)",
        identity,
        compute_dtype=q.compute_dtype,
        precision=precision,
        load_in_4bit=q.load_in_4bit,
        batch_size=batch_size(spec),
    )
    res = run_generation(chosen, backend, sampling, cache, log=ctx.log.info)
    lines = []
    if res.stats.generated:
        lines = ctx.pricing.bill(
            spec, "evaluation", {"seconds": res.stats.generate_s, "device": precision.split(":", 1)[0]}
        )["lines"]
    return res, lines


def rule_names() -> tuple:
    """The filter rules, each counted in ``filter_counts`` (``campaign_orchestrator.dataset.filtering.RULES``)."""
    from campaign_orchestrator.dataset.filtering import RULES

    return tuple(RULES)


def targets_from_base(spec: CampaignSpec) -> bool:
    """The training targets are built from the base's own answers (``data.targets.content: base``)."""
    return spec.data.targets.content == "base"


def replays_base(spec: CampaignSpec) -> bool:
    """The student's base answers prompts for the stage: the replay prompts (``data.replay.answered_by: base``) or
    the task prompts (``data.targets.content: base``); the stage reads it."""
    rp = spec.data.replay
    return (rp is not None and rp.answered_by == "base") or targets_from_base(spec)
