"""One rung of a sweep trial as a launch of the campaign's own trainer, and the rate that prices rungs.

``campaign_orchestrator.sweep.Sweep`` drives the Optuna study and asks for rungs; :class:`RungRunner` answers
it: it builds the trial's :class:`training.config.TrainJob` (``stop_at_step`` at the rung), launches it
through the callable it was given (the asset passes its launcher), reads ``summary.json`` back into a
``RungOutcome`` and keeps what each launch measured, so the next rungs are priced from this host's rate.
No Dagster here: the asset (``assets/hparam_sweep.py``) passes its launcher, pricing and log as callables.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from campaigns.spec import CampaignSpec

STAGE = "hparam_sweep"


def rate(records: list[tuple[int, float]], planned_startup: float = 0.0) -> tuple[float, float] | None:
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


@dataclass
class RungRunner:
    """Trains rungs of the sweep of ``spec`` (stage key ``key``) on ``dataset`` (the tokenized stage's manifest).

    ``launch(job, trial_dir, budget)`` runs one launch and raises when it fails; ``diverged(error)`` says whether
    such a failure was a non-finite loss (the trial's value is then ``inf``, not an error); ``bill(usage)``
    prices ``{"seconds", "hardware" | "device"}`` into cost lines; ``fail(message)`` builds the error raised when
    a rung has no eval loss; ``planned``: the planner's ``(startup seconds, seconds per step)`` or None;
    ``partition(root)``: the trial's name in paths (``trial-000``); ``policy_terms``: what the trainer's policy adds
    to its device (``campaign_orchestrator.costs.memory_policy.policy_terms``), as the adapter's own job has it."""

    spec: CampaignSpec
    key: str
    base: Path
    dataset: dict
    teacher_tokenizer: str | None
    gpu_required: bool
    launch: Callable[[Any, Path, Any], None]
    diverged: Callable[[Exception], bool]
    bill: Callable[[dict], list[dict]]
    partition: Callable[[int], str]
    planned: tuple[float, float] | None = None
    log: Callable[[str], None] = print
    warn: Callable[[str], None] = print
    fail: Callable[[str], Exception] = RuntimeError
    measured: list[tuple[int, float]] = field(default_factory=list)
    policy_terms: dict | None = None  # the trainer's policy inputs from the catalog (TrainJob.policy_terms)

    def seconds_for(self, steps: int) -> float:
        """Seconds a launch of ``steps`` steps takes: this host's measured rate, else the planner's."""
        r = rate(self.measured, self.planned[0] if self.planned else 0.0) or self.planned
        if r is None:
            raise RuntimeError(f"sweep: no estimate for {steps} steps (no planner estimate, nothing measured)")
        return r[0] + r[1] * steps

    def full_run_seconds(self, steps: int) -> float | None:
        try:
            return self.seconds_for(steps)
        except RuntimeError:  # nothing measured in this process and no plan: each trial's own rate
            return None

    def job(self, rec, tdir: Path, steps: int):
        """The trial's train job, stopped at ``steps`` (None at the last rung), checkpointing under its partition."""
        from training.config import TrainJob

        spec, tr = self.spec, self.spec.training
        tspec = spec.with_params(rec.params)
        remote = tr.checkpoint.remote_uri
        return TrainJob(
            campaign=spec.name,
            base_model_path=str(self.base),
            dataset_path=self.dataset["dataset_path"],
            validation_path=self.dataset.get("validation_path"),
            output_dir=str(tdir),
            student=tspec.student,
            training=tspec.training,
            teacher_tokenizer_path=self.teacher_tokenizer,
            gpu_required=self.gpu_required,
            stop_at_step=steps if steps < tr.max_steps else None,
            policy_terms=self.policy_terms,
            checkpoint_uri=(
                f"{remote.rstrip('/')}/{spec.name}/{STAGE}/{self.key}/{self.partition(rec.root)}" if remote else None
            ),
        )

    def run_rung(self, rec, tdir: Path, steps: int, prev: int, budget=None):
        """Train ``rec`` from ``prev`` to ``steps`` steps (``Sweep``'s ``run_rung``): its eval loss, wall time and
        cost lines; a diverged launch is worth ``inf``."""
        import json
        import time

        from campaign_orchestrator.sweep import RungOutcome

        job = self.job(rec, tdir, steps)
        (tdir / "summary.json").unlink(missing_ok=True)
        t0 = time.perf_counter()
        self.log(f"sweep: trial {rec.number} ({self.partition(rec.root)}) {rec.params}: steps {prev}→{steps}")
        try:
            self.launch(job, tdir, budget)
        except Exception as e:
            wall = time.perf_counter() - t0
            if not self.diverged(e):
                raise
            lines = self.bill({"seconds": wall, "hardware": self.spec.training.hardware})
            self.warn(f"sweep: trial {rec.number} diverged (non-finite loss) before step {steps}")
            return RungOutcome(value=float("inf"), seconds=wall, lines=lines, trained_steps=steps - prev)
        wall = time.perf_counter() - t0
        summary = json.loads((tdir / "summary.json").read_text())
        trained = summary["trained_steps"] if summary.get("rung") else steps - (summary.get("resumed_from_step") or 0)
        self.measured.append((trained, wall))
        if summary.get("eval_loss") is None:
            raise self.fail(
                f"sweep: trial {rec.number} has no eval loss (no validation rows: set "
                "dataset.validation_fraction or training.eval_rows)"
            )
        lines = self.bill({"seconds": wall, "device": summary.get("device", "cpu")})
        return RungOutcome(
            value=float(summary["eval_loss"]),
            seconds=wall,
            lines=lines,
            trained_steps=trained,
            resumed_from=summary.get("resumed_from_step"),
        )
