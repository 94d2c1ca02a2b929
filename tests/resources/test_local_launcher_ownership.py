"""A run owns its trainers: SIGKILL of the launching process alone (an OOM kill, a closed SSH session) takes
torchrun and its workers with it, and a rerun resumes from the last checkpoint written before the kill, never
beside a survivor. Real training of the demo student through the real ``LocalTorchrunLauncher``, launched from a
real parent process (tests/support/launch_parent.py) on a persistent instance."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from resources import run_owner
from tests.support import REPO_ROOT
from tests.support.campaign_support import cli_env, instance_home
from tests.support.processes import run_processes, trainer_workers, wait_for
from tests.support.train_support import make_job, write_cipher_dataset

pytestmark = pytest.mark.slow


class Census(threading.Thread):
    """Samples the live trainer workers of one job file every 50 ms; ``most`` is the largest count seen."""

    def __init__(self, job_file: Path):
        super().__init__(daemon=True)
        self.job_file, self.most, self.samples = job_file, 0, 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.most = max(self.most, len(trainer_workers(self.job_file)))
            self.samples += 1
            self._halt.wait(0.05)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def _parent(workdir: Path, home: Path, run_id: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.launch_parent", str(workdir / "job.json"), str(workdir), run_id],
        cwd=REPO_ROOT,
        env=cli_env(home),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def _complete_steps(ckpts: Path) -> list[int]:
    return sorted(int(d.name.split("-")[1]) for d in ckpts.glob("step-*") if (d / "_SUCCESS").exists())


def test_sigkill_of_the_parent_alone_kills_its_trainers_and_rerun_resumes(tmp_path, demo_models, monkeypatch):
    from dagster import DagsterInstance, DagsterRunStatus

    from assets.run_recovery import reap_dead_runs

    home = instance_home(tmp_path / "dagster_home")
    ds = write_cipher_dataset(tmp_path / "ds", demo_models["student"], 96, seed=5)
    out, workdir = tmp_path / "out", tmp_path / "work"
    workdir.mkdir()
    job = make_job(
        out,
        demo_models["student"],
        ds,
        max_steps=40,
        micro_batch_size=4,
        eval_rows=0,
        log_every=1,
        checkpoint={"every_steps": 2, "every_minutes": None, "keep_last": 50},
    )
    job.write(workdir / "job.json")
    job_file = workdir / "train_job.json"  # what the launcher writes and torchrun's workers are started with
    census = Census(job_file)
    census.start()
    try:
        first_id = str(uuid.uuid4())
        first = _parent(workdir, home, first_id, tmp_path / "first.log")
        ckpts = out / "checkpoints"
        try:
            wait_for(lambda: _complete_steps(ckpts) or first.poll() is not None, 240, "the first checkpoint")
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            alive = run_processes(first_id)
            assert len(alive) >= 2, alive  # torchrun and its worker, both marked with the run id
            first.send_signal(signal.SIGKILL)  # the parent alone: nothing else is signalled
            t_kill = time.monotonic()
            first.wait(10)
            wait_for(lambda: not run_processes(first_id), 10, f"the trainers of the killed parent to die ({alive})")
            died_s = time.monotonic() - t_kill
        finally:
            if first.poll() is None:
                first.kill()
        done_at_kill = _complete_steps(ckpts)
        assert done_at_kill and done_at_kill[-1] < 40, done_at_kill
        assert not (out / "summary.json").exists()
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        with DagsterInstance.get() as instance:
            dead = instance.get_run_by_id(first_id)
            # one ownership tag (the owner and the trainers it started) beside the lease
            assert {k for k in dead.tags if "campaign" in k and "lease" not in k} == {run_owner.OWNER_TAG}, dead.tags
            owner = json.loads(dead.tags[run_owner.OWNER_TAG])
            assert owner["pid"] == first.pid and owner["trainers"] and "pid_ns" in owner["trainers"][0]
            assert dead.status == DagsterRunStatus.STARTED
            assert reap_dead_runs(instance, log=lambda m: None) == [first_id]
            assert instance.get_run_by_id(first_id).status == DagsterRunStatus.FAILURE
            assert not instance.event_log_storage.get_concurrency_run_ids()  # the gpu slot is free

        second_id = str(uuid.uuid4())
        t0 = time.monotonic()
        second = _parent(workdir, home, second_id, tmp_path / "second.log")
        assert second.wait(300) == 0, (tmp_path / "second.log").read_text()[-3000:] + (
            workdir / "node-0.log"
        ).read_text()[-3000:]
        rerun_s = time.monotonic() - t0
    finally:
        census.stop()
    log = (workdir / "node-0.log").read_text()
    assert f"resumed from checkpoint {ckpts / f'step-{done_at_kill[-1]:08d}'} (step {done_at_kill[-1]} of 40)" in log, (
        log[-3000:]
    )
    assert (out / "summary.json").exists()
    assert census.samples > 20 and census.most == 1, (census.most, census.samples)
    print(
        f"\nmeasured: trainers gone {died_s:.2f} s after the parent's SIGKILL (checkpoint {done_at_kill[-1]}); "
        f"rerun resumed and finished in {rerun_s:.0f} s; at most {census.most} trainer alive over "
        f"{census.samples} samples"
    )
