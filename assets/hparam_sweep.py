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
from pathlib import Path

from dagster import AssetExecutionContext, AssetIn, AssetMaterialization, Failure, MetadataValue, Output, asset

from assets.common import base_metadata, key, model_deps, model_identity, stage_key
from assets.student_adapter import teacher_tokenizer_path, training_key_fields
from assets.sweep_trial import trial_key, trial_partition, trial_partitions
from campaigns.spec import CampaignSpec
from resources.pricing import PricingResource, sweep_panel
from resources.storage import ArtifactStore
from resources.training_launcher import TrainingLauncher

STAGE = "hparam_sweep"
# what a sweep's result does not depend on: how much money, how many at once, where the study lives
NOT_IN_KEY = {"budget_usd", "parallel", "storage", "heartbeat_s", "grace_s", "max_retries"}


def sweep_key(spec: CampaignSpec, dataset_key: str, base_identity: str) -> str:
    return stage_key("sweep/v1", dataset_key, base_identity, training_key_fields(spec),
                     spec.sweep.model_dump(exclude=NOT_IN_KEY))


def _rate(records: list[tuple[int, float]], planned_startup: float = 0.0) -> tuple[float, float] | None:
    """Startup seconds and seconds per step from measured launches (steps trained, wall seconds): a line
    through them once two lengths were measured; from one length, the planner's start-up (at most 80% of the
    launch) and the rest per step."""
    pts = [(n, s) for n, s in records if n > 0]
    if not pts:
        return None
    if len({n for n, _ in pts}) < 2:
        n, s = max(pts, key=lambda p: p[1])
        a = min(planned_startup, 0.8 * s)
        return a, (s - a) / n
    import numpy as np

    x = np.array([n for n, _ in pts], dtype=float)
    y = np.array([s for _, s in pts], dtype=float)
    b, a = np.polyfit(x, y, 1)
    return max(0.0, float(a)), max(float(b), float(min(y / x)) * 0.25)


def build(spec: CampaignSpec):
    s, tr, sw = spec.student, spec.training, spec.sweep

    @asset(key=key(spec, STAGE), group_name=spec.name, kinds={"optuna", "pytorch"},
           ins={"dataset": AssetIn(key(spec, "tokenized_dataset"))}, deps=model_deps(s.base_model), pool="gpu",
           description=(f"Optuna sweep over {', '.join(sw.space)}: {sw.trials} trials, successive halving at "
                        f"{sw.ladder(tr.max_steps)} steps (keep 1/{sw.rungs.reduction_factor})"
                        + (f", cap ${sw.budget_usd:g}" if sw.budget_usd else "") + "; the best drives student_adapter."))
    def hparam_sweep(context: AssetExecutionContext, dataset: dict, storage: ArtifactStore,
                     launcher: TrainingLauncher, pricing: PricingResource) -> Output[dict]:
        from campaign_orchestrator.sweep import RungOutcome, Sweep, make_storage, storage_url
        from training.config import TrainJob

        base = storage.resolve_model(s.base_model, spec.project_dir)
        k = sweep_key(spec, dataset["key"], model_identity(base, s.revision))
        sd = storage.stage(spec.name, STAGE, k)
        cached = sd.is_complete()
        if cached and sd.manifest().get("stopped_by_cap") and sd.manifest().get("cap_usd") != sw.budget_usd:
            cached = False  # stopped by a cap that has since changed: resume the study (no rung is retrained)
        if not cached:
            workdir = sd.ensure()
            ledger = pricing.ledger_at(sd.root)
            measured: list[tuple[int, float]] = []
            capped = sw.budget_usd is not None or spec.cost.budget_usd is not None
            try:
                plan = pricing.plan(spec, sd.root)["stages"]["student_adapter"]
                startup = float(plan.get("startup_s", 0.0))
                planned = (startup, max(0.0, plan["seconds"] - startup) / plan["steps"])
            except Exception as e:  # noqa: BLE001 - whatever the planner raised, it is named in the error
                if capped:  # never price a rung at $0 under a cap: say what failed and stop
                    raise Failure(f"sweep: the planner could not estimate a rung of {spec.name}'s sweep ({e}); a "
                                  "capped sweep (sweep.budget_usd / cost.budget_usd) needs that estimate before its "
                                  "first rung. Fix the cause (run `campaign plan` to see it), then materialize "
                                  "again.") from e
                context.log.warning(f"sweep: no planner estimate ({e}); no cap to keep, rungs timed as they run")
                planned = None
            step_key = context.get_step_execution_context().step.key
            tok = teacher_tokenizer_path(spec, storage)
            gpu = pricing.gpu_required(spec)
            remote = tr.checkpoint.remote_uri
            cluster = {"kubernetes": spec.kubernetes} if tr.launcher == "k8s" else {}
            mlflow_runs: dict[int, str] = {}

            def seconds_for(steps: int) -> float:
                rate = _rate(measured, planned[0] if planned else 0.0) or planned
                if rate is None:
                    raise RuntimeError(f"sweep: no estimate for {steps} steps (no planner estimate, nothing measured)")
                return rate[0] + rate[1] * steps

            def estimate_usd(steps: int, _trial: int) -> float:  # at training.hardware, as the rung's guard accrues
                return pricing.bill(spec, STAGE, {"seconds": seconds_for(steps), "hardware": tr.hardware})["usd"]

            def full_run_seconds(steps: int) -> float | None:
                try:
                    return seconds_for(steps)
                except RuntimeError:  # nothing measured in this process and no plan: each trial's own rate
                    return None

            def make_guard(rec, steps: int, limits):
                """The rung's launch: stopped inside when what it accrues would cross what is left of the cap."""
                return pricing.guard(context, spec, sd, limits=limits, part=f"{trial_partition(rec.root)}:rung-{steps}")

            def spent_usd() -> float:
                return ledger.stage_spent(spec.name, STAGE, k)

            def record_lines(rec, steps: int, lines: list[dict]) -> None:
                ledger.record_lines(campaign=spec.name, asset=STAGE, run_id=context.run_id, step_key=step_key,
                                    attempt=context.retry_number, stage_key=k,
                                    production_id=f"{STAGE}:{k}:{trial_partition(rec.root)}:rung-{steps}", lines=lines)

            def run_rung(rec, tdir: Path, steps: int, prev: int, budget=None) -> RungOutcome:
                tspec = spec.with_params(rec.params)
                (tdir / "summary.json").unlink(missing_ok=True)
                job = TrainJob(campaign=spec.name, base_model_path=str(base), dataset_path=dataset["dataset_path"],
                               validation_path=dataset.get("validation_path"), output_dir=str(tdir),
                               student=tspec.student, training=tspec.training, teacher_tokenizer_path=tok,
                               gpu_required=gpu, stop_at_step=steps if steps < tr.max_steps else None,
                               checkpoint_uri=(f"{remote.rstrip('/')}/{spec.name}/{STAGE}/{k}/{trial_partition(rec.root)}"
                                               if remote else None))
                t0 = time.perf_counter()
                context.log.info(f"sweep: trial {rec.number} ({trial_partition(rec.root)}) {rec.params}: steps "
                                 f"{prev}→{steps}")
                try:
                    launcher.launch(context, job, tdir, budget=budget, **cluster)
                except Failure as e:
                    wall = time.perf_counter() - t0
                    log_tail = "".join(str(v.value) for v in (e.metadata or {}).values())
                    if "non-finite" not in log_tail + str(e):
                        raise
                    lines = pricing.bill(spec, STAGE, {"seconds": wall, "hardware": tr.hardware})["lines"]
                    context.log.warning(f"sweep: trial {rec.number} diverged (non-finite loss) before step {steps}")
                    return RungOutcome(value=float("inf"), seconds=wall, lines=lines, trained_steps=steps - prev)
                wall = time.perf_counter() - t0
                summary = json.loads((tdir / "summary.json").read_text())
                trained = summary["trained_steps"] if summary.get("rung") else steps - (summary.get("resumed_from_step") or 0)
                measured.append((trained, wall))
                if summary.get("eval_loss") is None:
                    raise Failure(f"sweep: trial {rec.number} has no eval loss (no validation rows: set "
                                  "dataset.validation_fraction or training.eval_rows)")
                lines = pricing.bill(spec, STAGE, {"seconds": wall, "device": summary.get("device", "cpu")})["lines"]
                return RungOutcome(value=float(summary["eval_loss"]), seconds=wall, lines=lines,
                                   trained_steps=trained, resumed_from=summary.get("resumed_from_step"))

            def on_event(rec) -> None:
                pk = trial_partition(rec.root)
                context.instance.add_dynamic_partitions(trial_partitions(spec).name, [pk])
                last = max(rec.rungs) if rec.rungs else 0
                md = {"trial": rec.number, "state": rec.state, "params": MetadataValue.json(rec.params),
                      "rung_eval_loss": MetadataValue.json({str(k2): v["value"] for k2, v in sorted(rec.rungs.items())}),
                      "steps": last, "eval_loss": rec.rungs[last]["value"] if rec.rungs else None,
                      "cost_usd": rec.usd, "rungs": MetadataValue.json({str(k2): v for k2, v in sorted(rec.rungs.items())}),
                      "sweep": k, **{f"param {n}": v for n, v in rec.params.items()}}
                if rec.root != rec.number:
                    md["retry_of"] = rec.root
                context.log_event(AssetMaterialization(asset_key=trial_key(spec), partition=pk,
                                                       metadata={a: b for a, b in md.items() if b is not None}))
                if spec.tracking.mlflow is not None and rec.state in ("PRUNED", "COMPLETE", "STOPPED"):
                    from assets.tracking import log_trial

                    mlflow_runs[rec.number] = log_trial(spec, sd.root, k, rec)

            limits = []
            c = spec.cost
            if c.budget_usd is not None:  # the campaign's budget holds during the sweep too (budget_scope applies)
                run_scope = context.run_id if c.budget_scope == "run" else None
                limits.append(("campaign budget (cost.budget_usd)", c.budget_usd,
                               lambda: ledger.spent(spec.name, run_id=run_scope)))
            url = storage_url(spec, sd.root)
            sweep = Sweep(spec, workdir, make_storage(url, sw), f"{spec.name}-{k}", run_rung=run_rung,
                          estimate_usd=estimate_usd, spent_usd=spent_usd, record_lines=record_lines, on_event=on_event,
                          log=context.log.info, full_run_seconds=full_run_seconds, limits=limits,
                          make_guard=make_guard)
            t0 = time.perf_counter()
            result = sweep.run()
            result["spent_usd"] = spent_usd()  # the ledger's word: every rung of this sweep, any run
            if result["best_root"] is not None:
                result["best_dir"] = str(workdir / trial_partition(result["best_root"]))
            (workdir / "sweep.json").write_text(json.dumps(result, indent=2, default=str))
            (workdir / "panel.json").write_text(json.dumps(sweep_panel(result), indent=2, default=str))
            sd.commit(result | {"storage": url.split("@")[-1], "wall_seconds": time.perf_counter() - t0,
                                "cost_lines": []})  # the lines are in the ledger per trial and rung
        m = sd.manifest()
        if m.get("stopped_by_cap"):
            context.log.warning(m["stopped_by_cap"])
        md = base_metadata(m, cached) | {
            "cost_usd": m["spent_usd"], "spent_this_run_usd": 0.0 if cached else m["spent_usd"],
            "trials_run": m["trials_run"], "trials_pruned": m["trials_pruned"],
            "pruned_at_first_rung": m["pruned_at_first_rung"], "trials_complete": m["trials_complete"],
            "trials_stopped_by_cap": m["trials_stopped_by_cap"], "rungs": MetadataValue.json(m["rungs"]),
            "best_trial": m["best_trial"], "best_params": MetadataValue.json(m["best_params"]),
            "best_eval_loss": m["best_value"], "default_eval_loss": m["default_value"],
            "cap_usd": m["cap_usd"], "stopped_by_cap": m["stopped_by_cap"] or "",
            "time_saved_seconds": m["time_saved_seconds"], "trial_seconds": m["trial_seconds"],
            "every_trial_to_the_end_seconds": m["every_trial_to_the_end_seconds"],
            "steps_trained": m["steps_trained"], "steps_if_every_trial_ran_to_the_end": m["steps_if_every_trial_ran_to_the_end"],
            "trials": MetadataValue.md(trials_table(m)),
        }
        return Output(m, metadata={a: b for a, b in md.items() if b is not None})

    return hparam_sweep


def trials_table(m: dict) -> str:
    rungs = m["rungs"]
    head = "| trial | state | " + " | ".join(f"loss @ {r}" for r in rungs) + " | cost $ | params |"
    rows = [head, "|" + "---|" * (len(rungs) + 4)]
    for t in m["trials"]:
        vals = [t["rungs"].get(str(r), {}).get("value") for r in rungs]
        rows.append(f"| {t['trial']} | {t['state']} | " + " | ".join("" if v is None else f"{v:.4f}" for v in vals)
                    + f" | {t['usd']:.6f} | {json.dumps(t['params'])} |")
    return "\n".join(rows)
