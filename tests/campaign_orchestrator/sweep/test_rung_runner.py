"""A sweep rung as a launch of the trainer (training/sweep_rung.py): the job it builds, the outcome it reads back
from summary.json, a diverged launch worth inf, and the rate it measures for pricing the next rungs."""

import json
from types import SimpleNamespace

import pytest

from campaigns.loader import load_campaign_file
from campaigns.paths import shipped_campaigns_dir
from training.sweep_rung import RungRunner, rate


class Diverged(Exception):
    pass


def _runner(tmp_path, summaries: list, planned=(2.0, 0.5)):
    """A runner whose launches write the next of ``summaries`` as the trainer would (an exception: raised)."""
    spec = load_campaign_file(shipped_campaigns_dir() / "demo_sweep.yaml")
    jobs, bills = [], []

    def launch(job, tdir, budget):
        jobs.append((job, budget))
        out = summaries.pop(0)
        if isinstance(out, Exception):
            raise out
        (tdir / "summary.json").write_text(json.dumps(out))

    def bill(usage):
        bills.append(usage)
        return [{"usd": 0.001, "seconds": usage["seconds"]}]

    runner = RungRunner(
        spec,
        "k1",
        tmp_path / "base",
        {"dataset_path": "/d/train", "validation_path": "/d/val"},
        None,
        False,
        launch=launch,
        diverged=lambda e: isinstance(e, Diverged),
        bill=bill,
        partition=lambda root: f"trial-{root:03d}",
        planned=planned,
        log=lambda m: None,
        warn=lambda m: None,
        fail=ValueError,
    )
    return runner, jobs, bills


def test_a_rung_launches_the_trials_job_to_its_step_and_reads_its_eval_loss(tmp_path):
    runner, jobs, bills = _runner(tmp_path, [{"rung": True, "trained_steps": 30, "eval_loss": 0.75, "device": "cpu"}])
    assert runner.seconds_for(30) == pytest.approx(2.0 + 0.5 * 30)  # the planner's rate before anything ran
    rec = SimpleNamespace(number=4, root=2, params={"training.learning_rate": 0.01, "student.lora.r": 8})
    tdir = tmp_path / "trial-002"
    tdir.mkdir()
    (tdir / "summary.json").write_text("{}")  # a previous rung's: removed before the launch
    out = runner.run_rung(rec, tdir, 30, 0, budget="guard")
    ((job, budget),) = jobs
    assert (job.stop_at_step, job.output_dir, budget) == (30, str(tdir), "guard")
    assert (job.training.learning_rate, job.student.lora.r, job.validation_path) == (0.01, 8, "/d/val")
    assert (out.value, out.trained_steps, out.lines[0]["usd"]) == (0.75, 30, 0.001)
    assert bills[0]["device"] == "cpu" and len(runner.measured) == 1 and runner.measured[0][0] == 30
    assert runner.job(rec, tdir, runner.spec.training.max_steps).stop_at_step is None  # the last rung: to the end


def test_a_diverged_launch_is_worth_inf_and_any_other_failure_or_a_missing_eval_loss_is_an_error(tmp_path):
    runner, _, bills = _runner(
        tmp_path,
        [Diverged("non-finite loss"), RuntimeError("pod lost"), {"rung": True, "trained_steps": 30, "eval_loss": None}],
    )
    rec = SimpleNamespace(number=0, root=0, params={"training.learning_rate": 1.0})
    out = runner.run_rung(rec, tmp_path, 30, 0)
    assert out.value == float("inf") and out.trained_steps == 30 and "hardware" in bills[0]
    assert runner.measured == []  # a diverged launch measures no rate
    with pytest.raises(RuntimeError, match="pod lost"):
        runner.run_rung(rec, tmp_path, 30, 0)
    with pytest.raises(ValueError, match="no eval loss"):
        runner.run_rung(rec, tmp_path, 30, 0)


def test_the_rate_is_a_line_through_two_measured_lengths_else_the_planned_startup():
    assert rate([]) is None
    a, b = rate([(10, 12.0), (30, 32.0)])
    assert (a, b) == (pytest.approx(2.0), pytest.approx(1.0))
    a, b = rate([(10, 12.0)], planned_startup=100.0)  # at most 80% of the launch is start-up
    assert (a, b) == (pytest.approx(9.6), pytest.approx(0.24))
