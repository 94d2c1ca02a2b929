"""distillation_set: teacher generations filtered and deduplicated, each rule counted."""

import time

import pyarrow as pa
import pyarrow.parquet as pq
from dagster import AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, key, stage_key
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore


def distill_schema() -> pa.Schema:
    """id, prompt, completion; plus the teacher's generated token ids and top-k logprobs
    (null unless ``teacher.sampling.logprobs`` was set; see ``campaign_orchestrator/teacher/rows.py``)."""
    from campaign_orchestrator.teacher.rows import TOP_LOGPROBS_TYPE

    return pa.schema([("id", pa.string()), ("prompt", pa.string()), ("completion", pa.string()),
                      ("completion_token_ids", pa.list_(pa.int32())), ("top_logprobs", TOP_LOGPROBS_TYPE)])


def build(spec: CampaignSpec):
    f = spec.data.filters

    @asset(key=key(spec, "distillation_set"), group_name=spec.name, kinds={"python", "parquet"},
           ins={"generations": AssetIn(key(spec, "teacher_generations")), "prompts": AssetIn(key(spec, "prompts"))},
           description="Teacher generations that pass the campaign's filters (errors, empty, truncated, length, "
                       "format, scorer, duplicates), each rule counted.")
    def distillation_set(context: AssetExecutionContext, generations: dict, prompts: dict,
                         storage: ArtifactStore) -> Output[dict]:
        from campaign_orchestrator.dataset.filtering import RULES, FilterRules, filter_generations
        from campaign_orchestrator.teacher.rows import read_generations
        from evaluation.scorers import get_scorer

        k = stage_key("distill/v2", generations["key"], f.model_dump(), prompts["train_sha256"] if f.scorer else None)
        sd = storage.stage(spec.name, "distillation_set", k)
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
            table = pa.Table.from_pylist(
                [{"id": f"{r['id']}#{r['sample_index']}" if r["sample_index"] else r["id"], "prompt": r["prompt"],
                  "completion": r["completion"], "completion_token_ids": r.get("completion_token_ids"),
                  "top_logprobs": r.get("top_logprobs")} for r in kept], schema=distill_schema())
            path = sd.ensure() / "distillation.parquet"
            pq.write_table(table, path)
            sd.commit({"distillation_path": str(path), "rows": len(kept), "filter_counts": counts,
                       "wall_seconds": time.perf_counter() - t0, "cost_lines": []})
        m = sd.manifest()
        c = m["filter_counts"]
        md = base_metadata(m, cached) | {"rows": m["rows"], "input_rows": c["input"],
                                         "kept_fraction": m["rows"] / max(1, c["input"]),
                                         "filter_counts": MetadataValue.json(c)}
        md |= {f"dropped_{name}": c.get(name, 0) for name in RULES}
        return Output(m, metadata=md)

    return distillation_set
