"""teacher_generations: the teacher answers every training prompt (Parquet, one row per sample).

Thin: the stage (``stages/teacher_generations.py``) owns its key, cache check, executor, budget, billing and
commit; the loop, the content-addressed cache and the backends live in ``campaign_orchestrator/generation/``.
"""

from dagster import AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, dagster_failures, for_people, key, model_deps, stage_context
from campaigns.spec import CampaignSpec
from resources.k8s.kuberay_launcher import KubeRayJobLauncher
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from resources.teacher import TeacherResource
from stages import teacher_generations as stage


def build(spec: CampaignSpec):
    t, ts = spec.teacher, spec.teachers
    about = (
        f"Teacher `{t.model}` ({t.backend}) answers every training prompt "
        f"(n={t.sampling.n}, content-addressed cache: never paid for twice)."
        if not spec.several_teachers
        else "Teachers "
        + ", ".join(f"`{e.name}` ({e.backend} `{e.model}`: {', '.join(e.categories or ['the rest'])})" for e in ts)
        + " answer the training prompts of their categories (each its own content-addressed cache: never paid "
        "for twice)."
    )

    @asset(
        key=key(spec, "teacher_generations"),
        group_name=spec.name,
        kinds={"parquet", *("python" if e.api else "pytorch" for e in ts)},
        ins={"prompts": AssetIn(key(spec, "prompts"))},
        deps=model_deps(*dict.fromkeys(e.model for e in ts)),
        pool="teacher",
        description=about,
    )
    def teacher_generations(
        context: AssetExecutionContext,
        prompts: dict,
        storage: ArtifactStore,
        teacher: TeacherResource,
        pricing: PricingResource,
        kuberay: KubeRayJobLauncher,
    ) -> Output[dict]:
        ctx = stage_context(context, storage, pricing, teacher, kuberay=kuberay)
        with dagster_failures():
            out = stage.run(spec, {"prompts": prompts}, ctx)
        return Output(out.manifest, metadata=for_people(generations_metadata(out.manifest, out.cached)))

    return teacher_generations


def generations_metadata(m: dict, reused: bool) -> dict:
    """The generations' manifest as Dagster metadata: the output, and (when this run made it) the work this run did
    to make it; a reused output claims none of it (it was done in the run it came from)."""
    st = m["stats"]
    md = base_metadata(m, reused) | {
        "rows": m["rows"],
        "prompt_tokens": m["prompt_tokens"],
        "completion_tokens": m["completion_tokens"],
        "errors": m["errors"],
        "finish_reasons": MetadataValue.json(st["finish_reasons"]),
        "cache": m["cache"],
        "model_identity": m["model_identity"][:48],
    }
    if st.get("compute_dtype"):
        md["compute_dtype"] = st["compute_dtype"]
    if m.get("teachers"):  # several teachers: each one's categories, rows, new generations, cache hits, dollars
        md["teachers"] = MetadataValue.json(m["teachers"])
    if m.get("stopped_teachers"):  # stopped by their budget share, the others went on
        md["stopped_teachers"] = MetadataValue.json(m["stopped_teachers"])
    if reused:
        return md
    md |= {
        "new_generations": st["generated"],
        "cache_hits": st["cache_hits"],  # free: never paid twice (the cost says what this output cost)
        "recovered_from_killed_run": st["recovered_rows"],
        "failures": st["failed"],
        "retries": st["retries"],
        "http_requests": st["http_requests"],
        "rows_per_s": st["rows_per_s"],
        "tokens_per_s": st["tokens_per_s"],
        "generate_seconds": st["generate_s"],
    }
    for name, r in (m.get("ray_teachers") or {}).items():  # several teachers on Ray: each one's shards
        md[f"shards {name}"] = f"{r['shards_done']}/{r['shards_total']}"
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
            md["ray_unverified"] = stage.unverified_text(r)
    if st["retry_reasons"]:
        md["retry_reasons"] = MetadataValue.json(st["retry_reasons"])
    return md
