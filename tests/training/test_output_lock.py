"""Every rank of a training job takes its output-directory lock before the process group forms
(``training/trainer_guards.py``): a second job on the same directory has each of its ranks refused at once,
with the holder named, instead of waiting in a rendezvous its peers never reach until the collective timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.support.train_support import child_env, make_job
from training.net import free_port


def _rank1(job_file, port: int, run_id: str) -> dict[str, str]:
    """Rank 1 of a 2-process job whose rank 0 never comes (nobody listens on ``port``)."""
    return child_env() | {
        "RANK": "1",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "CAMPAIGN_RUN_ID": run_id,
    }


@pytest.mark.slow
def test_a_second_jobs_rank_is_refused_with_the_holder_before_the_process_group(tmp_path):
    out = tmp_path / "out"
    job = make_job(out, tmp_path / "base", tmp_path / "data", collective_timeout_s=3600)
    cfg = job.write(tmp_path / "job.json")
    cmd = [sys.executable, "-m", "training", "--config", str(cfg)]
    first = subprocess.Popen(
        cmd,
        env=_rank1(cfg, free_port(), "job-a"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # the first job's rank 1 holds its lock while it waits for its rank 0 in the rendezvous
        deadline, held = time.monotonic() + 90, None
        while held is None and time.monotonic() < deadline and first.poll() is None:
            held = next((f for f in out.glob("trainer*.lock") if f'"pid": {first.pid}' in f.read_text()), None)
            time.sleep(0.2)
        assert held is not None, "the first job's rank 1 took no output-directory lock before its rendezvous"
        assert json.loads(held.read_text())["rank"] == 1

        # a rank refused before its process group returns; one that joined the rendezvous would wait for its rank 0
        # until the collective timeout (an hour) and meet this timeout instead
        second = subprocess.run(cmd, env=_rank1(cfg, free_port(), "job-b"), capture_output=True, text=True, timeout=600)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"is being written by another trainer: pid {first.pid} on " in second.stderr
    assert "(run job-a, started" in second.stderr and "(rank 1)" in second.stderr
