"""teacher_generations: the teacher answers every training prompt (Parquet, one row per sample).

The loop, the content-addressed cache and the backends live in ``campaign_orchestrator/generation/``; where the work
runs is the executor's choice (:func:`stages.executors.executor_for`). A re-run after a crash or a kill generates
only what the cache lacks, and identical requests made by other campaigns are never paid for again.
"""

from __future__ import annotations

import time

from campaigns.spec import CampaignSpec
from stages.common import stage_key
from stages.executors import executor_for
from stages.outcome import Outcome
from stages.teacher import UNPRICED_NOTE, TeacherModel, teacher_backend, teacher_model

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


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """The teacher's answers to every training prompt (``inputs["prompts"]``: the prompts stage's manifest),
    generated unless the stage's content key is complete (and had no errors)."""
    from campaign_orchestrator.generation.requests import Sampling

    prompts = inputs["prompts"]
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


def unverified_text(ray: dict) -> str:
    """The paid-unverified share of a Ray stage's bill (requests in flight when a worker was lost), for people."""
    from campaign_orchestrator.generation.scaleout.stage import unverified_text as text

    return text(ray)
