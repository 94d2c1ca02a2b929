"""hparam_sweep: a hyperparameter sweep (campaign ``sweep:``) before the student is trained for good;
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
import time

from dagster import AssetExecutionContext, AssetIn, AssetMaterialization, Failure, MetadataValue, Output, asset

from assets.common import base_metadata, key, model_deps, model_identity, stage_key
from assets.student_adapter import (
    adapter_key_fields,
    adapter_precision,
    job_policy_terms,
    key_policy,
    teacher_tokenizer_path,
)
from assets.sweep_trial import trial_key, trial_partition, trial_partitions
from campaigns.spec import CampaignSpec
from resources.pricing import PricingResource, sweep_panel
from resources.storage import ArtifactStore
from resources.training_launcher import TrainingLauncher
from training.sweep_rung import RungRunner

STAGE = "hparam_sweep"
# what a sweep's result does not depend on: how much money, how many at once, where the study lives
NOT_IN_KEY = {"budget_usd", "parallel", "storage", "heartbeat_s", "grace_s", "max_retries"}


def sweep_key(spec: CampaignSpec, dataset_key: str, base_identity: str, training_fields: dict) -> str:
    """``training_fields``: the adapter's, resolved (``campaign_orchestrator.keys.adapter_key_fields``)."""
    return stage_key("sweep/v1", dataset_key, base_identity, training_fields, spec.sweep.model_dump(exclude=NOT_IN_KEY))


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
        base = storage.resolve_model(s.base_model, spec.project_dir)
        precision = adapter_precision(spec)  # resolved, as the adapter's key (campaign_orchestrator/keys.py)
        rows = dataset.get("splits", {}).get("train", {}).get("rows")
        fields = adapter_key_fields(spec, precision, key_policy(spec, pricing.catalog_for(spec), base, precision, rows))
        k = sweep_key(spec, dataset["key"], model_identity(base, s.revision), fields)
        sd = storage.stage(spec.name, STAGE, k)
        cached = sd.is_complete()
        if cached and sd.manifest().get("stopped_by_cap") and sd.manifest().get("cap_usd") != sw.budget_usd:
            cached = False  # stopped by a cap that has since changed: resume the study (no rung is retrained)
        if not cached:
            run_sweep(context, spec, sd, k, base, dataset, storage, launcher, pricing)
        m = sd.manifest()
        if m.get("stopped_by_cap"):
            context.log.warning(m["stopped_by_cap"])
        return Output(m, metadata=sweep_metadata(m, cached))

    return hparam_sweep


def planned_rate(context, spec: CampaignSpec, pricing: PricingResource, root) -> tuple[float, float] | None:
    """The planner's ``(startup seconds, seconds per step)`` of the student's training; None when it cannot say
    and nothing caps the sweep (a capped sweep never prices a rung at $0: it fails, naming the planner's error)."""
    capped = spec.sweep.budget_usd is not None or spec.cost.budget_usd is not None
    try:
        est = pricing.plan(spec, root).stages["student_adapter"]
        return est.startup_s, max(0.0, est.seconds - est.startup_s) / est.steps
    except Exception as e:  # noqa: BLE001 - whatever the planner raised, it is named in the error
        if capped:  # never price a rung at $0 under a cap: say what failed and stop
            raise Failure(
                f"sweep: the planner could not estimate a rung of {spec.name}'s sweep ({e}); a "
                "capped sweep (sweep.budget_usd / cost.budget_usd) needs that estimate before its "
                "first rung. Fix the cause (run `campaign plan` to see it), then materialize "
                "again."
            ) from e
        context.log.warning(f"sweep: no planner estimate ({e}); no cap to keep, rungs timed as they run")
        return None


def _diverged(e: Exception) -> bool:
    """A launch that failed on a non-finite loss (the trainer says so in its error or its log tail)."""
    if not isinstance(e, Failure):
        return False
    log_tail = "".join(str(v.value) for v in (e.metadata or {}).values())
    return "non-finite" in log_tail + str(e)


def rung_runner(
    context,
    spec: CampaignSpec,
    k: str,
    base,
    dataset: dict,
    storage: ArtifactStore,
    launcher: TrainingLauncher,
    pricing: PricingResource,
    root,
) -> RungRunner:
    """The sweep's rungs as launches of the campaign's launcher (``training.sweep_rung``)."""
    tr = spec.training
    cluster = {"kubernetes": spec.kubernetes} if tr.launcher == "k8s" else {}
    return RungRunner(
        spec,
        k,
        base,
        dataset,
        teacher_tokenizer_path(spec, storage),
        pricing.gpu_required(spec),
        launch=lambda job, tdir, budget: launcher.launch(context, job, tdir, budget=budget, **cluster),
        diverged=_diverged,
        bill=lambda usage: pricing.bill(spec, STAGE, usage)["lines"],
        partition=trial_partition,
        planned=planned_rate(context, spec, pricing, root),
        log=context.log.info,
        warn=context.log.warning,
        fail=Failure,
        policy_terms=job_policy_terms(spec, pricing.catalog_for(spec)),  # as the adapter's trainer gets them
    )


def _rung_recorder(context, spec: CampaignSpec, ledger, k: str):
    """``record_lines(trial, steps, lines)``: a rung's cost lines into the ledger, one production per rung."""
    step_key = context.get_step_execution_context().step.key

    def record_lines(rec, steps: int, lines: list[dict]) -> None:
        ledger.record_lines(
            campaign=spec.name,
            asset=STAGE,
            run_id=context.run_id,
            step_key=step_key,
            attempt=context.retry_number,
            stage_key=k,
            production_id=f"{STAGE}:{k}:{trial_partition(rec.root)}:rung-{steps}",
            lines=lines,
        )

    return record_lines


def run_sweep(
    context,
    spec: CampaignSpec,
    sd,
    k: str,
    base,
    dataset: dict,
    storage: ArtifactStore,
    launcher: TrainingLauncher,
    pricing: PricingResource,
) -> None:
    """Run (or resume) the study, each rung a launch with its ledger lines and a trial materialization; commit
    ``sweep.json``, ``panel.json`` and the manifest to ``sd``."""
    from campaign_orchestrator.sweep import Sweep, make_storage, storage_url

    sw, workdir = spec.sweep, sd.ensure()
    ledger = pricing.ledger_at(sd.root)
    rungs = rung_runner(context, spec, k, base, dataset, storage, launcher, pricing, sd.root)  # the plan first

    def spent_usd() -> float:
        return ledger.stage_spent(spec.name, STAGE, k)

    record_lines = _rung_recorder(context, spec, ledger, k)
    url = storage_url(spec, sd.root)
    sweep = Sweep(
        spec,
        workdir,
        make_storage(url, sw),
        f"{spec.name}-{k}",
        run_rung=rungs.run_rung,
        estimate_usd=lambda steps, _trial: pricing.bill(  # at training.hardware, as the rung's guard accrues
            spec, STAGE, {"seconds": rungs.seconds_for(steps), "hardware": spec.training.hardware}
        )["usd"],
        spent_usd=spent_usd,
        record_lines=record_lines,
        on_event=lambda rec: report_trial(context, spec, sd, k, rec),
        log=context.log.info,
        full_run_seconds=rungs.full_run_seconds,
        limits=_limits(context, spec, ledger),
        make_guard=lambda rec, steps, limits: pricing.guard(  # stopped inside at what is left of the cap
            context, spec, sd, limits=limits, part=f"{trial_partition(rec.root)}:rung-{steps}"
        ),
    )
    t0 = time.perf_counter()
    result = sweep.run()
    result["spent_usd"] = spent_usd()  # the ledger's word: every rung of this sweep, any run
    if result["best_root"] is not None:
        result["best_dir"] = str(workdir / trial_partition(result["best_root"]))
    (workdir / "sweep.json").write_text(json.dumps(result, indent=2, default=str))
    (workdir / "panel.json").write_text(json.dumps(sweep_panel(result), indent=2, default=str))
    sd.commit(
        result | {"storage": url.split("@")[-1], "wall_seconds": time.perf_counter() - t0, "cost_lines": []}
    )  # the lines are in the ledger per trial and rung


def _limits(context, spec: CampaignSpec, ledger) -> list:
    """The campaign's budget holds during the sweep too (``budget_scope`` applies)."""
    c = spec.cost
    if c.budget_usd is None:
        return []
    run_scope = context.run_id if c.budget_scope == "run" else None
    return [("campaign budget (cost.budget_usd)", c.budget_usd, lambda: ledger.spent(spec.name, run_id=run_scope))]


def report_trial(context, spec: CampaignSpec, sd, k: str, rec) -> None:
    """A trial's rung or state change as a materialization of its ``sweep_trial`` partition (and its MLflow run)."""
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
        "cost_usd": rec.usd,
        "rungs": MetadataValue.json({str(k2): v for k2, v in sorted(rec.rungs.items())}),
        "sweep": k,
        **{f"param {n}": v for n, v in rec.params.items()},
    }
    if rec.root != rec.number:
        md["retry_of"] = rec.root
    context.log_event(
        AssetMaterialization(
            asset_key=trial_key(spec), partition=pk, metadata={a: b for a, b in md.items() if b is not None}
        )
    )
    if spec.tracking.mlflow is not None and rec.state in ("PRUNED", "COMPLETE", "STOPPED"):
        from assets.tracking import log_trial

        log_trial(spec, sd.root, k, rec)


def sweep_metadata(m: dict, cached: bool) -> dict:
    """The sweep's manifest as Dagster metadata (None values left out)."""
    md = base_metadata(m, cached) | {
        "cost_usd": m["spent_usd"],
        "spent_this_run_usd": 0.0 if cached else m["spent_usd"],
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
