"""Crash-safe reruns: a `campaign run` that died never blocks another one.

Every run is a real `campaign run` process on a persistent instance (the shipped dagster.yaml:
pools with ``default_limit: 1``), on SQLite and on a real PostgreSQL server; the teacher is the
project's OpenAI-compatible test server in its own process, which counts every request per prompt.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from dagster import DagsterInstance, DagsterRunStatus, RunsFilter, build_sensor_context

from resources import run_owner
from tests.support.campaign_support import instance_home, openai_teacher, start_cli, write_campaign
from tests.support.testserver import ServerProcess

pytestmark = pytest.mark.slow

POOL = "teacher"


def _wait(pred, timeout: float, what: str, proc=None, log: Path | None = None, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"process exited ({proc.returncode}) while waiting for {what}:\n"
                + (log.read_text()[-3000:] if log else "")
            )
        time.sleep(every)
    raise AssertionError(
        f"timed out after {timeout} s waiting for {what}" + (f":\n{log.read_text()[-3000:]}" if log else "")
    )


def _instance(home: Path, monkeypatch) -> DagsterInstance:
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return DagsterInstance.get()


def _run_of(instance: DagsterInstance, campaign: str, statuses=None):
    runs = instance.get_runs(RunsFilter(tags={"campaign": campaign}, statuses=statuses))
    return runs[0] if runs else None


def _holders(instance: DagsterInstance) -> set[str]:
    info = instance.event_log_storage.get_concurrency_info(POOL)
    return {s.run_id for s in info.claimed_slots}


def _pending(instance: DagsterInstance) -> set[str]:
    return {p.run_id for p in instance.event_log_storage.get_concurrency_info(POOL).pending_steps}


def _failure_message(instance: DagsterInstance, run_id: str) -> str:
    from dagster import DagsterEventType

    recs = instance.get_records_for_run(run_id, of_type=DagsterEventType.RUN_FAILURE).records
    return " ".join(r.event_log_entry.dagster_event.message or "" for r in recs)


@pytest.fixture
def started():
    """Every `campaign run` process a test starts; whatever still runs at the end is killed."""
    procs: list = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@pytest.fixture(params=["sqlite", "postgres"])
def home(request, tmp_path):
    """A Dagster instance home with the shipped pools, on either storage a user runs."""
    if request.param == "sqlite":
        return instance_home(tmp_path / "dagster_home")
    db = request.getfixturevalue("pg_database")
    return instance_home(tmp_path / "dagster_home", db.dagster_storage_yaml())


def test_waiting_step_names_the_holder_sleeps_and_signals_cancel_it(
    home, tmp_path, artifact_root, monkeypatch, started
):
    """A holds the teacher slot; B waits for it: B's log names A's run, process and since when, and B
    does not spin. SIGTERM on a waiting run (C) cancels it within seconds. SIGKILL of A leaves its
    run STARTED with the slot held, until the daemon's reaper sensor fails it and frees the slot; B
    then gets it and runs; Ctrl-C (SIGINT) on B inside its step cancels it and frees the slot."""
    project = tmp_path / "project"
    with ServerProcess("--latency-ms", "700") as srv:  # slow: A's teacher stage lasts minutes
        paths = {
            n: write_campaign(project, n, openai_teacher(srv.base_url, max_concurrency=1), seed=s)
            for n, s in (("hold_a", 1), ("wait_b", 2), ("wait_c", 3))
        }
        logs = {n: tmp_path / f"{n}.log" for n in paths}
        procs = {}

        def start(n):
            procs[n] = start_cli(["run", str(paths[n]), "--artifacts", str(artifact_root)], project, home, logs[n])
            started.append(procs[n])

        start("hold_a")
        instance = _instance(home, monkeypatch)
        _wait(
            lambda: srv.stats(summary=True)["received"] >= 1,
            120,
            "A's first teacher request",
            procs["hold_a"],
            logs["hold_a"],
        )
        a = _run_of(instance, "hold_a")
        owner = json.loads(a.tags[run_owner.OWNER_TAG])
        assert _holders(instance) == {a.run_id} and owner["pid"] == procs["hold_a"].pid
        start("wait_b")
        start("wait_c")
        pat = re.compile(
            rf"waiting for a slot of pool .teacher. \(1 slot\(s\)\): held by run {a.run_id} step "
            rf"hold_a__teacher_generations \(STARTED, pid {procs['hold_a'].pid} on \S+\) since "
            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d"
        )
        for n in ("wait_b", "wait_c"):
            _wait(
                lambda n=n: pat.search(logs[n].read_text()), 120, f"{n}'s log line naming the holder", procs[n], logs[n]
            )

        # the waiter sleeps: under 10% of a core while it waits (the unpatched loop takes ~100%)
        pb = psutil.Process(procs["wait_b"].pid)
        c0, t0 = sum(pb.cpu_times()[:2]), time.monotonic()
        time.sleep(3)  # a measurement window (CPU used over 3 s), not a wait for some state
        waiting_cpu = (sum(pb.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
        assert waiting_cpu < 0.10, f"the waiting run uses {waiting_cpu:.0%} of a core"

        # SIGTERM while waiting: CANCELED, its pending claim withdrawn, within seconds
        c = _run_of(instance, "wait_c")
        t0 = time.monotonic()
        procs["wait_c"].send_signal(signal.SIGTERM)
        assert procs["wait_c"].wait(30) == 128 + signal.SIGTERM
        sigterm_waiting_s = time.monotonic() - t0
        assert instance.get_run_by_id(c.run_id).status == DagsterRunStatus.CANCELED
        assert c.run_id not in _pending(instance)
        assert "canceled by SIGTERM" in logs["wait_c"].read_text()

        # SIGKILL the holder: nothing frees its slot by itself ...
        procs["hold_a"].kill()
        procs["hold_a"].wait(10)  # dead: nothing else runs that could free the slot (no daemon in this test)
        assert instance.get_run_by_id(a.run_id).status == DagsterRunStatus.STARTED and _holders(instance) == {a.run_id}
        # ... until the reaper sensor (daemon, every 30 s) fails the dead run and frees it
        from assets.location import build_definitions

        sensor = build_definitions([str(paths["hold_a"])], artifact_root=str(artifact_root)).resolve_sensor_def(
            "reap_dead_campaign_runs"
        )
        received_before = srv.stats(summary=True)["received"]
        t0 = time.monotonic()
        tick = sensor.evaluate_tick(build_sensor_context(instance=instance))
        assert tick.skip_message == f"reaped 1 dead run(s): {a.run_id}"
        assert instance.get_run_by_id(a.run_id).status == DagsterRunStatus.FAILURE
        assert "that owned this run is gone (killed or crashed)" in _failure_message(instance, a.run_id)
        assert a.run_id not in _holders(instance) | _pending(instance)
        b = _run_of(instance, "wait_b")
        _wait(
            lambda: srv.stats(summary=True)["received"] > received_before,
            60,
            "B's first teacher request",
            procs["wait_b"],
            logs["wait_b"],
        )
        b_started_after_reap_s = time.monotonic() - t0
        assert _holders(instance) == {b.run_id}

        # Ctrl-C inside the step: CANCELED (not "interrupted unexpectedly"), slot freed, within seconds
        t0 = time.monotonic()
        procs["wait_b"].send_signal(signal.SIGINT)
        assert procs["wait_b"].wait(30) == 128 + signal.SIGINT
        sigint_running_s = time.monotonic() - t0
        assert instance.get_run_by_id(b.run_id).status == DagsterRunStatus.CANCELED
        assert not _holders(instance) and not _pending(instance)
        instance.dispose()
    print(
        f"\nmeasured: waiting run {waiting_cpu:.1%} of a core; SIGTERM while waiting -> CANCELED in "
        f"{sigterm_waiting_s:.1f} s; waiter running {b_started_after_reap_s:.1f} s after the reap; SIGINT in a step "
        f"-> CANCELED in {sigint_running_s:.1f} s"
    )
    # The bound on both is the wait(30) above: what it tells apart is a signal handled (CANCELED, exit 128 + the
    # signal, seconds) from one ignored or left to a timeout (the run waits for its pool slot or step forever); a
    # tighter figure here measured the host's load, not the handler (printed above, not asserted).


def test_sigkill_mid_teacher_then_rerun_resumes_and_finishes(tmp_path, artifact_root, monkeypatch, started):
    """`campaign run` SIGKILLed while the teacher answers, then `campaign run` again on the same
    instance: the rerun frees the dead run's slot, resumes from what the cache kept and finishes; no
    prompt was asked twice beyond those in flight at the kill."""
    project, home = tmp_path / "project", instance_home(tmp_path / "dagster_home")
    concurrency = 4
    with ServerProcess("--latency-ms", "150") as srv:
        path = write_campaign(project, "crashy", openai_teacher(srv.base_url, max_concurrency=concurrency), prompts=160)
        args = ["run", str(path), "--artifacts", str(artifact_root)]
        first = start_cli(args, project, home, tmp_path / "first.log")
        started.append(first)
        _wait(
            lambda: srv.stats(summary=True)["ok"] >= 40,
            120,
            "40 answered teacher requests",
            first,
            tmp_path / "first.log",
            every=0.05,
        )
        first.kill()
        first.wait(10)
        at_kill = srv.stats(summary=True)
        instance = _instance(home, monkeypatch)
        dead = _run_of(instance, "crashy")
        assert dead.status == DagsterRunStatus.STARTED and _holders(instance) == {dead.run_id}
        _wait(
            lambda: srv.stats(summary=True)["in_flight"] == 0,
            30,
            "the requests in flight at the kill to finish server-side",
            every=0.05,
        )
        train_prompts = len(srv.stats()["received_by_prompt"])

        t0 = time.monotonic()
        second = start_cli(args, project, home, tmp_path / "second.log")
        started.append(second)
        rc = second.wait(300)  # before the fix it waits for the dead run's slot forever
        rerun_s = time.monotonic() - t0
        out = (tmp_path / "second.log").read_text()
        assert rc in (0, 3), out[-4000:]  # finished: promoted (0) or blocked by the gate (3) after 2 steps
        stats = srv.stats()
    assert f"run {dead.run_id} (crashy_campaign): the `campaign run` process {first.pid}" in out
    assert "recovered" in out or "in the cache" in out
    assert instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.FAILURE
    rerun = _run_of(instance, "crashy", statuses=[DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE])
    assert rerun.run_id != dead.run_id and json.loads(rerun.tags[run_owner.OWNER_TAG])["pid"] == second.pid
    assert not instance.event_log_storage.get_concurrency_run_ids()
    asked = stats["received_by_prompt"]
    twice = sorted(p for p, n in asked.items() if n > 1)
    assert len(twice) <= concurrency, twice  # only the requests in flight at the kill are asked again
    assert at_kill["ok"] >= 40 and len(asked) >= train_prompts
    instance.dispose()
    print(
        f"\nmeasured: killed after {at_kill['ok']} answers; rerun finished in {rerun_s:.0f} s; "
        f"{len(twice)} prompt(s) asked twice (in flight at the kill, at most {concurrency})"
    )
