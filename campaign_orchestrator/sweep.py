"""Hyperparameter sweeps: an Optuna study with asynchronous successive halving under a dollar cap.

The engine is Optuna (``study.optimize`` with a ``SuccessiveHalvingPruner``, RDB storage with heartbeats
and ``RetryHeartbeatStaleTrialCallback``); this module only supplies the objective, which trains one rung
at a time through a ``run_rung`` callback (the Dagster asset passes one that launches the campaign's
launcher, local or Kubernetes) and keeps what makes a sweep safe to kill and cheap to rerun:

* **Trials continue, not restart.** Every trial has a directory keyed by its *original* trial number
  (a retried trial reuses it); each rung trains from the trial's last checkpoint to the rung's step
  and writes ``rung-<steps>.json``. A rerun (or a retry of a killed trial) replays the rungs whose
  file exists (no training), so no finished rung and no finished trial is trained again.
* **Money: a hard cap.** Each rung's cost lines go to the ledger under the trial's id when the rung ends.
  Before a rung starts, spend so far (ledger) + the rungs in flight (their estimates) + this rung's
  estimate must fit the cap; otherwise the sweep stops launching (``study.stop()``) and says so. Inside a
  rung, the launch carries a :class:`campaign_orchestrator.costs.budget.BudgetGuard` (``make_guard``) sized to
  what is left of the cap: the ledger's spend plus what the rungs running next to it have accrued, read at
  every check; when the next chunk would cross the cap, the launcher stops the rung (SIGTERM: the trainer
  checkpoints), its spend so far goes to the ledger as interrupted, and the sweep stops. So the sweep's
  spend stays within the cap, not the cap plus a rung. An estimate that cannot be made is an error.
* **Killed trials.** A trial whose process died stops heart-beating; the next sweep waits out the grace
  period, Optuna marks it FAIL and re-queues its parameters (``failed_trial`` names the original).

Pure Python: no Dagster import (the asset turns ``on_event`` calls into materializations).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from campaigns.spec import CampaignSpec
from campaigns.spec.sweep import ParamSpec, SweepSpec

ASSET = "hparam_sweep"


class CapReached(RuntimeError):
    """The next rung would cross the sweep's dollar cap: not launched (or stopped inside, by its guard)."""


@dataclass
class RungOutcome:
    """What ``run_rung`` returns for one rung of one trial."""

    value: float  # the sweep metric at the rung (lower is better)
    seconds: float  # wall time of the launch (what is billed)
    lines: list[dict]  # its cost lines
    trained_steps: int  # steps trained in this launch (0 when the rung was already done)
    resumed_from: int | None = None


@dataclass
class TrialRecord:
    number: int  # the Optuna trial number
    root: int  # the original trial number (its directory; equal to number unless a retry)
    params: dict[str, Any]
    rungs: dict[int, dict] = field(default_factory=dict)  # steps -> {value, seconds, usd, trained_steps, replayed}
    state: str = "RUNNING"  # RUNNING | PROMOTED | PRUNED | COMPLETE | STOPPED (cap) | FAIL
    interrupted_usd: float = 0.0  # the spend of a rung the cap stopped inside (in the ledger as interrupted)

    @property
    def usd(self) -> float:
        return float(sum(r["usd"] for r in self.rungs.values() if not r.get("replayed"))) + self.interrupted_usd

    def as_dict(self) -> dict:
        return {
            "trial": self.number,
            "root": self.root,
            "params": self.params,
            "state": self.state,
            "rungs": {str(k): v for k, v in sorted(self.rungs.items())},
            "usd": self.usd,
        }


def suggest(trial, space: dict[str, ParamSpec]) -> dict[str, Any]:
    """Optuna suggestions for the space (an enqueued trial gets its fixed values back)."""
    out: dict[str, Any] = {}
    for name, p in space.items():
        if p.type == "log_uniform":
            out[name] = trial.suggest_float(name, p.low, p.high, log=True)
        elif p.type == "uniform":
            out[name] = trial.suggest_float(name, p.low, p.high)
        elif p.type == "int":
            out[name] = trial.suggest_int(name, int(p.low), int(p.high), log=p.log)
        else:
            out[name] = trial.suggest_categorical(name, p.choices)
    return out


def default_point(spec: CampaignSpec) -> dict[str, Any]:
    """The campaign's own values of the swept fields (trial 0 with ``include_default``)."""
    return {name: spec.param_value(name) for name in spec.sweep.space}


def default_storage(artifact_root: Path, campaign: str) -> str:
    p = Path(artifact_root) / campaign / ASSET / "optuna.db"
    p.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{p}"


def storage_url(spec: CampaignSpec, artifact_root: Path) -> str:
    sw = spec.sweep
    return os.path.expandvars(sw.storage) if sw.storage else default_storage(artifact_root, spec.name)


def make_storage(url: str, sw: SweepSpec):
    import optuna

    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    return optuna.storages.RDBStorage(
        url,
        engine_kwargs=engine,
        heartbeat_interval=sw.heartbeat_s,
        grace_period=sw.grace_s,
        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
            max_retry=sw.max_retries, inherit_intermediate_values=True
        ),
    )


def make_study(spec: CampaignSpec, storage, study_name: str):
    """Create or load the study; the first creation enqueues the default and the spec's start points."""
    import optuna

    sw = spec.sweep
    sampler = (
        optuna.samplers.TPESampler(seed=sw.seed, n_startup_trials=max(3, sw.trials // 2))
        if sw.sampler == "tpe"
        else optuna.samplers.RandomSampler(seed=sw.seed)
    )
    pruner = optuna.pruners.SuccessiveHalvingPruner(
        min_resource=sw.rungs.min_steps, reduction_factor=sw.rungs.reduction_factor
    )
    study = optuna.create_study(
        study_name=study_name,
        storage=storage,
        sampler=sampler,
        pruner=pruner,
        direction="minimize",
        load_if_exists=True,
    )
    if not study.user_attrs.get("enqueued"):
        points = ([default_point(spec)] if sw.include_default else []) + [dict(p) for p in sw.enqueue]
        for p in points:
            study.enqueue_trial(p, skip_if_exists=True)
        study.set_user_attr("enqueued", True)
        study.set_user_attr("campaign", spec.name)
    return study


def plan_rungs(sw: SweepSpec, max_steps: int) -> list[dict]:
    """Surviving trials and steps per rung (``SweepSpec.plan_rungs``: what the planner estimates)."""
    return sw.plan_rungs(max_steps)


class Sweep:
    """One sweep step: runs (or resumes) the study until ``trials`` are done or the cap stops it.

    ``run_rung(record, trial_dir, steps, prev_steps, budget=guard) -> RungOutcome`` trains one rung, its
    launch watched by ``guard`` (None without ``make_guard``); ``estimate_usd(steps)`` prices ``steps`` steps
    (the planner's or the measured rate; it raises when it has neither); ``spent_usd()`` reads the ledger's
    sweep spend; ``record_lines(record, steps, lines)`` writes a rung's lines to the ledger;
    ``make_guard(record, steps, limits) -> BudgetGuard`` builds the guard of one rung's launch for ``limits``,
    ``(what, cap, spent_now)`` with ``spent_now()`` the spend outside the rung, read at every check (a
    ``campaign_orchestrator.costs.budget.Limit`` each; the guard's ``stopped`` says it stopped the rung);
    ``on_event(record)`` is called
    after every rung and state change (the asset turns it into a materialization)."""

    def __init__(
        self,
        spec: CampaignSpec,
        workdir: Path,
        storage,
        study_name: str,
        *,
        run_rung: Callable[[TrialRecord, Path, int, int], RungOutcome],
        estimate_usd: Callable[[int, int], float],
        spent_usd: Callable[[], float],
        record_lines: Callable[[TrialRecord, int, list[dict]], None],
        on_event: Callable[[TrialRecord], None] = lambda r: None,
        log: Callable[[str], None] = print,
        full_run_seconds: Callable[[int], float] | None = None,
        limits: list[tuple[str, float, Callable[[], float]]] = (),
        make_guard: Callable[[TrialRecord, int, list], Any] | None = None,
    ):
        self.spec, self.sw = spec, spec.sweep
        self.workdir = Path(workdir)
        self.storage, self.study_name = storage, study_name
        self.run_rung, self.estimate_usd, self.spent_usd = run_rung, estimate_usd, spent_usd
        self.record_lines, self.on_event, self.log = record_lines, on_event, log
        self.full_run_seconds = full_run_seconds
        self.limits = list(limits)
        self.ladder = self.sw.ladder(spec.training.max_steps)
        self.lock = threading.Lock()
        self.in_flight: dict[int, float] = {}  # trial number -> its running rung's estimate
        self.make_guard = make_guard
        self.guards: dict[int, Any] = {}  # trial number -> the guard of its running rung (until its lines are recorded)
        self.records: dict[int, TrialRecord] = {}
        self.stopped_by_cap: str | None = None

    # ------------------------------------------------------------------ the objective
    def _root(self, trial) -> int:
        frozen = trial.study._storage.get_trial(trial._trial_id)
        return frozen.system_attrs.get("failed_trial", trial.number)

    def _limits(self) -> list[tuple[str, float, Callable[[], float]]]:
        """(what, cap, spent so far): the sweep's cap on the sweep's spend, then ``limits`` (e.g. the campaign's
        budget on the campaign's spend)."""
        return (
            [("sweep cap", self.sw.budget_usd, self.spent_usd)] if self.sw.budget_usd is not None else []
        ) + self.limits

    def _accrued_elsewhere(self, number: int) -> float:
        """What the rungs running next to trial ``number``'s have accrued and not yet recorded."""
        with self.lock:
            guards = [g for k, g in self.guards.items() if k != number]
        return float(sum(g.accrued_usd() for g in guards))

    def _rung_guard(self, rec: TrialRecord, steps: int):
        """The guard of one rung's launch: every limit as (what, cap, spend outside this rung: read at every check)."""
        if self.make_guard is None:
            return None
        n = rec.number
        limits = [(what, cap, lambda fn=fn: fn() + self._accrued_elsewhere(n)) for what, cap, fn in self._limits()]
        guard = self.make_guard(rec, steps, limits)
        with self.lock:
            self.guards[n] = guard
        return guard

    def _check_cap(self, number: int, steps: int, prev: int) -> None:
        """Every limit must hold for spend so far + the rungs in flight + this rung's estimate."""
        limits = self._limits()
        if not limits:
            return
        need = self.estimate_usd(steps - prev, number)
        with self.lock:
            flying = sum(v for k, v in self.in_flight.items() if k != number)
            for what, cap, spent_fn in limits:
                spent = spent_fn()
                if spent + flying + need > cap:
                    msg = (
                        f"{what} ${cap:.6f}: spent ${spent:.6f}, in flight ${flying:.6f}, the next rung (trial "
                        f"{number}, steps {prev}→{steps}) needs ~${need:.6f}: not launched"
                    )
                    self.stopped_by_cap = self.stopped_by_cap or msg
                    raise CapReached(msg)
            self.in_flight[number] = need

    def objective(self, trial) -> float:
        import optuna

        root = self._root(trial)
        params = suggest(trial, self.sw.space)
        rec = TrialRecord(trial.number, root, params)
        self.records[trial.number] = rec
        tdir = self.workdir / f"trial-{root:03d}"
        tdir.mkdir(parents=True, exist_ok=True)
        (tdir / "params.json").write_text(json.dumps(params, indent=2))
        trial.set_user_attr("trial_dir", str(tdir))
        prev, value = 0, float("nan")
        for k, steps in enumerate(self.ladder):
            done = tdir / f"rung-{steps}.json"
            if done.exists():  # trained by an earlier process: replay, never retrain
                r = json.loads(done.read_text()) | {"replayed": True}
            else:
                try:
                    self._check_cap(trial.number, steps, prev)
                except CapReached:
                    rec.state = "STOPPED"
                    trial.set_user_attr("stopped", "budget cap")
                    self.on_event(rec)
                    trial.study.stop()
                    raise
                guard = None
                try:
                    try:
                        guard = self._rung_guard(rec, steps)
                        out = self.run_rung(rec, tdir, steps, prev, budget=guard)
                    except Exception as e:
                        if guard is None or not guard.stopped:
                            raise
                        # the guard stopped the rung inside: its spend is in the ledger (interrupted)
                        msg = f"trial {trial.number} stopped inside its rung (steps {prev}→{steps}): {e}"
                        self.stopped_by_cap = self.stopped_by_cap or msg
                        rec.state = "STOPPED"
                        rec.interrupted_usd = guard.interrupted_usd if guard is not None else 0.0
                        trial.set_user_attr("stopped", "budget cap")
                        trial.set_user_attr("interrupted_usd", rec.interrupted_usd)
                        self.on_event(rec)
                        trial.study.stop()
                        raise CapReached(msg) from e
                    usd = float(sum(x["usd"] for x in out.lines))
                    self.record_lines(rec, steps, out.lines)
                finally:
                    with self.lock:
                        self.in_flight.pop(trial.number, None)
                        self.guards.pop(trial.number, None)
                r = {
                    "steps": steps,
                    "value": out.value,
                    "seconds": out.seconds,
                    "usd": usd,
                    "trained_steps": out.trained_steps,
                    "resumed_from": out.resumed_from,
                }
                tmp = done.with_suffix(".tmp")
                tmp.write_text(json.dumps(r, indent=2))
                os.replace(tmp, done)
            rec.rungs[steps] = r
            value = float(r["value"])
            trial.set_user_attr(f"rung_{steps}", {k2: r[k2] for k2 in ("value", "seconds", "usd", "trained_steps")})
            trial.report(value, steps)
            last = k == len(self.ladder) - 1
            if not last and trial.should_prune():
                rec.state = "PRUNED"
                self.on_event(rec)
                raise optuna.TrialPruned(f"pruned at step {steps} (eval loss {value:.4f})")
            rec.state = "COMPLETE" if last else "PROMOTED"
            self.on_event(rec)
            prev = steps
        return value

    # ------------------------------------------------------------------ the study
    def _wait_for_stale(self, study) -> int:
        """RUNNING trials at start belong to a dead sweep process (one sweep step runs per campaign): wait
        until their heartbeats are older than the grace period, then let Optuna fail and re-queue them."""
        import optuna
        from optuna.trial import TrialState

        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not running:
            return 0
        self.log(
            f"sweep: {len(running)} trial(s) left RUNNING by a dead process; waiting up to {self.sw.grace_s}s "
            "for their heartbeat to go stale"
        )
        deadline = time.monotonic() + self.sw.grace_s + 2 * self.sw.heartbeat_s
        while time.monotonic() < deadline:
            optuna.storages.fail_stale_trials(study)
            if not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                break
            time.sleep(0.5)
        return len(running)

    def _requeue_failed(self, study) -> int:
        """Trials that failed in a process that lived to mark them (a cancelled run: SIGTERM reached the trainer,
        which checkpointed; a rung the cap stopped, now under a raised cap) are re-queued like stale ones, with
        their parameters and original number, at most ``max_retries`` times each."""
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        latest: dict[int, int] = {}
        for t in trials:
            root = t.system_attrs.get("failed_trial", t.number)
            latest[root] = max(latest.get(root, -1), t.number)
        callback = self.storage.get_heartbeat_stale_trial_callback()
        n = 0
        for t in trials:
            root = t.system_attrs.get("failed_trial", t.number)
            if t.state == TrialState.FAIL and latest[root] == t.number:
                before = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
                callback(study, t)
                n += len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,))) - before
        if n:
            self.log(f"sweep: re-queued {n} failed trial(s); each resumes from its own last checkpoint")
        return n

    def run(self) -> dict:
        import optuna
        from optuna.trial import TrialState

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = make_study(self.spec, self.storage, self.study_name)
        recovered = self._wait_for_stale(study)
        self._requeue_failed(study)
        done = [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        remaining = self.sw.trials - len(done)
        t0 = time.perf_counter()
        if remaining > 0:
            self.log(
                f"sweep {self.study_name}: {len(done)} trial(s) done, running {remaining} more "
                f"({self.sw.parallel} at once), rungs {self.ladder}"
            )
            study.optimize(
                self.objective, n_trials=remaining, n_jobs=self.sw.parallel, catch=(CapReached,), gc_after_trial=False
            )
        wall = time.perf_counter() - t0
        return self.summary(study, wall, recovered)

    def summary(self, study, wall: float, recovered: int = 0) -> dict:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        per = []
        for t in trials:
            rungs = {int(k.removeprefix("rung_")): v for k, v in t.user_attrs.items() if k.startswith("rung_")}
            state = "STOPPED" if t.user_attrs.get("stopped") else t.state.name
            interrupted = float(t.user_attrs.get("interrupted_usd", 0.0))  # a rung the cap stopped inside
            per.append(
                {
                    "trial": t.number,
                    "root": t.system_attrs.get("failed_trial", t.number),
                    "state": state,
                    "params": t.params,
                    "rungs": {str(s): rungs[s] for s in sorted(rungs)},
                    "value": t.value,
                    "last_step": max(rungs) if rungs else 0,
                    "usd": float(sum(r["usd"] for r in rungs.values())) + interrupted,
                    "interrupted_usd": interrupted,
                }
            )
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        top = self.ladder[-1]
        # the trials that ran (at least one rung), by original number: a retry stands for the trial it retried
        by_root = {p["root"]: p for p in per if p["state"] in ("COMPLETE", "PRUNED", "STOPPED") and p["rungs"]}
        if complete:
            best = min(complete, key=lambda t: t.value)
            best_params, best_value, best_number = best.params, float(best.value), best.number
        else:  # the cap stopped it before any trial reached the top rung: the best at the highest rung reached
            reached = [p for p in per if p["rungs"]]
            if not reached:
                best_params, best_value, best_number = default_point(self.spec), None, None
            else:
                b = min(reached, key=lambda p: (-p["last_step"], p["rungs"][str(p["last_step"])]["value"]))
                best_params, best_value, best_number = b["params"], b["rungs"][str(b["last_step"])]["value"], b["trial"]
        best_root = next((p["root"] for p in per if p["trial"] == best_number), None)
        default = per[0] if per and self.sw.include_default else None
        pruned = [p for p in per if p["state"] == "PRUNED"]
        first = self.ladder[0]
        # time saved: every finished/pruned trial's measured seconds per step × the steps it did not run
        seconds = sum(r["seconds"] for p in by_root.values() for r in p["rungs"].values())
        # every trial to the end: one launch each of the top rung's steps, at the start-up and seconds per step
        # fitted to this sweep's own launches (``full_run_seconds``), else each trial's own rate
        full = 0.0
        for p in by_root.values():
            fitted = self.full_run_seconds(top) if self.full_run_seconds is not None else None
            if fitted is not None:
                full += fitted
            else:
                full += sum(r["seconds"] for r in p["rungs"].values()) / max(p["last_step"], 1) * top
        return {
            "study": self.study_name,
            "rungs": self.ladder,
            "trials": per,
            "trials_run": len(by_root),
            "trials_pruned": len(pruned),
            "pruned_at_first_rung": sum(1 for p in pruned if p["last_step"] == first),
            "trials_complete": len(complete),
            "trials_stopped_by_cap": sum(1 for p in per if p["state"] == "STOPPED"),
            "recovered_trials": recovered,
            "best_trial": best_number,
            "best_root": best_root,
            "best_params": best_params,
            "best_value": best_value,
            "best_complete": bool(complete),
            "default_value": default["value"] if default and default["state"] == "COMPLETE" else None,
            "default_params": default_point(self.spec),
            # a trial's rungs once (a retry replays its original's), and every rung the cap stopped inside
            "spent_usd": float(
                sum(p["usd"] - p["interrupted_usd"] for p in by_root.values()) + sum(p["interrupted_usd"] for p in per)
            ),
            "cap_usd": self.sw.budget_usd,
            "stopped_by_cap": self.stopped_by_cap,
            "sweep_wall_seconds": wall,
            "trial_seconds": seconds,
            "every_trial_to_the_end_seconds": full,
            "time_saved_seconds": full - seconds,
            "steps_trained": sum(r["trained_steps"] for p in by_root.values() for r in p["rungs"].values()),
            "steps_if_every_trial_ran_to_the_end": len(by_root) * top,
        }
