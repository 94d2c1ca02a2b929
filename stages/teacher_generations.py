"""teacher_generations: the teacher answers every training prompt (Parquet, one row per sample).

The loop, the content-addressed cache and the backends live in ``campaign_orchestrator/generation/``; where the work
runs is the executor's choice (:func:`stages.executors.executor_for`). A re-run after a crash or a kill generates
only what the cache lacks, and identical requests made by other campaigns are never paid for again.

Several teachers (``teacher:`` as a list): each answers the prompts of its categories, in the file's order, through
its own backend, generation cache (its identity) and price, under a budget guard of its own (:func:`_routed`): every
row names its teacher (the ``teacher`` column), every cost line too. A teacher stopped by its ``budget_share`` stops
alone: the others go on, the stage commits every row it has (the stopped teacher's finished answers included,
from its cache) with ``stopped_teachers`` saying who stopped and why, and a later run asks that teacher for the rest
(the stage is not found complete while a teacher is stopped). Any other budget stops the stage, as with one teacher.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from campaigns.spec import CampaignSpec
from stages.common import stage_key
from stages.executors import executor_for
from stages.outcome import Outcome
from stages.teacher import UNPRICED_NOTE, TeacherModel, ask_kwargs, route, teacher_backend, teacher_cache, teacher_model

STAGE = "teacher_generations"


def content_key(spec: CampaignSpec, prompts: dict, tm: TeacherModel, sampling) -> str:
    """The training prompts' content, the teacher's identity, its sampling and how it is asked."""
    t = spec.teacher
    return stage_key(
        "generations/v2",
        prompts["train_sha256"],
        tm.identity,
        sampling.as_dict(),
        t.chat,
        *([[m.model_dump() for m in t.context], t.context_categories] if t.context else []),
    )


def routed_key(spec: CampaignSpec, prompts: dict, teachers: list[TeacherWork]) -> str:
    """Several teachers: the training prompts' content and, per teacher, its name, categories, identity, sampling
    and how it is asked (a teacher changed or a category moved changes the key; the generation caches keep every
    teacher's answers, so only what changed is asked again)."""
    parts = []
    for w in teachers:
        t = w.view.teacher
        parts.append(
            [
                w.entry.name,
                w.entry.categories,
                w.model.identity,
                w.sampling.as_dict(),
                t.chat,
                *([[m.model_dump() for m in t.context], t.context_categories] if t.context else []),
            ]
        )
    return stage_key("generations/routed/v1", prompts["train_sha256"], parts)


@dataclass(frozen=True)
class TeacherWork:
    """One of several teachers as the stage asks it: its entry, the campaign as it sees it, its model and sampling."""

    entry: object
    view: CampaignSpec
    model: TeacherModel
    sampling: object


def teacher_works(spec: CampaignSpec, store) -> list[TeacherWork]:
    from campaign_orchestrator.generation.requests import Sampling

    out = []
    for e in spec.teachers:
        view = spec.for_teacher(e)
        out.append(TeacherWork(e, view, teacher_model(store, view), Sampling.from_spec(view.teacher.sampling)))
    return out


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """The teacher's answers to every training prompt (``inputs["prompts"]``: the prompts stage's manifest),
    generated unless the stage's content key is complete (and had no errors, and no teacher stopped)."""
    from campaign_orchestrator.generation.requests import Sampling

    prompts = inputs["prompts"]
    if spec.several_teachers:
        works = teacher_works(spec, ctx.store)
        sd = ctx.store.stage(spec.name, STAGE, routed_key(spec, prompts, works))
        m = sd.manifest() if sd.is_complete() else {}
        cached = bool(m) and m.get("errors", 0) == 0 and not m.get("stopped_teachers")
        if not cached:
            _routed(spec, ctx, sd, prompts, works)
        return Outcome(sd.manifest(), cached)
    tm = teacher_model(ctx.store, spec)
    sampling = Sampling.from_spec(spec.teacher.sampling)
    sd = ctx.store.stage(spec.name, STAGE, content_key(spec, prompts, tm, sampling))
    cached = sd.is_complete() and sd.manifest().get("errors", 0) == 0
    if not cached:
        _generate(spec, ctx, sd, prompts, tm, sampling)
    return Outcome(sd.manifest(), cached)


def _generate(spec: CampaignSpec, ctx, sd, prompts: dict, tm: TeacherModel, sampling) -> None:
    """The teacher answering every training prompt under the stage's budget guard, where the executor runs it;
    the rows, their usage and cost committed to ``sd``."""
    from campaign_orchestrator.dataset.prompts import read_prompt_table
    from campaign_orchestrator.generation.requests import sampling_hash
    from campaign_orchestrator.generation.rows import write_generations

    rows = read_prompt_table(prompts["train_path"])
    t0 = time.perf_counter()
    store = ctx.store.cache_store()
    backend = teacher_backend(ctx.teacher, spec.teacher, tm.path, tm.weights_id)
    # the budget guard is charged what each new generation used (cache hits are free) and stops the
    # stage cleanly (the cache keeps what finished)
    guard = ctx.pricing.guard(ctx, spec, sd)
    progress = ctx.progress(len(rows) * sampling.n, "teacher generations", "samples")
    executor = executor_for(spec, STAGE, ctx, sd.path / "ray")
    try:
        res, lines, ray_md = executor.teacher(
            ctx, spec, backend, rows, sampling, tm, STAGE, log=ctx.log.info, progress=progress, budget=guard
        )
    finally:
        progress.close()
    path = write_generations(res.rows, sd.ensure() / "generations.parquet")
    st = res.stats
    sd.commit(
        {
            "generations_path": str(path),
            "rows": len(res.rows),
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": st.completion_tokens,
            "errors": st.failed,
            "model_identity": tm.identity,
            "sampling_hash": sampling_hash(sampling),
            "cache": store.url,
            "stats": st.as_dict(),
            "wall_seconds": time.perf_counter() - t0,
            "cost_lines": lines or [],
            **({"cost_unknown": UNPRICED_NOTE} if lines is None else {}),
            **({"ray": ray_md} if ray_md else {}),
        }
    )


def _routed(spec: CampaignSpec, ctx, sd, prompts: dict, works: list[TeacherWork]) -> None:
    """Several teachers, each answering its categories' prompts in turn (one executor; on KubeRay one job
    directory per teacher) under its own guard; the rows, per-teacher counts, tagged cost lines and the teachers a
    budget share stopped committed to ``sd``."""
    from campaign_orchestrator.dataset.prompts import read_prompt_table
    from campaign_orchestrator.generation.runner import GenerationStats, cached_rows
    from stages.errors import TeacherStopped
    from stages.pricing import TeacherShare, tag_lines

    rows = read_prompt_table(prompts["train_path"])
    routed = route(spec, rows)
    t0 = time.perf_counter()
    executor = executor_for(spec, STAGE, ctx, sd.path / "ray")
    progress = ctx.progress(
        sum(len(routed[w.entry.name]) * w.sampling.n for w in works), "teacher generations", "samples"
    )
    out_rows, lines, stats, teachers, stopped, ray = [], [], [], {}, {}, {}
    unknown: list[str] = []
    accrued: list[float] = []  # what each teacher asked before accrued in this attempt (the ledger has it at commit)
    try:
        for w in works:
            name, part = w.entry.name, routed[w.entry.name]
            if not part:
                teachers[name] = {"categories": w.entry.categories, "rows": 0, "model_identity": w.model.identity}
                continue
            share = TeacherShare(name, w.entry.budget_share, len(part) / len(rows), lambda: sum(accrued))
            guard = ctx.pricing.guard(ctx, w.view, sd, teacher=share)
            backend = teacher_backend(ctx.teacher, w.view.teacher, w.model.path, w.model.weights_id)
            ctx.log.info(f"teacher {name} ({w.view.teacher.backend} {w.view.teacher.model}): {len(part)} prompts")
            try:
                res, got, ray_md = executor.at(name).teacher(
                    ctx,
                    w.view,
                    backend,
                    part,
                    w.sampling,
                    w.model,
                    STAGE,
                    log=ctx.log.info,
                    progress=progress,
                    budget=guard,
                )
            except TeacherStopped as e:  # this teacher alone: keep what it finished (cached, paid: interrupted)
                stopped[name] = str(e)
                ctx.log.warning(f"teacher {name} stopped, the others go on: {e}")
                cache = teacher_cache(ctx.store, w.model.identity, w.sampling)
                res, got, ray_md = (
                    cached_rows(part, w.model.identity, w.sampling, cache, **ask_kwargs(w.view.teacher)),
                    [],
                    None,
                )
            accrued.append(guard.interrupted_usd if name in stopped else sum(x["usd"] for x in got or []))
            if got is None:
                unknown.append(name)
            lines += tag_lines(got, name) or []
            out_rows += [r | {"teacher": name} for r in res.rows]
            stats.append(res.stats)
            teachers[name] = _teacher_summary(w, res, got, len(part), stopped.get(name))
            if ray_md:
                ray[name] = ray_md
    finally:
        progress.close()
    _commit_routed(sd, ctx.store, out_rows, GenerationStats.merged(stats), lines, teachers, stopped, unknown, ray, t0)


def _teacher_summary(w: TeacherWork, res, lines: list | None, prompts: int, stopped: str | None) -> dict:
    """One teacher's part of the stage's manifest."""
    st = res.stats
    return {
        "categories": w.entry.categories,
        "backend": w.view.teacher.backend,
        "model": w.view.teacher.model,
        "model_identity": w.model.identity,
        "prompts": prompts,
        "rows": len(res.rows),
        "generated": st.generated,
        "cache_hits": st.cache_hits,
        "failed": st.failed,
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.completion_tokens,
        "usd": None if lines is None else sum(x["usd"] for x in lines),
        **({"stopped": stopped} if stopped else {}),
    }


def _commit_routed(sd, store, rows, st, lines, teachers, stopped, unknown, ray, t0) -> None:
    """The routed stage's manifest: the one-teacher fields over every teacher's rows, and ``teachers`` (each one's
    categories, identity, rows, new generations, cache hits, tokens and dollars; ``stopped``: why its budget share
    stopped it), ``stopped_teachers`` (name -> why) and, on Ray, ``ray_teachers`` (each one's Ray metadata)."""
    from campaign_orchestrator.generation.rows import write_generations

    path = write_generations(rows, sd.ensure() / "generations.parquet")
    sd.commit(
        {
            "generations_path": str(path),
            "rows": len(rows),
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": st.completion_tokens,
            "errors": st.failed,
            "model_identity": "; ".join(f"{n}={t['model_identity']}" for n, t in teachers.items()),
            "cache": store.cache_store().url,
            "teachers": teachers,
            "stopped_teachers": stopped,
            "stats": st.as_dict(),
            "wall_seconds": time.perf_counter() - t0,
            "cost_lines": lines,
            **({"cost_unknown": f"{UNPRICED_NOTE} (teacher {', '.join(unknown)})"} if unknown else {}),
            **({"ray_teachers": ray} if ray else {}),
        }
    )


def unverified_text(ray: dict) -> str:
    """The paid-unverified share of a Ray stage's bill (requests in flight when a worker was lost), for people."""
    from campaign_orchestrator.generation.scaleout.stage import unverified_text as text

    return text(ray)
