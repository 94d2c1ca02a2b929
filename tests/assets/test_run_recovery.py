"""The stale-run reaper judges only the runs it can see (same kernel boot, same PID namespace), kills a dead run's
trainers before it frees the run's pool slot, and one trainer at a time writes an output directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dagster import DagsterInstance, DagsterRunStatus

from tests.support import REPO_ROOT
from tests.support.campaign_support import cli_env, instance_home
from tests.support.processes import sleeping_node

POOL = "gpu"


@pytest.fixture
def instance(tmp_path, monkeypatch):
    home = instance_home(tmp_path / "dagster_home")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with DagsterInstance.get() as inst:
        inst.event_log_storage.set_concurrency_slots(POOL, 1)
        yield inst


def _started_run(instance: DagsterInstance, tags: dict[str, str], claim: bool = True) -> str:
    from dagster import job, op

    @op
    def noop():
        pass

    @job
    def owned():
        noop()

    run = instance.create_run_for_job(owned, tags=tags, status=DagsterRunStatus.STARTED)
    assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.STARTED
    if claim:
        assert instance.event_log_storage.claim_concurrency_slot(POOL, run.run_id, "noop").is_claimed
    return run.run_id


def _dead_pid() -> tuple[int, float]:
    """A process that has exited: its pid and start time."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    import psutil

    start = psutil.Process(p.pid).create_time()
    p.wait()
    return p.pid, start


def _dead_owner_tags() -> dict[str, str]:
    from assets.run_recovery import owner_tags

    return owner_tags(*_dead_pid())


def _legacy_tags(pid: int, start: float, **where: str) -> dict[str, str]:
    """The separate owner tags `campaign run` wrote before ``campaign/owner`` (the format of runs recorded then)."""
    import socket

    names = {"boot_id": "campaign/boot-id", "pid_ns": "campaign/pid-ns", "trainers": "campaign/trainers"}
    return {
        "campaign/host": socket.gethostname(),
        "campaign/pid": str(pid),
        "campaign/start": f"{start:.3f}",
        **{names[k]: v for k, v in where.items()},
    }


def _ctx(instance: DagsterInstance, run_id: str):
    """What the launchers' recorders use of an asset's context."""
    from types import SimpleNamespace

    return SimpleNamespace(instance=instance, run_id=run_id, log=SimpleNamespace(debug=print))


def test_output_dir_lock_refuses_a_second_trainer_and_names_the_holder(tmp_path):
    from training.trainer_guards import OutputDirLock, OutputDirLocked

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from training.trainer_guards import OutputDirLock; "
            f"OutputDirLock({str(tmp_path)!r}).acquire(); print('ready', flush=True); time.sleep(60)",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "CAMPAIGN_RUN_ID": "run-holding"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(OutputDirLocked) as e:
            OutputDirLock(tmp_path).acquire()
        msg = str(e.value)
        assert f"output directory {tmp_path} is being written by another trainer: pid {holder.pid} on " in msg
        assert "(run run-holding, started 20" in msg and str(tmp_path / "trainer.lock") in msg
        holder.kill()  # however the holder dies, the kernel drops its lock
        holder.wait(10)
        with OutputDirLock(tmp_path) as lock:
            assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait(10)


def test_reaper_kills_a_dead_runs_trainers_before_freeing_its_slot(instance, tmp_path):
    """The owner is gone; its torchrun stand-in (a recorded process group) and a worker in its own session (found by
    the run id in its environment) still run: the reaper SIGKILLs both, then fails the run and frees the slot."""
    from assets.run_recovery import reap_dead_runs
    from resources.local_launcher import record_trainers

    run_id = _started_run(instance, _dead_owner_tags())
    torchrun = sleeping_node(tmp_path / "torchrun.log")
    env = {**os.environ, "CAMPAIGN_RUN_ID": run_id}
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    bystander = sleeping_node(tmp_path / "bystander.log")  # another run's trainer: left alone
    try:
        assert worker.stdout.readline().strip() == "ready"
        record_trainers(_ctx(instance, run_id), [torchrun])  # as the local launcher records them
        said: list[str] = []
        assert reap_dead_runs(instance, log=said.append) == [run_id]
        torchrun.wait(10), worker.wait(10)  # gone (TimeoutExpired otherwise: both would sleep for a minute)
        assert bystander.poll() is None
        kill = next(i for i, m in enumerate(said) if "killed its leftover trainer process(es)" in m)
        freed = next(i for i, m in enumerate(said) if "marked failed and its pool slots freed" in m)
        assert kill < freed and str(torchrun.pid) in said[kill] and str(worker.pid) in said[kill]
        assert instance.get_run_by_id(run_id).status == DagsterRunStatus.FAILURE
        assert not instance.event_log_storage.get_concurrency_run_ids()
    finally:
        for p in (torchrun, worker, bystander):
            p.kill()
            p.wait(10)


def test_old_runs_tagged_with_host_and_pid_only_are_still_judged(instance):
    from assets.run_recovery import reap_dead_runs

    run_id = _started_run(instance, _legacy_tags(*_dead_pid()))
    assert reap_dead_runs(instance, log=lambda m: None) == [run_id]


def test_a_run_shows_one_ownership_tag_holding_its_owner_trainers_and_cluster(instance, tmp_path):
    """`campaign run`'s owner, the local launcher's trainers and the Kubernetes launcher's cluster all land in one
    compact tag; the lease (rewritten every renewal) is the only other internal tag. Both are Dagster hidden tags:
    the UI and its GraphQL never show them, so the runs list leads with the tags people read."""
    from dagster._core.storage.tags import TagType, get_tag_type

    from assets.run_recovery import LEASE_TAG, lease_tags, owner_tags
    from resources.k8s.launcher import K8sTrainingLauncher
    from resources.local_launcher import record_trainers
    from resources.run_owner import OWNER_TAG

    run_id = _started_run(instance, owner_tags() | lease_tags(), claim=False)
    trainer = sleeping_node(tmp_path / "torchrun.log")
    try:
        record_trainers(_ctx(instance, run_id), [trainer])
        record_trainers(_ctx(instance, run_id), [trainer])  # a second launch of the run adds its groups
        K8sTrainingLauncher(kubeconfig_file="/nowhere")._record_cluster(_ctx(instance, run_id), "team-a")
    finally:
        trainer.kill()
        trainer.wait(10)
    tags = instance.get_run_by_id(run_id).tags
    assert {k for k in tags if "campaign" in k} == {OWNER_TAG, LEASE_TAG}, tags
    assert {get_tag_type(k) for k in (OWNER_TAG, LEASE_TAG)} == {TagType.HIDDEN}  # a Dagster upgrade must keep this
    owner = json.loads(tags[OWNER_TAG])
    assert owner["pid"] == os.getpid() and owner["pid_ns"] == str(os.stat("/proc/self/ns/pid").st_ino)
    assert [g["pgid"] for g in owner["trainers"]] == [trainer.pid, trainer.pid]
    assert owner["k8s"] == {
        "namespace": "team-a",
        "kubeconfig_file": "/nowhere",
        "kube_context": None,
        "in_cluster": None,
    }


def test_an_old_style_run_is_still_judged_and_its_trainers_killed(instance, tmp_path):
    """Runs recorded before the owner tag (separate host, pid, start, boot-id, pid-ns, trainers tags) are judged
    as before an upgrade: dead and of this namespace, reaped with its trainers; alive, or of another namespace, kept."""
    from assets.run_recovery import can_judge, reap_dead_runs
    from training import run_processes

    ident = run_processes.identity()
    trainer = sleeping_node(tmp_path / "torchrun.log")
    try:
        groups = run_processes.encode_groups([run_processes.group_record(trainer.pid, 0)])
        dead = _started_run(instance, _legacy_tags(*_dead_pid(), **ident, trainers=groups))
        live = _started_run(instance, _legacy_tags(os.getpid(), time.time(), **ident), claim=False)
        other_ns = _started_run(
            instance, _legacy_tags(*_dead_pid(), boot_id=ident["boot_id"], pid_ns="4026599999"), claim=False
        )
        assert [can_judge(instance.get_run_by_id(r)) for r in (dead, live, other_ns)] == [True, True, False]
        assert reap_dead_runs(instance, log=lambda m: None) == [dead]
        trainer.wait(10)  # killed from the old tag's record (TimeoutExpired otherwise: it sleeps for a minute)
        assert {instance.get_run_by_id(r).status for r in (live, other_ns)} == {DagsterRunStatus.STARTED}
        assert not instance.event_log_storage.get_concurrency_run_ids()
    finally:
        trainer.kill()
        trainer.wait(10)


_OWNER = (
    "import time; from assets.run_recovery import owner_tags; from resources.run_owner import OWNER_TAG; "
    "print(owner_tags()[OWNER_TAG], flush=True); time.sleep(120)"
)
_REAPER = (
    "import json; from dagster import DagsterInstance; from assets.run_recovery import reap_dead_runs; "
    "inst = DagsterInstance.get(); print('REAPED ' + json.dumps(reap_dead_runs(inst, log=lambda m: None)))"
)


def _container(code: str, home: Path, **kw) -> subprocess.Popen:
    """A process in a PID namespace of its own, with its own /proc (a container sharing the host name)."""
    return subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=cli_env(home),
        stdout=subprocess.PIPE,
        text=True,
        **kw,
    )


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_containers_on_one_storage_never_reap_each_others_live_runs(instance, tmp_path):
    """Container A (its own PID namespace) owns a live run; container B (another PID namespace, same host name, same
    instance storage) reaps: A's run stays. With only the old host + pid tags, B judges A's pid in its own namespace
    (pid 1 there is B itself, started after A's run) and fails the live run: the bug this fixes."""
    from resources import run_owner

    if not _unshare_works():
        pytest.skip("no `unshare --pid` here (not root, or no user namespaces): see the simulated-namespace test")
    home = Path(os.environ["DAGSTER_HOME"])
    a = _container(_OWNER, home)
    try:
        owner = json.loads(a.stdout.readline())
        assert owner["pid"] == 1 and owner["pid_ns"] != str(os.stat("/proc/self/ns/pid").st_ino)
        owner["start"] -= 60  # a run a minute old: B started later
        live = _started_run(instance, run_owner.encode(owner))
        legacy = _started_run(instance, _legacy_tags(1, owner["start"]), claim=False)
        out = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _REAPER],
            cwd=REPO_ROOT,
            env=cli_env(home),
            capture_output=True,
            text=True,
            timeout=120,
        )
        reaped = json.loads(out.stdout.split("REAPED ", 1)[1]) if "REAPED " in out.stdout else out.stderr[-3000:]
        assert a.poll() is None
        assert reaped == [legacy], reaped  # the old tags are misjudged across namespaces; the new ones are not
        assert instance.get_run_by_id(live).status == DagsterRunStatus.STARTED
        assert instance.event_log_storage.get_concurrency_run_ids() == {live}
    finally:
        a.kill()
        a.wait(10)


def test_a_run_of_another_pid_namespace_is_not_judged_by_pid(instance, monkeypatch):
    """The same, simulated (where ``unshare`` is not allowed): a dead pid recorded in another PID namespace (or under
    another kernel boot) means nothing here, so the run is left alone; the same tags from this namespace are reaped."""
    from assets.run_recovery import reap_dead_runs
    from resources import run_owner

    dead = _dead_owner_tags()
    other_ns = _started_run(instance, run_owner.updated(dead, pid_ns="4026599999"))
    other_boot = _started_run(
        instance, run_owner.updated(dead, boot_id="00000000-0000-0000-0000-000000000000"), claim=False
    )
    mine = _started_run(instance, dead, claim=False)
    assert reap_dead_runs(instance, log=lambda m: None) == [mine]
    assert {instance.get_run_by_id(r).status for r in (other_ns, other_boot)} == {DagsterRunStatus.STARTED}
