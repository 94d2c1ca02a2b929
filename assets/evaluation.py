"""evaluation: candidate (base + adapter) and base answer the same held-out items; the gate
is a blocking asset check on this asset, so NO-GO or INCONCLUSIVE stops promotion in the run."""

import json
import time

from dagster import (AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetExecutionContext, AssetIn,
                     MetadataValue, Output, asset)

from assets.common import base_metadata, hardware_cost, key, model_deps, model_identity, stage_key
from campaigns.spec import CampaignSpec
from lineage.hashing import file_sha256
from resources.pricing import PricingResource
from resources.storage import REPO_ROOT, ArtifactStore

GATE_CHECK = "gate"


def gate_check_result(report: dict) -> AssetCheckResult:
    verdict = report["verdict"]
    md = {"verdict": verdict, "reasons": MetadataValue.md("\n".join(f"- {r}" for r in report["reasons"]) or "- all rules pass")}
    for s in report["suites"]:
        md[f"{s['suite']}_candidate"] = s["candidate"]["score"] if s["candidate"]["score"] is not None else float("nan")
        md[f"{s['suite']}_base"] = s["base"]["score"] if s["base"]["score"] is not None else float("nan")
    return AssetCheckResult(check_name=GATE_CHECK, passed=verdict == "GO", severity=AssetCheckSeverity.ERROR,
                            metadata=md, description=f"Gate verdict {verdict}")


def build(spec: CampaignSpec):
    ev, s, t = spec.evaluation, spec.student, spec.teacher
    eval_teacher = ev.evaluate_teacher and t.backend == "transformers"
    refs = [s.base_model] + ([t.model] if eval_teacher else [])

    @asset(key=key(spec, "evaluation"), group_name=spec.name, kinds={"pytorch", "parquet"},
           ins={"prompts": AssetIn(key(spec, "prompts")), "adapter": AssetIn(key(spec, "student_adapter"))},
           deps=model_deps(*refs),
           check_specs=[AssetCheckSpec(GATE_CHECK, asset=key(spec, "evaluation"), blocking=True,
                                       description="Promotion gate: floor, regression vs base, empty outputs, latency.")],
           description="Base and candidate scored on the same held-out items; the gate decides promotion.")
    def evaluation(context: AssetExecutionContext, prompts: dict, adapter: dict, storage: ArtifactStore,
                   pricing: PricingResource):
        from dataprep.prompts import read_prompt_table
        from evaluation.gate import GatePolicy, combine, markdown_report
        from evaluation.runner import SuiteRun, evaluate_paired
        from evaluation.suite import load_items, write_item_rows
        from generation.local import LocalGenerator

        base = storage.resolve_model(s.base_model)
        teacher_path = storage.resolve_model(t.model) if eval_teacher else None
        k = stage_key("evaluation/v1", adapter["key"], prompts["heldout_sha256"], model_identity(base, s.revision),
                      model_identity(teacher_path) if teacher_path else None, ev.model_dump())
        sd = storage.stage(spec.name, "evaluation", k)
        cached = sd.is_complete()
        if not cached:
            pricing.budget_guard(context, spec, sd)  # refuses to start when the estimate exceeds the budget left
            t0 = time.perf_counter()
            held = read_prompt_table(prompts["heldout_path"])
            suites = [SuiteRun(x.name, load_items(x.source, held, REPO_ROOT), x.scorer, x.max_new_tokens)
                      for x in ev.suites]
            q = s.quantization
            bs = max(x.batch_size for x in ev.suites)

            def local(path, adapter_dir=None, four_bit=False):
                def factory():
                    g = LocalGenerator.from_path(path, adapter_dir, four_bit, q.compute_dtype, batch_size=bs)
                    return lambda prompts_, n: g.generate(prompts_, n)
                return factory

            models = {"candidate": local(base, adapter["adapter_path"], q.load_in_4bit),
                      "base": local(base, None, q.load_in_4bit)}
            if teacher_path is not None:
                models["teacher"] = local(teacher_path)
            g = ev.gate
            policy = GatePolicy(g.min_score, g.max_regression_vs_base, g.max_empty_output_rate, g.max_avg_latency_s,
                                g.min_items)
            result = evaluate_paired(suites, models, policy, log=context.log.info)
            out = sd.ensure()
            write_item_rows(result.rows, out / "items.parquet")
            wall = time.perf_counter() - t0
            report = {"verdict": combine(result.reports), "suites": [r.as_dict() for r in result.reports],
                      "reasons": [f"{r.suite}: {why}" for r in result.reports for why in r.reasons],
                      "scores": result.scores, "candidate_key": adapter["key"],
                      "markdown": markdown_report(result.reports, result.scores.get("teacher"))}
            (out / "gate.json").write_text(json.dumps(report, indent=2))
            lines = [hardware_cost(pricing, spec, "evaluation", spec.training.hardware, wall)]
            sd.commit({"items_path": str(out / "items.parquet"), "gate_path": str(out / "gate.json"),
                       "verdict": report["verdict"], "scores": result.scores, "candidate_key": adapter["key"],
                       "items_sha256": file_sha256(out / "items.parquet"), "wall_seconds": wall, "cost_lines": lines})
        m = sd.manifest()
        report = json.loads(open(m["gate_path"]).read())
        md = base_metadata(m, cached) | {"verdict": report["verdict"], "report": MetadataValue.md(report["markdown"]),
                                         "items": MetadataValue.path(m["items_path"])}
        for role, by_suite in m["scores"].items():
            for suite, score in by_suite.items():
                if score is not None:
                    md[f"{suite}_{role}_score"] = score
        yield Output(m, metadata=md)
        yield gate_check_result(report)

    return evaluation
