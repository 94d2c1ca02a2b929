"""The processes of a run: how a process is named across hosts and PID namespaces, whether this process can
judge it, and finding and killing what a run left running (no dagster, no torch).

A process id means something only inside one PID namespace of one running kernel: containers that
share a host name (or a host) do not share their process ids. So a process is named by

* the kernel's boot id (``/proc/sys/kernel/random/boot_id``: the same in every container of a host,
  new after a reboot),
* its PID namespace's inode (``os.stat('/proc/self/ns/pid').st_ino``),
* its pid and its start time (a pid reused later is another process).

Only a process with the same boot id and PID namespace may look a pid up (:func:`can_judge`).

The trainers a run started are recorded as process groups (pgid + the leader's start time) and
carry the run id in their environment (``CAMPAIGN_RUN_ID``, ``training.trainer_guards``): torchrun starts
its workers in their own sessions, and a worker whose torchrun died is found by the run id alone.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from training.trainer_guards import RUN_ID_ENV

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
PID_NS_FILE = Path("/proc/self/ns/pid")
START_SLACK_S = 1.0  # process start times are rounded to clock ticks


def boot_id() -> str | None:
    try:
        return BOOT_ID_FILE.read_text().strip() or None
    except OSError:
        return None


def pid_namespace() -> str | None:
    try:
        return str(os.stat(PID_NS_FILE).st_ino)
    except OSError:
        return None


def identity() -> dict[str, str]:
    """``{"boot_id", "pid_ns"}`` of this process (keys missing where the platform has no such file)."""
    out = {"boot_id": boot_id(), "pid_ns": pid_namespace()}
    return {k: v for k, v in out.items() if v}


def can_judge(other: dict[str, str | None]) -> bool | None:
    """Whether a pid recorded with ``other``'s identity means the same process here: True when the boot id
    and PID namespace both match, False when either differs, None when ``other`` records neither (an old
    record: the caller falls back to the host name)."""
    if not other.get("boot_id") and not other.get("pid_ns"):
        return None
    mine = identity()
    return all(other.get(k) == mine.get(k) for k in ("boot_id", "pid_ns"))


def start_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def group_record(pgid: int, node: int) -> dict:
    """A trainer process group as the launcher records it (with this machine's identity)."""
    return {"pgid": pgid, "start": start_time(pgid), "node": node, **identity()}


def encode_groups(groups: list[dict]) -> str:
    return json.dumps(groups, separators=(",", ":"))


def decode_groups(text: str | None) -> list[dict]:
    try:
        groups = json.loads(text or "[]")
    except ValueError:
        return []
    return valid_groups(groups if isinstance(groups, list) else [])


def valid_groups(groups: list) -> list[dict]:
    """The records of ``groups`` that name a process group (a pgid)."""
    return [g for g in groups if isinstance(g, dict) and isinstance(g.get("pgid"), int)]


def run_processes(run_id: str, groups: list[dict]) -> list:
    """Live processes of this PID namespace that belong to ``run_id``: members of a recorded group whose leader
    (if still alive) is the recorded one, and any process whose environment carries the run id."""
    import psutil

    pgids = set()
    for g in groups:
        if can_judge(g) is False:
            continue
        leader = start_time(g["pgid"])
        if leader is not None and g.get("start") is not None and abs(leader - g["start"]) > START_SLACK_S:
            continue  # the pgid was reused by another process group
        pgids.add(g["pgid"])
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(p.pid) in pgids or p.environ().get(RUN_ID_ENV) == run_id:
                found.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError, OSError):
            continue
    return found


def kill_run_processes(
    run_id: str, groups: list[dict], log: Callable[[str], None] = print, timeout_s: float = 10.0
) -> list[int]:
    """SIGKILL every process of ``run_id`` (:func:`run_processes`) and wait until they are gone; the pids killed."""
    import psutil

    procs = run_processes(run_id, groups)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    deadline = time.monotonic() + timeout_s
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, deadline - time.monotonic()))
    if alive:
        log(f"run {run_id}: trainer process(es) {[p.pid for p in alive]} survived SIGKILL for {timeout_s:.0f} s")
    if procs:
        log(f"run {run_id}: killed its leftover trainer process(es) {sorted(p.pid for p in procs)}")
    return [p.pid for p in procs]
