"""teacher_generations: the teacher answers every training prompt (Parquet, one row per sample)."""

import time

from dagster import AssetExecutionContext, AssetIn, Output, asset

from assets.common import base_metadata, key, model_deps, model_identity, stage_key
from assets.progress import RunProgress
from campaigns.spec import CampaignSpec
from lineage.hashing import short, value_sha256
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from resources.teacher import TeacherResource


def build(spec: CampaignSpec):
    t = spec.teacher

    @asset(key=key(spec, "teacher_generations"), group_name=spec.name, kinds={"pytorch", "parquet"},
           ins={"prompts": AssetIn(key(spec, "prompts"))}, deps=model_deps(t.model), pool="teacher",
           description=f"Teacher `{t.model}` ({t.backend}) answers every training prompt.")
    def teacher_generations(context: AssetExecutionContext, prompts: dict, storage: ArtifactStore,
                            teacher: TeacherResource, pricing: PricingResource) -> Output[dict]:
        from dataprep.prompts import read_prompt_table
        from generation.rows import write_generations

        model_path = storage.resolve_model(t.model) if t.backend != "openai" else None
        identity = model_identity(model_path, t.revision) if model_path else f"{t.base_url}|{t.model}|{t.revision}"
        sampling_hash = short(value_sha256(t.sampling.model_dump()), 16)
        k = stage_key("generations/v1", prompts["train_sha256"], identity, t.backend, sampling_hash)
        sd = storage.stage(spec.name, "teacher_generations", k)
        cached = sd.is_complete()
        if not cached:
            rows = read_prompt_table(prompts["train_path"])
            t0 = time.perf_counter()
            progress = pricing.budget_guard(context, spec, sd).watch(
                RunProgress(context.log, len(rows) * t.sampling.n, "teacher generations", "prompts"))
            out_rows = []
            for sample in range(t.sampling.n):
                sampling = t.sampling.model_copy(update={"seed": t.sampling.seed + sample})
                comps = teacher.generate(t.model_copy(update={"sampling": sampling}), model_path,
                                         [r["prompt"] for r in rows], progress=progress)
                for r, c in zip(rows, comps, strict=True):
                    out_rows.append({"id": r["id"], "sample_index": sample, "prompt": r["prompt"], "completion": c.text,
                                     "finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
                                     "completion_tokens": c.completion_tokens, "latency_s": c.latency_s,
                                     "backend": t.backend, "model": t.model, "sampling_hash": sampling_hash,
                                     "error": c.error})
            progress.close()
            wall = time.perf_counter() - t0
            path = write_generations(out_rows, sd.ensure() / "generations.parquet")
            prompt_tok = sum(r["prompt_tokens"] for r in out_rows)
            compl_tok = sum(r["completion_tokens"] for r in out_rows)
            lines = pricing.teacher_lines(spec, wall, prompt_tok, compl_tok)
            sd.commit({"generations_path": str(path), "rows": len(out_rows), "prompt_tokens": prompt_tok,
                       "completion_tokens": compl_tok, "errors": sum(1 for r in out_rows if r["error"]),
                       "model_identity": identity, "wall_seconds": wall, "cost_lines": lines})
        m = sd.manifest()
        tokens = m["prompt_tokens"] + m["completion_tokens"]
        md = base_metadata(m, cached) | {
            "rows": m["rows"], "prompt_tokens": m["prompt_tokens"], "completion_tokens": m["completion_tokens"],
            "errors": m["errors"], "rows_per_s": m["rows"] / max(m["wall_seconds"], 1e-9),
            "tokens_per_s": tokens / max(m["wall_seconds"], 1e-9),
        }
        return Output(m, metadata=md)

    return teacher_generations
