"""The sweep's Optuna storage on a real PostgreSQL server: two processes write trials at once; a trial whose
process is SIGKILLed stops heart-beating, is marked failed and re-queued (never left RUNNING)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from campaign_orchestrator.sweep import Sweep, make_storage, make_study
from campaigns.loader import load_campaigns
from tests.support import REPO_ROOT as REPO

pytestmark = pytest.mark.stage


def _campaign(tmp_path, url: str):
    data = yaml.safe_load((REPO / "campaigns" / "demo_sweep.yaml").read_text())
    data["sweep"] |= {"storage": url, "heartbeat_s": 1, "grace_s": 3, "enqueue": [], "include_default": False}
    path = tmp_path / "campaigns" / "demo_sweep.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(data))
    return path, load_campaigns([str(path)]).campaigns["demo_sweep"]


def _worker(path, study: str, mode: str, log):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.sweep_worker", str(path), study, mode],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def _wait_until(cond, proc, log, what: str, timeout_s: float = 60.0):
    """Poll ``cond`` until it is truthy (returned), ``proc`` dies or ``timeout_s`` passes (failing with its log)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, f"worker exited (rc {proc.returncode}) before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s:\n{log.read_text()}"
        time.sleep(0.05)


def _heartbeats(url: str, trial_id: int) -> int:
    """Heartbeats Optuna recorded for ``trial_id`` (its ``trial_heartbeats`` table)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as con:
            return con.execute(
                sqlalchemy.text("SELECT count(*) FROM trial_heartbeats WHERE trial_id = :t"), {"t": trial_id}
            ).scalar_one()
    finally:
        engine.dispose()


def test_two_processes_share_a_postgres_study_and_a_killed_trial_is_retried(tmp_path, pg_database):
    from optuna.trial import TrialState

    path, spec = _campaign(tmp_path, pg_database.sqlalchemy_url)
    name = "demo_sweep-pg"
    make_study(spec, make_storage(spec.sweep.storage, spec.sweep), name)  # created once, then shared
    a, b = (_worker(path, name, "pair", tmp_path / f"{w}.log") for w in "ab")
    assert a.wait(120) == 0 and b.wait(120) == 0, (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    study = make_study(spec, make_storage(spec.sweep.storage, spec.sweep), name)
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(done) == 4 and all(set(t.intermediate_values) == {10, 30} for t in done)

    hung = _worker(path, name, "hang", tmp_path / "hang.log")
    # the hung trial is RUNNING and its heartbeat is in the database (what makes it detectably stale once killed)
    running = _wait_until(
        lambda: study.get_trials(states=(TrialState.RUNNING,)), hung, tmp_path / "hang.log", "a RUNNING trial"
    )
    killed = running[0].number
    _wait_until(
        lambda: _heartbeats(pg_database.sqlalchemy_url, running[0]._trial_id),
        hung,
        tmp_path / "hang.log",
        f"a heartbeat of trial {killed}",
    )
    os.kill(hung.pid, signal.SIGKILL)
    hung.wait()
    assert [t.number for t in study.get_trials(states=(TrialState.RUNNING,))] == [killed]

    sweep = Sweep(
        spec,
        tmp_path / "work",
        study._storage,
        name,
        run_rung=None,
        estimate_usd=lambda s, n: 0.0,
        spent_usd=lambda: 0.0,
        record_lines=lambda *a: None,
        log=lambda m: None,
    )
    assert sweep._wait_for_stale(study) == 1
    trials = study.get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert next(t for t in trials if t.number == killed).state == TrialState.FAIL
    retry = [t for t in trials if t.state == TrialState.WAITING]
    assert len(retry) == 1 and retry[0].system_attrs["failed_trial"] == killed
    assert retry[0].params == next(t for t in trials if t.number == killed).params
