"""drift_evaluation: the promoted model re-scored on the freshest held-out data.

Run by the campaign's drift schedule (``<campaign>_drift``), never by the campaign job. Its
metadata carries the verdict (DRIFTED / STABLE / INCONCLUSIVE) and the reasons; the
``<campaign>_drift_retrain`` sensor turns a DRIFTED verdict into a retraining run.
"""

import json
import time

from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, asset

from assets.common import key, stage_key
from campaigns.spec import CampaignSpec
from resources.storage import REPO_ROOT, ArtifactStore

STAGE = "drift_evaluation"


def drift_key(spec: CampaignSpec):
    return key(spec, STAGE)


def max_drop(spec: CampaignSpec) -> float:
    d = spec.automation.drift.max_drop
    return spec.evaluation.gate.max_regression_vs_base if d is None else d


def source_cache_dir(storage: ArtifactStore, spec: CampaignSpec):
    """Where an ``s3://`` prompt source is mirrored (content-addressed) under the artifact root."""
    return storage.root_path() / "_sources" / spec.name


def build(spec: CampaignSpec):
    ev, d, q = spec.evaluation, spec.data, spec.student.quantization

    @asset(key=drift_key(spec), group_name=spec.name, kinds={"pytorch", "parquet"}, deps=[key(spec, "promoted_model")],
           description="The promoted adapter re-scored on the freshest held-out items (current prompt source); "
                       "DRIFTED below the gate floor or beyond the allowed drop from its promotion-time score.")
    def drift_evaluation(context: AssetExecutionContext, storage: ArtifactStore) -> MaterializeResult:
        from automation.drift import DriftError, current_promoted, decide, score_promoted
        from automation.sources import prompt_files
        from dataprep import prompts as P
        from evaluation.suite import load_items, write_item_rows
        from lineage.hashing import value_sha256

        try:
            promoted = current_promoted(storage.campaign_dir(spec.name))
        except DriftError as e:
            raise Failure(str(e)) from None
        if promoted is None:
            raise Failure(f"campaign {spec.name} has no promoted model yet (no "
                          f"{storage.campaign_dir(spec.name) / 'promoted_model' / 'CURRENT'}); run the campaign first")
        files = prompt_files(d.source, REPO_ROOT, source_cache_dir(storage, spec))
        rows = P.read_prompts(files, P.SourceFields(d.id_field, d.prompt_field, d.reference_field, d.category_field))
        _, held = P.split(rows, d.heldout.fraction, d.heldout.seed, d.heldout.max_items)
        from evaluation.scorers import build_scorer

        scorers = {s.name: build_scorer(s.scorer, s.labels, s.pattern, s.json_schema, REPO_ROOT) for s in ev.suites}
        suites = [{"name": s.name, "items": load_items(s.source, held, REPO_ROOT, scorers[s.name]),
                   "scorer": scorers[s.name], "max_new_tokens": s.max_new_tokens} for s in ev.suites]
        floor, drop = ev.gate.min_score, max_drop(spec)
        k = stage_key("drift/v1", promoted.key, value_sha256([s["items"] for s in suites]),
                      [s.model_dump() for s in ev.suites], floor, drop, ev.gate.min_items)
        sd = storage.stage(spec.name, STAGE, k)
        cached = sd.is_complete()
        if not cached:
            from types import SimpleNamespace

            base = promoted.base_model_path()
            if base is None or not base.exists():
                base = storage.resolve_model(spec.student.base_model)
            t0 = time.perf_counter()
            scores, item_rows = score_promoted(base, promoted.adapter_path, [SimpleNamespace(**s) for s in suites],
                                               q.load_in_4bit, q.compute_dtype, max(s.batch_size for s in ev.suites),
                                               log=context.log.info)
            report = decide(scores, promoted.candidate_scores(), floor, drop, ev.gate.min_items)
            out = sd.ensure()
            write_item_rows(item_rows, out / "items.parquet")
            (out / "drift.json").write_text(json.dumps(report.as_dict(), indent=2))
            sd.commit({"promoted_key": promoted.key, "report": report.as_dict(), "heldout_items": len(held),
                       "source_files": [f.name for f in files], "wall_seconds": time.perf_counter() - t0,
                       "cost_lines": []})
        m = sd.manifest()
        r = m["report"]
        md = {"verdict": r["verdict"], "drifted": r["verdict"] == "DRIFTED", "summary": r["summary"],
              "reasons": MetadataValue.md("\n".join(f"- {x}" for x in r["reasons"]) or "- none"),
              "promoted_key": m["promoted_key"], "drift_key": m["key"], "heldout_items": m["heldout_items"],
              "floor": floor, "max_drop": drop, "cached": cached, "path": MetadataValue.path(m["path"])}
        for s in r["suites"]:
            md[f"{s['suite']}_fresh_score"] = s["score"] if s["score"] is not None else float("nan")
            if s["promoted_score"] is not None:
                md[f"{s['suite']}_promoted_score"] = s["promoted_score"]
        context.log.info(f"drift verdict {r['verdict']}: {r['summary']}")
        return MaterializeResult(metadata=md)

    return drift_evaluation
