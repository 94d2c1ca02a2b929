"""hparam_sweep: a hyperparameter sweep (campaign ``sweep:``) before the student is trained for good.

The sweep runs an Optuna study (``campaign_orchestrator.sweep``); every rung of every trial is a launch of the
context's training launcher (local torchrun or Kubernetes) with ``stop_at_step`` set, so a trial trains rung after
rung from its own checkpoints. After each rung the stage records the rung's cost in the ledger under the trial's id
and reports the trial (``ctx.on_trial``: the Dagster asset turns it into a materialization of
``<campaign>/sweep_trial``, partition ``trial-NNN``). Each launch carries a budget guard sized to what is left of
the cap (and of the campaign's budget), so the cap is hard: a rung is stopped inside when the cap is reached.
``student_adapter`` takes the sweep's best configuration (README, "Sweeps").
"""

from __future__ import annotations

import json
import time

from campaigns.spec import CampaignSpec
from stages.common import model_identity, stage_key
from stages.errors import StageError
from stages.outcome import Outcome
from stages.pricing import sweep_panel
from stages.student_adapter import (
    adapter_key_fields,
    adapter_precision,
    job_policy_terms,
    key_policy,
    teacher_tokenizer_path,
)

STAGE = "hparam_sweep"
# what a sweep's result does not depend on: how much money, how many at once, where the study lives
NOT_IN_KEY = {"budget_usd", "parallel", "storage", "heartbeat_s", "grace_s", "max_retries"}


def trial_partition(root: int) -> str:
    """A trial's partition, named by its original trial number (a retry of a killed trial keeps it)."""
    return f"trial-{root:03d}"


def sweep_key(spec: CampaignSpec, dataset_key: str, base_identity: str, training_fields: dict) -> str:
    """``training_fields``: the adapter's, resolved (``campaign_orchestrator.keys.adapter_key_fields``)."""
    return stage_key("sweep/v1", dataset_key, base_identity, training_fields, spec.sweep.model_dump(exclude=NOT_IN_KEY))


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """The sweep's result (``inputs["dataset"]``: the tokenized dataset's manifest), run or resumed unless its
    content key is complete (a sweep stopped by a cap that has since changed resumes: no rung is retrained)."""
    s, sw, dataset = spec.student, spec.sweep, inputs["dataset"]
    base = ctx.store.resolve_model(s.base_model, spec.project_dir)
    precision = adapter_precision(spec)  # resolved, as the adapter's key (campaign_orchestrator/keys.py)
    rows = dataset.get("splits", {}).get("train", {}).get("rows")
    fields = adapter_key_fields(spec, precision, key_policy(spec, ctx.pricing.catalog_for(spec), base, precision, rows))
    k = sweep_key(spec, dataset["key"], model_identity(base, s.revision), fields)
    sd = ctx.store.stage(spec.name, STAGE, k)
    cached = sd.is_complete()
    if cached and sd.manifest().get("stopped_by_cap") and sd.manifest().get("cap_usd") != sw.budget_usd:
        cached = False  # stopped by a cap that has since changed: resume the study (no rung is retrained)
    if not cached:
        run_sweep(ctx, spec, sd, k, base, dataset)
    m = sd.manifest()
    if m.get("stopped_by_cap"):
        ctx.log.warning(m["stopped_by_cap"])
    return Outcome(m, cached)


def planned_rate(ctx, spec: CampaignSpec, root) -> tuple[float, float] | None:
    """The planner's ``(startup seconds, seconds per step)`` of the student's training; None when it cannot say
    and nothing caps the sweep (a capped sweep never prices a rung at $0: it fails, naming the planner's error)."""
    capped = spec.sweep.budget_usd is not None or spec.cost.budget_usd is not None
    try:
        est = ctx.pricing.plan(spec, root).stages["student_adapter"]
        return est.startup_s, max(0.0, est.seconds - est.startup_s) / est.steps
    except Exception as e:  # noqa: BLE001 - whatever the planner raised, it is named in the error
        if capped:  # never price a rung at $0 under a cap: say what failed and stop
            raise StageError(
                f"sweep: the planner could not estimate a rung of {spec.name}'s sweep ({e}); a "
                "capped sweep (sweep.budget_usd / cost.budget_usd) needs that estimate before its "
                "first rung. Fix the cause (run `campaign plan` to see it), then materialize "
                "again."
            ) from e
        ctx.log.warning(f"sweep: no planner estimate ({e}); no cap to keep, rungs timed as they run")
        return None


def _diverged(e: Exception) -> bool:
    """A launch that failed on a non-finite loss (the trainer says so in its error or its log tail: a launcher's
    failure carries the log in its ``metadata``)."""
    md = getattr(e, "metadata", None)
    if not isinstance(md, dict):
        return False
    log_tail = "".join(str(getattr(v, "value", v)) for v in md.values())
    return "non-finite" in log_tail + str(e)


def rung_runner(ctx, spec: CampaignSpec, k: str, base, dataset: dict, root):
    """The sweep's rungs as launches of the context's launcher (``training.sweep_rung``)."""
    from training.sweep_rung import RungRunner

    tr = spec.training
    cluster = {"kubernetes": spec.kubernetes} if tr.launcher == "k8s" else {}
    return RungRunner(
        spec,
        k,
        base,
        dataset,
        teacher_tokenizer_path(spec, ctx.store),
        ctx.pricing.gpu_required(spec),
        launch=lambda job, tdir, budget: ctx.train(job, tdir, budget=budget, **cluster),
        diverged=_diverged,
        bill=lambda usage: ctx.pricing.bill(spec, STAGE, usage)["lines"],
        partition=trial_partition,
        planned=planned_rate(ctx, spec, root),
        log=ctx.log.info,
        warn=ctx.log.warning,
        fail=StageError,
        policy_terms=job_policy_terms(spec, ctx.pricing.catalog_for(spec)),  # as the adapter's trainer gets them
    )


def _rung_recorder(ctx, spec: CampaignSpec, ledger, k: str):
    """``record_lines(trial, steps, lines)``: a rung's cost lines into the ledger, one production per rung."""

    def record_lines(rec, steps: int, lines: list[dict]) -> None:
        ledger.record_lines(
            campaign=spec.name,
            asset=STAGE,
            run_id=ctx.run_id,
            step_key=ctx.step_key,
            attempt=ctx.attempt,
            stage_key=k,
            production_id=f"{STAGE}:{k}:{trial_partition(rec.root)}:rung-{steps}",
            lines=lines,
        )

    return record_lines


def run_sweep(ctx, spec: CampaignSpec, sd, k: str, base, dataset: dict) -> None:
    """Run (or resume) the study, each rung a launch with its ledger lines and a trial report; commit
    ``sweep.json``, ``panel.json`` and the manifest to ``sd``."""
    from campaign_orchestrator.sweep import Sweep, make_storage, storage_url

    sw, workdir, pricing = spec.sweep, sd.ensure(), ctx.pricing
    ledger = pricing.ledger_at(sd.root)
    rungs = rung_runner(ctx, spec, k, base, dataset, sd.root)  # the plan first

    def spent_usd() -> float:
        return ledger.stage_spent(spec.name, STAGE, k)

    record_lines = _rung_recorder(ctx, spec, ledger, k)
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
        on_event=lambda rec: report_trial(ctx, spec, sd, k, rec),
        log=ctx.log.info,
        full_run_seconds=rungs.full_run_seconds,
        limits=_limits(ctx, spec, ledger),
        make_guard=lambda rec, steps, limits: pricing.guard(  # stopped inside at what is left of the cap
            ctx, spec, sd, limits=limits, part=f"{trial_partition(rec.root)}:rung-{steps}"
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


def _limits(ctx, spec: CampaignSpec, ledger) -> list:
    """The campaign's budget holds during the sweep too (``budget_scope`` applies)."""
    c = spec.cost
    if c.budget_usd is None:
        return []
    run_scope = ctx.run_id if c.budget_scope == "run" else None
    return [("campaign budget (cost.budget_usd)", c.budget_usd, lambda: ledger.spent(spec.name, run_id=run_scope))]


def report_trial(ctx, spec: CampaignSpec, sd, k: str, rec) -> None:
    """A trial's rung or state change reported to the orchestrator (``ctx.on_trial``) and, once it ends, to its
    MLflow run."""
    if ctx.on_trial is not None:
        ctx.on_trial(rec, k)
    if spec.tracking.mlflow is not None and rec.state in ("PRUNED", "COMPLETE", "STOPPED"):
        from stages.tracking import log_trial

        log_trial(spec, sd.root, k, rec)
