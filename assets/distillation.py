"""distillation_set: teacher generations filtered and deduplicated, each rule counted."""

import time

import pyarrow as pa
import pyarrow.parquet as pq
from dagster import AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, key, stage_key
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore

DISTILL_SCHEMA = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("completion", pa.string())])


def build(spec: CampaignSpec):
    f = spec.data.filters

    @asset(key=key(spec, "distillation_set"), group_name=spec.name, kinds={"python", "parquet"},
           ins={"generations": AssetIn(key(spec, "teacher_generations"))},
           description="Teacher generations that pass the campaign's filters (empty, truncated, format, duplicates, length).")
    def distillation_set(context: AssetExecutionContext, generations: dict, storage: ArtifactStore) -> Output[dict]:
        from dataprep.filtering import FilterRules, filter_generations
        from generation.rows import read_generations

        k = stage_key("distill/v1", generations["key"], f.model_dump())
        sd = storage.stage(spec.name, "distillation_set", k)
        cached = sd.is_complete()
        if not cached:
            t0 = time.perf_counter()
            rows = read_generations(generations["generations_path"])
            kept, counts = filter_generations(rows, FilterRules(**f.model_dump()))
            ids = [f"{r['id']}#{r['sample_index']}" if r["sample_index"] else r["id"] for r in kept]
            table = pa.Table.from_pydict({"id": ids, "prompt": [r["prompt"] for r in kept],
                                          "completion": [r["completion"] for r in kept]}, schema=DISTILL_SCHEMA)
            path = sd.ensure() / "distillation.parquet"
            pq.write_table(table, path)
            sd.commit({"distillation_path": str(path), "rows": len(kept), "filter_counts": counts,
                       "wall_seconds": time.perf_counter() - t0, "cost_lines": []})
        m = sd.manifest()
        c = m["filter_counts"]
        md = base_metadata(m, cached) | {"rows": m["rows"], "input_rows": c["input"],
                                         "kept_fraction": m["rows"] / max(1, c["input"]),
                                         "filter_counts": MetadataValue.json(c)}
        md |= {f"dropped_{name}": c[name] for name in ("error", "empty", "truncated", "length", "format", "duplicate")}
        return Output(m, metadata=md)

    return distillation_set
