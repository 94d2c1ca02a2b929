"""Runs whose process died: find them, mark them failed, free their pool slots.

``campaign run`` executes a campaign's job in its own process (``execute_in_process``), where
Dagster's run monitoring never looks: a run launcher would check its worker's health, but an
in-process run has none. A ``campaign run`` killed by SIGKILL (the OOM killer, a closed laptop, a
preempted node) leaves its run ``STARTED`` and keeps the pool slot its step held (``teacher``,
``gpu``; ``default_limit: 1`` in the shipped ``dagster.yaml``) for good, and every later run of
every campaign waits for it forever. A waiter killed while queued blocks the pool the same way:
when the slot is freed it is assigned to the oldest pending step, the dead one.

So every run ``campaign run`` starts carries its owner in one tag, hidden from the UI (``.dagster/campaign-owner``,
compact JSON, ``resources/run_owner.py``; :func:`owner_tags`): host, pid, start time, and where the process runs: the
kernel's boot id and its PID namespace's inode (runs recorded before carry the same facts as ``campaign/owner`` or as
separate tags: :func:`_owner` reads them all). :func:`reap_dead_runs` finds the runs it can judge (same boot id and PID
namespace as the reaper; runs recorded before these two existed: same host name) that are not finished but whose
process is gone (or is another process that reused the pid: one created after the run started). Before anything
is freed it kills what the dead run left running: its trainer processes (the process groups the local launcher
added to the owner record, and any process carrying the run id in ``CAMPAIGN_RUN_ID``) and its Kubernetes Jobs,
Services and PyTorchJobs (by their ``dagster/run-id`` label, in the cluster the owner record names). Then it marks
the run FAILURE with the reason (CANCELED when it was already canceling) and frees its slots with
``free_concurrency_slots_for_run`` (``report_run_failed`` alone frees nothing); it also frees slots still held by
runs that finished by any other path (a force-cancel in the UI). A run whose leftovers could not be removed (the
cluster unreachable) keeps its slot until a later reap succeeds. It runs

* before every ``campaign run`` (``campaign_app/cli/run.py``),
* while a step waits for a slot (``assets/dagster_patches.py``: the wait logs who holds the pool and
  since when, every minute, and reaps a dead holder),
* in the daemon, as the sensor ``reap_dead_campaign_runs`` (:func:`reaper_sensor`, on by default:
  ``dagster dev`` / ``make ui`` runs it every 30 s).

A run of another machine or container (another boot id or PID namespace; for old runs, another host
name) cannot be judged by its pid: a process id means nothing there. It is judged by its lease instead:
while ``campaign run`` lives it renews the hidden tag ``.dagster/campaign-lease-until`` (:func:`hold_lease`: a
heartbeat thread, every ``LEASE_RENEW_S``, the tag set ``LEASE_S`` ahead; ``campaign/lease-until`` on older runs),
so a run whose owner died with its container (and whose PID namespace went with it) is reaped once its lease has
expired; a live one never is, wherever it runs. A lease judges by wall-clock time across machines: ``LEASE_S`` is
far above any clock skew between hosts that share an instance. Runs without these tags (launched from the UI, by a
schedule or a sensor) are Dagster's own: its run launcher and run monitoring look after them.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dagster import (
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunsFilter,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from resources import run_owner
from training import run_processes

OWNER_TAG = run_owner.OWNER_TAG  # who owns the run and what it started (resources/run_owner.py)
NOT_FINISHED = [
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
]
FINISHED = [DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]
SENSOR_NAME = "reap_dead_campaign_runs"
SENSOR_INTERVAL_S = 30
PID_REUSE_SLACK_S = 1.0  # process start times are rounded by the kernel (clock ticks)
# unix time until which the owner vouches for the run (hold_lease renews it); hidden, as the owner tag
LEASE_TAG = f"{run_owner.HIDDEN}campaign-lease-until"
VISIBLE_LEASE_TAG = "campaign/lease-until"  # the same, on runs recorded before it was hidden (read, never written)
LEASE_S = 300.0  # a lease lasts this long unrenewed: ten renewals may fail (a busy storage) before a reap
LEASE_RENEW_S = 30.0


def lease_tags(ttl_s: float = LEASE_S, now: float | None = None) -> dict[str, str]:
    """The lease tag: the owner vouches for the run until ``ttl_s`` from now."""
    return {LEASE_TAG: f"{(time.time() if now is None else now) + ttl_s:.3f}"}


def lease_alive(run, now: float | None = None) -> bool | None:
    """Whether the run's lease still holds: None when it has none (a run tagged before leases, or not a
    ``campaign run`` run)."""
    until = lease_until(run)
    return None if until is None else (time.time() if now is None else now) <= until


def lease_until(run) -> float | None:
    """The unix time the run's lease runs to (None: none)."""
    try:
        return float(run.tags.get(LEASE_TAG, run.tags.get(VISIBLE_LEASE_TAG)))
    except (TypeError, ValueError):
        return None


@contextmanager
def hold_lease(
    instance: DagsterInstance,
    run_id: str,
    ttl_s: float = LEASE_S,
    every_s: float = LEASE_RENEW_S,
    log: Callable[[str], None] = print,
) -> Iterator[None]:
    """Renew ``run_id``'s lease every ``every_s`` from a daemon thread while the block runs (a run not created yet
    is skipped until it is). When this process dies, however it dies, the renewals stop and the lease expires."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(every_s):
            try:
                if instance.get_run_by_id(run_id) is not None:
                    instance.add_run_tags(run_id, lease_tags(ttl_s))
            except Exception as e:  # noqa: BLE001 - a storage hiccup: the next renewal tries again
                log(f"run {run_id}: could not renew its lease ({type(e).__name__}: {e})")

    thread = threading.Thread(target=renew, name=f"lease-{run_id[:8]}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def owner_tags(pid: int | None = None, start: float | None = None) -> dict[str, str]:
    """The tag naming the process that owns a run (this one by default), and the kernel boot and PID namespace
    its pid means something in."""
    return run_owner.encode(
        {
            "host": socket.gethostname(),
            "pid": os.getpid() if pid is None else pid,
            "start": round(time.time() if start is None else start, 3),
            **run_processes.identity(),
        }
    )


def _owner(run) -> dict:
    """The run's owner record (``resources/run_owner.py``: its hidden owner tag, or the tags of a run recorded
    before it); no ``pid`` when no ``campaign run`` owns the run."""
    return run_owner.read(run.tags)


def can_judge(run) -> bool:
    """Whether this process may look the run's owner pid up: same boot id and PID namespace; for a run tagged
    before those were recorded, the same host name."""
    owner = _owner(run)
    if "pid" not in owner:
        return False
    same = run_processes.can_judge({"boot_id": owner.get("boot_id"), "pid_ns": owner.get("pid_ns")})
    return same if same is not None else owner.get("host") == socket.gethostname()


def owner_alive(run) -> bool | None:
    """Whether the process that owns ``run`` is alive: by its pid where this process can judge it, by its lease
    otherwise (the run of another machine, container or PID namespace); None when neither tells (no owner
    tags, or another namespace's run without a lease)."""
    import psutil

    owner = _owner(run)
    if not can_judge(run):
        return lease_alive(run) if "pid" in owner else None
    try:
        p = psutil.Process(int(owner["pid"]))
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        created = p.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except (psutil.AccessDenied, ValueError):
        return None
    try:
        started = float(owner.get("start", "inf"))
    except (TypeError, ValueError):
        return True
    return created <= started + PID_REUSE_SLACK_S  # a process created after the run started reused the pid


def _pool_run_ids(instance: DagsterInstance, pool: str) -> set[str]:
    info = instance.event_log_storage.get_concurrency_info(pool)
    return {s.run_id for s in info.claimed_slots} | {p.run_id for p in info.pending_steps}


def reap_dead_runs(instance: DagsterInstance, log: Callable[[str], None] = print, pool: str | None = None) -> list[str]:
    """Mark this host's unfinished campaign runs whose process is gone as failed and free their pool
    slots; free the slots finished runs still hold. ``pool``: only runs holding or awaiting a slot of
    that pool. Returns the reaped run ids; says what it did through ``log``."""
    storage = instance.event_log_storage
    runs = instance.get_runs(RunsFilter(statuses=NOT_FINISHED))
    if pool is not None:
        ids = _pool_run_ids(instance, pool)
        runs = [r for r in runs if r.run_id in ids]
    reaped = []
    for run in runs:
        if owner_alive(run) is not False:
            continue
        if not remove_leftovers(run, log):
            continue
        gone = (
            "is gone (killed or crashed)"
            if can_judge(run)
            else f"stopped renewing its lease (expired {_iso_ts(lease_until(run))}: its container or machine died)"
        )
        owner = _owner(run)
        msg = (
            f"the `campaign run` process {owner['pid']} on {owner.get('host', '?')} that owned this run {gone}: "
            "marked "
            + ("canceled" if run.status == DagsterRunStatus.CANCELING else "failed")
            + " and its pool slots freed"
        )
        if run.status == DagsterRunStatus.CANCELING:
            instance.report_run_canceled(run, message=msg)
        else:
            instance.report_run_failed(run, message=msg)
        if storage.supports_global_concurrency_limits:
            storage.free_concurrency_slots_for_run(run.run_id)
        log(f"run {run.run_id} ({run.job_name}): {msg}")
        reaped.append(run.run_id)
    if storage.supports_global_concurrency_limits:
        holding = storage.get_concurrency_run_ids()
        if pool is not None:
            holding &= _pool_run_ids(instance, pool)
        if holding:
            for rec in instance.get_run_records(RunsFilter(run_ids=sorted(holding), statuses=FINISHED)):
                storage.free_concurrency_slots_for_run(rec.dagster_run.run_id)
                log(
                    f"freed the pool slots still held by finished run {rec.dagster_run.run_id} "
                    f"({rec.dagster_run.status.value})"
                )
    return reaped


def remove_leftovers(run, log: Callable[[str], None] = print) -> bool:
    """Kill what the dead ``run`` left running: its local trainer processes and its Kubernetes workloads. False when
    something could not be removed (the run's slots must stay held: a rerun would train beside it)."""
    owner = _owner(run)
    groups = owner["trainers"]
    killed = run_processes.kill_run_processes(run.run_id, groups, log=log)
    if killed and run_processes.run_processes(run.run_id, groups):
        log(f"run {run.run_id}: trainer processes still alive after SIGKILL; its pool slots stay held")
        return False
    if owner.get("k8s"):
        try:
            from resources.k8s.launcher import delete_run_workloads

            deleted = delete_run_workloads(owner["k8s"], run.run_id)
        except Exception as e:  # noqa: BLE001 - the cluster unreachable, no permission: retry on a later reap
            log(
                f"run {run.run_id}: could not delete its Kubernetes workloads ({type(e).__name__}: {e}); its pool "
                f"slots stay held until they are deleted (the next `campaign run` or reaper tick tries again)"
            )
            return False
        if deleted:
            log(f"run {run.run_id}: deleted its Kubernetes workloads {', '.join(deleted)}")
    return True


def _iso_ts(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def _iso(ts) -> str:
    return ts.isoformat(timespec="seconds") if ts is not None else "?"


def describe_holders(instance: DagsterInstance, pool: str) -> str:
    """Who holds ``pool``, as one sentence: each holder's run, step, status, owner process and since
    when, then the steps waiting for it. A step the slot was assigned to but that has not claimed it
    yet holds it too (a waiter that died at that moment blocks the pool)."""
    info = instance.event_log_storage.get_concurrency_info(pool)
    claimed = {(s.run_id, s.step_key) for s in info.claimed_slots}
    since = {(p.run_id, p.step_key): p.assigned_timestamp for p in info.pending_steps}
    holders = [(k, "held") for k in sorted(claimed)] + [
        ((p.run_id, p.step_key), "assigned (not yet claimed)")
        for p in info.pending_steps
        if p.assigned_timestamp is not None and (p.run_id, p.step_key) not in claimed
    ]
    parts = []
    for (run_id, step_key), how in holders:
        run = instance.get_run_by_id(run_id)
        who = _owner(run) if run is not None else {}
        owner = f"pid {who['pid']} on {who.get('host', '?')}" if "pid" in who else "not a `campaign run` process"
        status = run.status.value if run is not None else "unknown run"
        parts.append(
            f"{how} by run {run_id} step {step_key} ({status}, {owner}) since {_iso(since.get((run_id, step_key)))}"
        )
    waiting = [p for p in info.pending_steps if p.assigned_timestamp is None]
    if waiting:
        parts.append(
            "waiting: "
            + ", ".join(f"run {p.run_id} step {p.step_key} since {_iso(p.enqueued_timestamp)}" for p in waiting)
        )
    return f"pool {pool!r} ({info.limit} slot(s)): " + ("; ".join(parts) or "no holder recorded")


def reaper_sensor():
    """The daemon's reaper: every 30 s, the dead ``campaign run`` runs of this host are failed and
    their slots freed (the tick history says which)."""

    @sensor(
        name=SENSOR_NAME,
        minimum_interval_seconds=SENSOR_INTERVAL_S,
        default_status=DefaultSensorStatus.RUNNING,
        description="Marks runs whose `campaign run` process is gone (SIGKILL, OOM, a closed laptop) as failed "
        "and frees the pool slots they hold, so no later run waits for them.",
    )
    def reap_dead_campaign_runs(context: SensorEvaluationContext):
        reaped = reap_dead_runs(context.instance, log=context.log.warning)
        return SkipReason(
            f"reaped {len(reaped)} dead run(s): {', '.join(reaped)}" if reaped else "no dead `campaign run` runs"
        )

    return reap_dead_campaign_runs
