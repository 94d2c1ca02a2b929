"""distillation_set: teacher generations filtered and deduplicated, each rule counted, with the self-replay rows
(``stages/distillation_set.py``); then checked for overlap with every gate suite's documents (the blocking
``decontamination`` check, before training): overlapping examples are dropped and counted, or the check fails
(``data.decontamination``)."""

from dagster import AssetCheckResult, AssetCheckSpec, AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, dagster_failures, for_people, key, model_deps, stage_context
from campaigns.spec import CampaignSpec
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from resources.teacher import TeacherResource
from stages import distillation_set as stage

DECONTAMINATION_CHECK = "decontamination"


def build(spec: CampaignSpec):
    dc, rp = spec.data.decontamination, spec.data.replay

    @asset(
        key=key(spec, "distillation_set"),
        group_name=spec.name,
        kinds={"python", "parquet"},
        deps=model_deps(spec.student.base_model) if stage.replays_base(spec) else None,
        ins={"generations": AssetIn(key(spec, "teacher_generations")), "prompts": AssetIn(key(spec, "prompts"))},
        check_specs=[
            AssetCheckSpec(
                DECONTAMINATION_CHECK,
                asset=key(spec, "distillation_set"),
                blocking=True,
                description=f"No training prompt or teacher output shares a {dc.ngram}-gram "
                f"with a gate suite's documents (action: {dc.action}).",
            )
        ],
        description="Teacher generations that pass the campaign's filters (errors, empty, truncated, length, "
        "format, scorer, duplicates), each rule counted, and checked against every gate suite's "
        "documents (n-gram decontamination)."
        + (
            f" Replay: {rp.share:.0%} of the mix, general prompts answered by the {rp.answered_by} (ids `replay:<id>`)."
            if rp
            else ""
        ),
    )
    def distillation_set(
        context: AssetExecutionContext,
        generations: dict,
        prompts: dict,
        storage: ArtifactStore,
        teacher: TeacherResource,
        pricing: PricingResource,
    ):
        ctx = stage_context(context, storage, pricing, teacher)
        with dagster_failures():
            out = stage.run(spec, {"generations": generations, "prompts": prompts}, ctx)
        yield Output(out.manifest, metadata=for_people(distillation_metadata(out.manifest, out.cached)))
        yield decontamination_check(out.manifest.get("decontamination"))

    return distillation_set


def distillation_metadata(m: dict, reused: bool) -> dict:
    """The distillation set's manifest as Dagster metadata: rows kept, each filter rule's drops, contamination; the
    replay answers this run generated only when this run made the set."""
    c = m["filter_counts"]
    md = base_metadata(m, reused) | {
        "rows": m["rows"],
        "input_rows": c["input"],
        "kept_fraction": m["rows"] / max(1, c["input"]),
        "filter_counts": MetadataValue.json(c),
    }
    md |= {f"dropped_{name}": c.get(name, 0) for name in stage.rule_names()}
    if m.get("replay"):
        r = m["replay"]
        md |= {
            "replay_rows": r["rows"],
            "task_rows": m["rows"] - r["rows"],
            "replay_share": r["share_actual"],
            "replay_answered_by": r["answered_by"],
        }
        if not reused:
            md |= {
                "replay_generated": r.get("generated", 0),
                "replay_cache_hits": r.get("cache_hits", 0),
                "replay": MetadataValue.json(r),
            }
    t = m.get("targets")
    if t:  # data.targets.content: base
        md |= {"targets_kept": t["kept"], "targets_changed": t["changed"], "targets": MetadataValue.json(t)}
    dec = m.get("decontamination")
    if dec is not None:
        md |= {"contaminated_rows": dec["contaminated_rows"], "decontamination": MetadataValue.json(dec)}
        if dec["action"] == "drop":
            md["dropped_contaminated"] = dec["contaminated_rows"]
    return md


def decontamination_check(dec: dict | None) -> AssetCheckResult:
    if dec is None:
        return AssetCheckResult(
            check_name=DECONTAMINATION_CHECK,
            passed=True,
            description="decontamination is off (data.decontamination.action: off)",
        )
    n, suites = dec["contaminated_rows"], dec["suites"]
    where = ", ".join(
        f"{s} {v['training_rows_overlapping']}" for s, v in suites.items() if v["training_rows_overlapping"]
    )
    checked = sum(v["documents_checked"] for v in suites.values())
    if n == 0:
        text = f"no training row overlaps the {checked} gate documents checked ({dec['ngram']}-grams)"
    elif dec["action"] == "drop":
        text = f"{n} of {dec['training_rows']} training rows overlapped gate documents and were dropped ({where})"
    else:
        text = (
            f"{n} of {dec['training_rows']} training rows overlap gate documents ({where}); action 'fail': "
            "nothing downstream runs until the data or data.decontamination changes"
        )
    return AssetCheckResult(
        check_name=DECONTAMINATION_CHECK,
        passed=n == 0 or dec["action"] == "drop",
        description=text,
        metadata={
            "contaminated_rows": n,
            "training_rows": dec["training_rows"],
            "documents_checked": checked,
            "action": dec["action"],
            "suites": MetadataValue.json(suites),
            "examples": MetadataValue.json(dec["examples"]),
        },
    )
