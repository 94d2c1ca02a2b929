"""A run whose owner lived in another PID namespace (a container that died with its process ids) is judged by the
lease its ``campaign run`` renews (``assets/run_recovery.py``: ``hold_lease``): reaped once the lease expires, never
while it is renewed, and a run without a lease is still left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from dagster import DagsterInstance, DagsterRunStatus

from tests.support import REPO_ROOT
from tests.support.campaign_support import cli_env, instance_home

POOL = "gpu"
OTHER_NS = "4026599999"  # a PID namespace inode that is not this process's


@pytest.fixture
def instance(tmp_path, monkeypatch):
    home = instance_home(tmp_path / "dagster_home")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with DagsterInstance.get() as inst:
        inst.event_log_storage.set_concurrency_slots(POOL, 1)
        yield inst


def _tiny_job():
    from dagster import job, op

    @op
    def noop():
        pass

    @job
    def owned():
        noop()

    return owned


def _other_namespace_owner() -> dict[str, str]:
    """Owner tags of a `campaign run` in another PID namespace: its pid means nothing here."""
    from assets.run_recovery import owner_tags
    from resources import run_owner

    return run_owner.updated(owner_tags(pid=1, start=time.time() - 60), pid_ns=OTHER_NS)


def _old_style_other_namespace_owner() -> dict[str, str]:
    """The same, as the separate tags of a run recorded before ``campaign/owner``."""
    import socket

    return {
        "campaign/host": socket.gethostname(),
        "campaign/pid": "1",
        "campaign/start": f"{time.time() - 60:.3f}",
        "campaign/pid-ns": OTHER_NS,
    }


def _visible(tags: dict[str, str]) -> dict[str, str]:
    """Owner and lease tags under the visible names runs carried before they were hidden."""
    from assets.run_recovery import LEASE_TAG, VISIBLE_LEASE_TAG
    from resources import run_owner

    names = {run_owner.OWNER_TAG: run_owner.VISIBLE_OWNER_TAG, LEASE_TAG: VISIBLE_LEASE_TAG}
    return {names.get(k, k): v for k, v in tags.items()}


def test_another_namespaces_run_is_reaped_when_its_lease_expires(instance):
    from assets.run_recovery import lease_tags, reap_dead_runs

    new, old = _other_namespace_owner(), _old_style_other_namespace_owner()
    runs = {
        name: instance.create_run_for_job(_tiny_job(), tags=owner | extra, status=DagsterRunStatus.STARTED).run_id
        for name, owner, extra in [
            ("expired", new, lease_tags(ttl_s=-1)),
            ("held", new, lease_tags(ttl_s=60)),
            ("no lease", new, {}),
            ("old expired", old, lease_tags(ttl_s=-1)),
            ("old held", old, lease_tags(ttl_s=60)),
            ("visible expired", _visible(new), _visible(lease_tags(ttl_s=-1))),
            ("visible held", _visible(new), _visible(lease_tags(ttl_s=60))),
        ]
    }
    assert instance.event_log_storage.claim_concurrency_slot(POOL, runs["expired"], "noop").is_claimed
    said: list[str] = []
    reaped = [runs["expired"], runs["old expired"], runs["visible expired"]]
    assert sorted(reap_dead_runs(instance, log=said.append)) == sorted(reaped)
    assert all("stopped renewing its lease (expired " in m and "process 1 on " in m for m in said[-3:])
    assert instance.get_run_by_id(runs["expired"]).status == DagsterRunStatus.FAILURE
    assert not instance.event_log_storage.get_concurrency_run_ids()  # its pool slot is free
    assert {instance.get_run_by_id(runs[k]).status for k in ("held", "no lease", "old held", "visible held")} == {
        DagsterRunStatus.STARTED
    }


# the owner: creates its run as `campaign run` does (owner tags said to be of another PID namespace, a lease)
# and renews the lease every 0.2 s for 1.5 s leases, until it is killed
_OWNER = """
import json, sys, time
from dagster import DagsterInstance, DagsterRunStatus, job, op
from assets.run_recovery import hold_lease, lease_tags, owner_tags
from resources import run_owner

@op
def noop():
    pass

@job
def owned():
    noop()

inst = DagsterInstance.get()
run = inst.create_run_for_job(owned, status=DagsterRunStatus.STARTED,
                              tags=run_owner.updated(owner_tags(), pid_ns=sys.argv[1]) | lease_tags(1.5))
with hold_lease(inst, run.run_id, ttl_s=1.5, every_s=0.2):
    print(json.dumps(run.run_id), flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
def test_a_renewed_lease_keeps_the_run_and_its_owners_death_ends_it(instance):
    from assets.run_recovery import reap_dead_runs

    home = os.environ["DAGSTER_HOME"]
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, OTHER_NS], cwd=REPO_ROOT, env=cli_env(home), stdout=subprocess.PIPE, text=True
    )
    try:
        run_id = json.loads(owner.stdout.readline())
        time.sleep(3)  # twice the lease: only the renewals keep it
        assert reap_dead_runs(instance, log=lambda m: None) == []
        assert instance.get_run_by_id(run_id).status == DagsterRunStatus.STARTED
        owner.send_signal(signal.SIGKILL)  # the container dies: no cleanup, no last word
        owner.wait(10)
        time.sleep(2)  # the last lease runs out
        assert reap_dead_runs(instance, log=lambda m: None) == [run_id]
        assert instance.get_run_by_id(run_id).status == DagsterRunStatus.FAILURE
    finally:
        owner.kill()
        owner.wait(10)
