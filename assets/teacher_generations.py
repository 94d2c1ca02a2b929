"""teacher_generations: the teacher answers every training prompt (Parquet, one row per sample).

Thin: the loop, the content-addressed cache and the backends live in ``campaign_orchestrator/generation/``. A
re-materialization after a crash or a kill generates only what the cache lacks, and identical
requests made by other campaigns are never paid for again.
"""

import time

from dagster import AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, key, model_deps, model_identity, stage_key
from assets.progress import RunProgress
from campaign_orchestrator import models
from campaigns.spec import CampaignSpec
from resources.k8s.kuberay_launcher import KubeRayJobLauncher
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from resources.teacher import TeacherResource


def teacher_model_path(storage: ArtifactStore, spec: CampaignSpec):
    """The local checkpoint of the teacher, or None (an endpoint; a vLLM hub id)."""
    t = spec.teacher
    if t.backend == "openai":
        return None
    if t.backend == "vllm" and models.is_hub_id(t.model, spec.project_dir):
        return None  # a hub id vLLM downloads itself; identified by name + revision
    return storage.resolve_model(t.model, spec.project_dir, t.revision)


def teacher_setup(storage: ArtifactStore, teacher: TeacherResource, spec: CampaignSpec, sampling):
    """The teacher's backend, identity and generation cache for ``sampling`` (the same cache for its
    training generations and for scoring it on the held-out items): ``(backend, cache, identity, store)``."""
    from campaign_orchestrator.generation.backends import spec_identity
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.requests import namespace

    t = spec.teacher
    model_path = teacher_model_path(storage, spec)
    weights_id = model_identity(model_path, t.revision) if model_path is not None else None
    identity = spec_identity(t, model_path, weights_id)
    store = storage.cache_store()
    cache = GenerationCache(store, namespace(identity, sampling), storage.spool_dir())
    return teacher.backend(t, model_path, weights_id), cache, identity, store


def teacher_usage(stats) -> dict:
    """What this run's new generations used, as ``pricing.bill`` prices it by the teacher's one price field:
    API tokens paid for in this run (cache hits are free) x ``teacher.price``, or generation seconds x
    ``teacher.hardware`` (x GPUs for vLLM); billed None when ``price: unpriced`` (the spend is unknown)."""
    return {
        "seconds": stats.generate_s,
        "prompt_tokens": stats.new_prompt_tokens,
        "completion_tokens": stats.new_completion_tokens,
    }


UNPRICED_NOTE = "unknown: teacher.price is `unpriced`"


def teacher_on_ray(
    spec: CampaignSpec,
    storage: ArtifactStore,
    pricing: PricingResource,
    rows: list,
    sampling,
    model_path,
    weights_id,
    identity: str,
    stage: str,
    log,
    launch=None,
    **kwargs,
) -> tuple:
    """The teacher answering ``rows`` on Ray (``execution.engine: ray``): ``(result, cost lines per shard tagged
    with the shard id or None when unpriced, the Ray metadata)``; the workers write the same generation cache.
    ``stage``: ``teacher_generations`` or ``teacher_scoring``; ``launch``: how to launch it as a KubeRay RayJob
    (``assets.ray_dispatch.KubeRayLaunch``; used when the campaign sets ``execution.kuberay``)."""
    from assets.ray_dispatch import ray_runner
    from campaign_orchestrator.generation.recipes import BackendRecipe
    from campaign_orchestrator.generation.requests import namespace
    from campaign_orchestrator.generation.scaleout.stage import ray_metadata, shard_cost_lines
    from campaign_orchestrator.generation.scaleout.worker import CacheConfig

    t = spec.teacher
    cfg = CacheConfig(
        storage.cache_store().url,
        namespace(identity, sampling),
        str(storage.spool_dir()),
        storage.s3_endpoint_url,
        storage.s3_region,
    )
    run_on = ray_runner(spec, launch, stage)
    res, run = run_on(
        spec.execution,
        rows,
        BackendRecipe(t, str(model_path) if model_path else None, weights_id),
        identity,
        sampling,
        cfg,
        log=log,
        label=stage.replace("_", " "),
        chat=t.chat,
        context=[m.model_dump() for m in t.context],
        context_categories=t.context_categories,
        price=lambda usage: pricing.bill(spec, stage, usage)["lines"],
        rate_limits=(t.requests_per_minute, t.tokens_per_minute) if t.backend == "openai" else (None, None),
        **kwargs,
    )
    return res, shard_cost_lines(run), ray_metadata(run)


def build(spec: CampaignSpec):
    t = spec.teacher

    @asset(
        key=key(spec, "teacher_generations"),
        group_name=spec.name,
        kinds={"parquet", "pytorch" if t.backend != "openai" else "python"},
        ins={"prompts": AssetIn(key(spec, "prompts"))},
        deps=model_deps(t.model),
        pool="teacher",
        description=f"Teacher `{t.model}` ({t.backend}) answers every training prompt "
        f"(n={t.sampling.n}, content-addressed cache: never paid for twice).",
    )
    def teacher_generations(
        context: AssetExecutionContext,
        prompts: dict,
        storage: ArtifactStore,
        teacher: TeacherResource,
        pricing: PricingResource,
        kuberay: KubeRayJobLauncher,
    ) -> Output[dict]:
        m, cached = materialize(context, spec, prompts, storage, teacher, pricing, kuberay)
        return Output(m, metadata=generations_metadata(m, cached))

    return teacher_generations


def materialize(
    context: AssetExecutionContext,
    spec: CampaignSpec,
    prompts: dict,
    storage: ArtifactStore,
    teacher: TeacherResource,
    pricing: PricingResource,
    kuberay: KubeRayJobLauncher,
) -> tuple[dict, bool]:
    """The teacher's answers to every training prompt, generated unless the stage's content key is complete
    (and had no errors): ``(manifest, cached)``."""
    from campaign_orchestrator.dataset.prompts import read_prompt_table
    from campaign_orchestrator.generation.backends import spec_identity
    from campaign_orchestrator.generation.requests import Sampling, sampling_hash
    from campaign_orchestrator.generation.rows import write_generations

    t = spec.teacher
    model_path = teacher_model_path(storage, spec)
    weights_id = model_identity(model_path, t.revision) if model_path is not None else None
    identity = spec_identity(t, model_path, weights_id)
    sampling = Sampling.from_spec(t.sampling)
    k = stage_key(
        "generations/v2",
        prompts["train_sha256"],
        identity,
        sampling.as_dict(),
        t.chat,
        *([[m.model_dump() for m in t.context], t.context_categories] if t.context else []),
    )
    sd = storage.stage(spec.name, "teacher_generations", k)
    cached = sd.is_complete() and sd.manifest().get("errors", 0) == 0
    if not cached:
        rows = read_prompt_table(prompts["train_path"])
        t0 = time.perf_counter()
        store = storage.cache_store()
        res, lines, ray_md = _generate(
            context, spec, storage, teacher, pricing, kuberay, sd, rows, (sampling, model_path, weights_id, identity)
        )
        path = write_generations(res.rows, sd.ensure() / "generations.parquet")
        st = res.stats
        if ray_md is None:
            lines = pricing.bill(spec, "teacher_generations", teacher_usage(st))["lines"]
        sd.commit(
            {
                "generations_path": str(path),
                "rows": len(res.rows),
                "prompt_tokens": st.prompt_tokens,
                "completion_tokens": st.completion_tokens,
                "errors": st.failed,
                "model_identity": identity,
                "sampling_hash": sampling_hash(sampling),
                "cache": store.url,
                "stats": st.as_dict(),
                "wall_seconds": time.perf_counter() - t0,
                "cost_lines": lines or [],
                **({"cost_unknown": UNPRICED_NOTE} if lines is None else {}),
                **({"ray": ray_md} if ray_md else {}),
            }
        )
    return sd.manifest(), cached


def _generate(
    context,
    spec: CampaignSpec,
    storage: ArtifactStore,
    teacher: TeacherResource,
    pricing: PricingResource,
    kuberay: KubeRayJobLauncher,
    sd,
    rows: list,
    model: tuple,
) -> tuple:
    """The teacher answering ``rows`` under the stage's budget guard, on Ray or in this process:
    ``(result, cost lines or None, Ray metadata or None)``; ``model``: ``(sampling, path, weights id, identity)``."""
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.requests import namespace
    from campaign_orchestrator.generation.runner import run_generation

    t = spec.teacher
    sampling, model_path, weights_id, identity = model
    cache = GenerationCache(storage.cache_store(), namespace(identity, sampling), storage.spool_dir())
    backend = teacher.backend(t, model_path, weights_id)
    # the budget guard is charged what each new generation used (cache hits are free) and stops the
    # stage cleanly (the cache keeps what finished)
    guard = pricing.guard(context, spec, sd)
    progress = RunProgress(context.log, len(rows) * sampling.n, "teacher generations", "samples")
    lines = ray_md = None
    try:
        if spec.execution.engine == "ray":  # shards on a Ray actor pool: here, or a KubeRay RayJob
            from assets.ray_dispatch import KubeRayLaunch

            launch = KubeRayLaunch(context, kuberay, "teacher_generations", sd.path / "ray")
            res, lines, ray_md = teacher_on_ray(
                spec,
                storage,
                pricing,
                rows,
                sampling,
                model_path,
                weights_id,
                identity,
                "teacher_generations",
                context.log.info,
                launch=launch,
                progress=progress,
                budget=guard,
            )
        else:
            res = run_generation(
                rows,
                backend,
                sampling,
                cache,
                chat=t.chat,
                context=[m.model_dump() for m in t.context],
                context_categories=t.context_categories,
                progress=progress,
                log=context.log.info,
                budget=guard,
            )
    finally:
        progress.close()
    return res, lines, ray_md


def generations_metadata(m: dict, cached: bool) -> dict:
    """The generations' manifest as Dagster metadata."""
    st = m["stats"]
    md = base_metadata(m, cached) | {
        "rows": m["rows"],
        "prompt_tokens": m["prompt_tokens"],
        "completion_tokens": m["completion_tokens"],
        "errors": m["errors"],
        "cache_hits": st["cache_hits"],
        "new_generations": st["generated"],
        "cache_hits_cost": f"{st['cache_hits']} cache hits ($0)",
        "recovered_from_killed_run": st["recovered_rows"],
        "failures": st["failed"],
        "retries": st["retries"],
        "http_requests": st["http_requests"],
        "rows_per_s": st["rows_per_s"],
        "tokens_per_s": st["tokens_per_s"],
        "generate_seconds": st["generate_s"],
        "finish_reasons": MetadataValue.json(st["finish_reasons"]),
        "cache": m["cache"],
        "model_identity": m["model_identity"][:48],
    }
    if st.get("compute_dtype"):
        md["compute_dtype"] = st["compute_dtype"]
    if m.get("ray"):  # shards done/total, per-node work, lost workers, per-shard tokens/seconds/dollars
        r = m["ray"]
        md |= {
            "shards": f"{r['shards_done']}/{r['shards_total']}",
            "shards_retried": r["shards_retried"],
            "ray_tokens_per_s": r["ray_tokens_per_s"],
            "ray_nodes": MetadataValue.json(r["nodes"]),
            "ray_shards": MetadataValue.json(r["shards"]),
        }
        if r["lost_workers"]:
            md["ray_lost_workers"] = MetadataValue.json(r["lost_workers"])
        if r.get("unverified_requests"):  # in flight when a worker was lost: paid at their upper bound
            from campaign_orchestrator.generation.scaleout.stage import unverified_text

            md["ray_unverified"] = unverified_text(r)
    if st["retry_reasons"]:
        md["retry_reasons"] = MetadataValue.json(st["retry_reasons"])
    if m.get("cost_unknown"):  # never $0: the tokens were bought at a price nobody told us
        md |= {"cost_usd": m["cost_unknown"], "spent_this_run_usd": "0 (cached)" if cached else m["cost_unknown"]}
    return md
