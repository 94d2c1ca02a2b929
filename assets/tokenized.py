"""tokenized_dataset: the distillation set tokenized with the student's tokenizer into Parquet."""

import time

import pyarrow.parquet as pq
from dagster import AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, key, model_deps, stage_key
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore


def build(spec: CampaignSpec):
    s, tr = spec.student, spec.training

    @asset(key=key(spec, "tokenized_dataset"), group_name=spec.name, kinds={"python", "parquet"},
           ins={"distillation": AssetIn(key(spec, "distillation_set"))}, deps=model_deps(s.base_model),
           description=f"Pre-tokenized Parquet (input_ids, labels, position_ids), max {tr.max_seq_len} tokens.")
    def tokenized_dataset(context: AssetExecutionContext, distillation: dict, storage: ArtifactStore) -> Output[dict]:
        from dataprep.tokenize import length_histogram, tokenize_pairs, tokenizer_hash

        model_path = storage.resolve_model(s.base_model)
        tok_hash = tokenizer_hash(model_path)
        k = stage_key("tokenized/v1", distillation["key"], tok_hash, tr.max_seq_len)
        sd = storage.stage(spec.name, "tokenized_dataset", k)
        cached = sd.is_complete()
        if not cached:
            t0 = time.perf_counter()
            pairs = pq.read_table(distillation["distillation_path"]).to_pylist()
            out = sd.ensure() / "data-00000.parquet"
            res = tokenize_pairs(model_path, pairs, out, tr.max_seq_len,
                                 extra_metadata={"campaign.source_key": distillation["key"]})
            lengths = [len(x) for x in pq.read_table(out, columns=["input_ids"]).column("input_ids").to_pylist()]
            sd.commit({"dataset_path": str(sd.path), "files": [out.name], "rows": res.rows,
                       "examples_in": res.examples_in, "examples_out": res.examples_out,
                       "dropped_too_long": res.dropped_too_long, "total_tokens": res.total_tokens,
                       "loss_tokens": res.loss_tokens, "tokenizer_hash": tok_hash, "bytes": out.stat().st_size,
                       "length_histogram": length_histogram(lengths),
                       "wall_seconds": time.perf_counter() - t0, "cost_lines": []})
        m = sd.manifest()
        md = base_metadata(m, cached) | {
            "rows": m["rows"], "examples_in": m["examples_in"], "examples_out": m["examples_out"],
            "dropped_too_long": m["dropped_too_long"], "total_tokens": m["total_tokens"], "loss_tokens": m["loss_tokens"],
            "bytes": m["bytes"], "tokenizer_hash": m["tokenizer_hash"][:16],
            "sequence_lengths": MetadataValue.md(m["length_histogram"]),
        }
        return Output(m, metadata=md)

    return tokenized_dataset
