"""hparam_sweep: a hyperparameter sweep (campaign ``sweep:``, ``stages/hparam_sweep.py``) before the student is
trained for good;
its trials are the partitions of ``sweep_trial`` (assets/sweep_trial.py), reported as it goes.

The sweep step runs an Optuna study (``campaign_orchestrator.sweep``); every rung of every trial is a
launch of the campaign's own launcher (local torchrun or Kubernetes) with ``stop_at_step`` set, so a
trial trains rung after rung from its own checkpoints. After each rung the step records the rung's
cost in the ledger under the trial's id and reports a materialization of ``<campaign>/sweep_trial``,
partition ``trial-NNN``: its parameters, the metric at every rung, its cost, and whether it was
promoted, pruned, completed or stopped by the cap. Each launch carries a budget guard sized to what is
left of the cap (and of the campaign's budget), so the cap is hard: a rung is stopped inside when the cap
is reached. ``student_adapter`` takes the sweep's best
configuration (README, "Sweeps").
"""

import json
from functools import partial

from dagster import AssetExecutionContext, AssetIn, AssetMaterialization, MetadataValue, Output, asset

from assets.common import base_metadata, dagster_failures, for_people, key, model_deps, stage_context
from assets.sweep_trial import trial_key, trial_partition, trial_partitions
from campaigns.spec import CampaignSpec
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from resources.training_launcher import TrainingLauncher
from stages import hparam_sweep as stage
from stages.hparam_sweep import STAGE
from stages.pricing import dollars


def build(spec: CampaignSpec):
    s, tr, sw = spec.student, spec.training, spec.sweep

    @asset(
        key=key(spec, STAGE),
        group_name=spec.name,
        kinds={"optuna", "pytorch"},
        ins={"dataset": AssetIn(key(spec, "tokenized_dataset"))},
        deps=model_deps(s.base_model),
        pool="gpu",
        description=(
            f"Optuna sweep over {', '.join(sw.space)}: {sw.trials} trials, successive halving at "
            f"{sw.ladder(tr.max_steps)} steps (keep 1/{sw.rungs.reduction_factor})"
            + (f", cap ${sw.budget_usd:g}" if sw.budget_usd else "")
            + "; the best drives student_adapter."
        ),
    )
    def hparam_sweep(
        context: AssetExecutionContext,
        dataset: dict,
        storage: ArtifactStore,
        launcher: TrainingLauncher,
        pricing: PricingResource,
    ) -> Output[dict]:
        ctx = stage_context(context, storage, pricing, launcher=launcher)
        ctx.on_trial = partial(report_trial, context, spec)
        with dagster_failures():
            out = stage.run(spec, {"dataset": dataset}, ctx)
        return Output(out.manifest, metadata=for_people(sweep_metadata(out.manifest, out.cached)))

    return hparam_sweep


def report_trial(context, spec: CampaignSpec, rec, k: str) -> None:
    """A trial's rung or state change as a materialization of its ``sweep_trial`` partition (``k``: the sweep's
    content key)."""
    pk = trial_partition(rec.root)
    context.instance.add_dynamic_partitions(trial_partitions(spec).name, [pk])
    last = max(rec.rungs) if rec.rungs else 0
    md = {
        "trial": rec.number,
        "state": rec.state,
        "params": MetadataValue.json(rec.params),
        "rung_eval_loss": MetadataValue.json({str(k2): v["value"] for k2, v in sorted(rec.rungs.items())}),
        "steps": last,
        "eval_loss": rec.rungs[last]["value"] if rec.rungs else None,
        "cost": dollars(rec.usd),
        "rungs": MetadataValue.json({str(k2): v for k2, v in sorted(rec.rungs.items())}),
        "sweep": k,
        **{f"param {n}": v for n, v in rec.params.items()},
    }
    if rec.root != rec.number:
        md["retry_of"] = rec.root
    context.log_event(
        AssetMaterialization(
            asset_key=trial_key(spec), partition=pk, metadata=for_people({a: b for a, b in md.items() if b is not None})
        )
    )


def sweep_metadata(m: dict, reused: bool) -> dict:
    """The sweep's manifest as Dagster metadata (None values left out). Its cost is its trials' (each rung's lines
    are in the ledger under the trial, not in the manifest)."""
    spent = dollars(m["spent_usd"])
    md = base_metadata(m, reused) | {
        "cost": f"{spent} (paid when produced; nothing in this run)" if reused and m["spent_usd"] else spent,
        "trials_run": m["trials_run"],
        "trials_pruned": m["trials_pruned"],
        "pruned_at_first_rung": m["pruned_at_first_rung"],
        "trials_complete": m["trials_complete"],
        "trials_stopped_by_cap": m["trials_stopped_by_cap"],
        "rungs": MetadataValue.json(m["rungs"]),
        "best_trial": m["best_trial"],
        "best_params": MetadataValue.json(m["best_params"]),
        "best_eval_loss": m["best_value"],
        "default_eval_loss": m["default_value"],
        "cap_usd": m["cap_usd"],
        "stopped_by_cap": m["stopped_by_cap"] or "",
        "time_saved_seconds": m["time_saved_seconds"],
        "trial_seconds": m["trial_seconds"],
        "every_trial_to_the_end_seconds": m["every_trial_to_the_end_seconds"],
        "steps_trained": m["steps_trained"],
        "steps_if_every_trial_ran_to_the_end": m["steps_if_every_trial_ran_to_the_end"],
        "trials": MetadataValue.md(trials_table(m)),
    }
    return {a: b for a, b in md.items() if b is not None}


def trials_table(m: dict) -> str:
    rungs = m["rungs"]
    head = "| trial | state | " + " | ".join(f"loss @ {r}" for r in rungs) + " | cost $ | params |"
    rows = [head, "|" + "---|" * (len(rungs) + 4)]
    for t in m["trials"]:
        vals = [t["rungs"].get(str(r), {}).get("value") for r in rungs]
        rows.append(
            f"| {t['trial']} | {t['state']} | "
            + " | ".join("" if v is None else f"{v:.4f}" for v in vals)
            + f" | {t['usd']:.6f} | {json.dumps(t['params'])} |"
        )
    return "\n".join(rows)
