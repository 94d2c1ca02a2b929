"""distillation_set: teacher generations filtered and deduplicated, each rule counted; then checked for
overlap with every gate suite's documents (the blocking ``decontamination`` check, before training):
overlapping examples are dropped and counted, or the check fails (``data.decontamination``)."""

import time

import pyarrow as pa
import pyarrow.parquet as pq
from dagster import AssetCheckResult, AssetCheckSpec, AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, key, stage_key
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore


def distill_schema() -> pa.Schema:
    """id, prompt, completion; plus the teacher's generated token ids and top-k logprobs
    (null unless ``teacher.sampling.logprobs`` was set; see ``campaign_orchestrator/generation/rows.py``)."""
    from campaign_orchestrator.generation.rows import TOP_LOGPROBS_TYPE

    return pa.schema([("id", pa.string()), ("prompt", pa.string()), ("completion", pa.string()),
                      ("completion_token_ids", pa.list_(pa.int32())), ("top_logprobs", TOP_LOGPROBS_TYPE)])


DECONTAMINATION_CHECK = "decontamination"


def build(spec: CampaignSpec):
    dc = spec.data.decontamination

    @asset(key=key(spec, "distillation_set"), group_name=spec.name, kinds={"python", "parquet"},
           ins={"generations": AssetIn(key(spec, "teacher_generations")), "prompts": AssetIn(key(spec, "prompts"))},
           check_specs=[AssetCheckSpec(DECONTAMINATION_CHECK, asset=key(spec, "distillation_set"), blocking=True,
                                       description=f"No training prompt or teacher output shares a {dc.ngram}-gram "
                                                   f"with a gate suite's documents (action: {dc.action}).")],
           description="Teacher generations that pass the campaign's filters (errors, empty, truncated, length, "
                       "format, scorer, duplicates), each rule counted, and checked against every gate suite's "
                       "documents (n-gram decontamination).")
    def distillation_set(context: AssetExecutionContext, generations: dict, prompts: dict, storage: ArtifactStore):
        m, cached = materialize(context, spec, generations, prompts, storage)
        yield Output(m, metadata=distillation_metadata(m, cached))
        yield decontamination_check(m.get("decontamination"))

    return distillation_set


def materialize(context, spec: CampaignSpec, generations: dict, prompts: dict,
                storage: ArtifactStore) -> tuple[dict, bool]:
    """The teacher's generations filtered by the campaign's rules and decontaminated against the gate suites,
    unless the stage's content key is complete: ``(manifest, cached)``."""
    from campaign_orchestrator.dataset.filtering import FilterRules, filter_generations
    from campaign_orchestrator.generation.rows import read_generations
    from evaluation.scorers import get_scorer

    f, dc = spec.data.filters, spec.data.decontamination

    gate_docs = None
    if dc.action != "off":
        from assets.harness import gate_documents_identity

        gate_docs = gate_documents_identity(spec, storage, prompts["heldout_sha256"])
    k = stage_key("distill/v2", generations["key"], f.model_dump(), prompts["train_sha256"] if f.scorer else None,
                  *([dc.model_dump(), gate_docs] if gate_docs is not None else []))
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
        kept, contamination = _decontaminate(spec, kept, prompts, storage, sd, context)
        table = pa.Table.from_pylist(
            [{"id": f"{r['id']}#{r['sample_index']}" if r["sample_index"] else r["id"], "prompt": r["prompt"],
              "completion": r["completion"], "completion_token_ids": r.get("completion_token_ids"),
              "top_logprobs": r.get("top_logprobs")} for r in kept], schema=distill_schema())
        path = sd.ensure() / "distillation.parquet"
        pq.write_table(table, path)
        sd.commit({"distillation_path": str(path), "rows": len(kept), "filter_counts": counts,
                   "decontamination": contamination, "wall_seconds": time.perf_counter() - t0, "cost_lines": []})
    return sd.manifest(), cached


def distillation_metadata(m: dict, cached: bool) -> dict:
    """The distillation set's manifest as Dagster metadata: rows kept, each filter rule's drops, contamination."""
    from campaign_orchestrator.dataset.filtering import RULES

    c = m["filter_counts"]
    md = base_metadata(m, cached) | {"rows": m["rows"], "input_rows": c["input"],
                                     "kept_fraction": m["rows"] / max(1, c["input"]),
                                     "filter_counts": MetadataValue.json(c)}
    md |= {f"dropped_{name}": c.get(name, 0) for name in RULES}
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

    docs = gate_documents(spec, read_prompt_table(prompts["heldout_path"]), storage, sd.ensure() / "lm_eval",
                          log=context.log.info)
    found = find_contamination(kept, build_index(docs, dc.ngram, dc.min_doc_tokens))
    ids = [f"{r['id']}#{r['sample_index']}" if r.get("sample_index") else str(r["id"]) for r in kept]
    summary = found.summary(len(kept), ids=ids) | {"action": dc.action}
    context.log.info(f"decontamination: {found.contaminated} of {len(kept)} training rows overlap a gate suite "
                     f"({dc.ngram}-grams; action {dc.action})")
    if dc.action == "drop" and found.rows:
        kept = [r for i, r in enumerate(kept) if i not in found.rows]
    return kept, summary


def decontamination_check(dec: dict | None) -> AssetCheckResult:
    if dec is None:
        return AssetCheckResult(check_name=DECONTAMINATION_CHECK, passed=True,
                                description="decontamination is off (data.decontamination.action: off)")
    n, suites = dec["contaminated_rows"], dec["suites"]
    where = ", ".join(f"{s} {v['training_rows_overlapping']}" for s, v in suites.items()
                      if v["training_rows_overlapping"])
    checked = sum(v["documents_checked"] for v in suites.values())
    if n == 0:
        text = f"no training row overlaps the {checked} gate documents checked ({dec['ngram']}-grams)"
    elif dec["action"] == "drop":
        text = f"{n} of {dec['training_rows']} training rows overlapped gate documents and were dropped ({where})"
    else:
        text = (f"{n} of {dec['training_rows']} training rows overlap gate documents ({where}); action 'fail': "
                "nothing downstream runs until the data or data.decontamination changes")
    return AssetCheckResult(check_name=DECONTAMINATION_CHECK, passed=n == 0 or dec["action"] == "drop",
                            description=text,
                            metadata={"contaminated_rows": n, "training_rows": dec["training_rows"],
                                      "documents_checked": checked, "action": dec["action"],
                                      "suites": MetadataValue.json(suites),
                                      "examples": MetadataValue.json(dec["examples"])})
