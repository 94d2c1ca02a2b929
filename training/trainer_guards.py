"""What a trainer process takes on itself so that a run owns it: it dies with its launcher, and one job at a
time writes an output directory.

* ``parent_death_preexec``: the local launcher starts torchrun with it, so the kernel sends SIGKILL to
  torchrun when the ``campaign run`` process that started it dies (SIGKILL, OOM killer, closed SSH
  session), not only when it exits cleanly.
* ``die_with_launcher``: torchrun starts its workers in their own sessions, so killing torchrun does
  not reach them; each trainer sets the same parent-death signal on itself (only when the launcher
  asked for it, ``CAMPAIGN_DIE_WITH_PARENT=1``) and exits when its torchrun is already gone.
* ``OutputDirLock``: ``fcntl.flock`` on one lock file per global rank (``<output_dir>/trainer.lock`` for
  rank 0, ``trainer.rank-<N>.lock`` for rank N) while a job writes the directory, with the holder written
  into the file. Every rank takes its own before the process group forms (``training/recipes/lora_finetune.py``,
  ``LoraFinetuneRecipe.setup``), so each rank of a second job on the same directory is refused at once, naming
  the holder, instead of joining a rendezvous its peers never reach and waiting out the collective
  timeout. The kernel releases the lock when the holder dies, however it dies.

Every trainer process also carries ``CAMPAIGN_RUN_ID`` in its environment: the stale-run reaper
(``assets/run_recovery.py``) finds a dead run's leftover processes by it.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1
DIE_WITH_PARENT_ENV = "CAMPAIGN_DIE_WITH_PARENT"
RUN_ID_ENV = "CAMPAIGN_RUN_ID"
LOCK_NAME = "trainer.lock"


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux); False elsewhere."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def parent_death_preexec(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the calling process dies,
    and exits at once if it is already gone. Resolved before the fork: the child only calls into libc.
    None where the platform has no ``prctl`` (the reaper's kill by run id remains)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(128 + int(sig))

    return preexec


def die_with_launcher() -> None:
    """In a trainer started by the local launcher (``CAMPAIGN_DIE_WITH_PARENT=1``): SIGKILL when the
    parent torchrun dies; exit now if it died already (the parent is no longer a process of this run)."""
    if os.environ.get(DIE_WITH_PARENT_ENV) != "1":
        return
    set_parent_death_signal(signal.SIGKILL)
    run_id = os.environ.get(RUN_ID_ENV)
    try:
        import psutil

        parent_run = psutil.Process(os.getppid()).environ().get(RUN_ID_ENV)
    except Exception:  # noqa: BLE001 - gone, or not readable: judge by the run id we cannot see
        parent_run = None
    if run_id and parent_run != run_id:
        print(
            f"training: the torchrun of run {run_id} that started this trainer is gone (parent is now pid "
            f"{os.getppid()}); exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)


def lock_name(rank: int) -> str:
    """The lock file of global rank ``rank`` inside an output directory."""
    return LOCK_NAME if rank == 0 else f"trainer.rank-{rank}.lock"


class OutputDirLocked(RuntimeError):
    """Another live trainer holds the output directory."""


class OutputDirLock:
    """Exclusive ``flock`` on global rank ``rank``'s lock file of ``output_dir`` for as long as this object is open
    (the ranks of one job hold one file each; the same rank of another job on the directory is refused)."""

    def __init__(self, output_dir: str | Path, rank: int = 0):
        self.path = Path(output_dir) / lock_name(rank)
        self.rank = rank
        self._fd: int | None = None

    def acquire(self) -> OutputDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            try:
                h = json.loads(holder)
                who = (
                    f"pid {h.get('pid')} on {h.get('host')} (run {h.get('run_id')}, started "
                    f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(h.get('start', 0)))})"
                )
            except (ValueError, AttributeError):
                who = holder or "an unknown process"
            raise OutputDirLocked(
                f"output directory {self.path.parent} is being written by another trainer: {who} holds {self.path} "
                f"(rank {self.rank}). "
                "Two trainers must not write one output directory: wait for it to finish, or stop that process "
                "(`campaign run` reaps the trainers of a dead run) and launch again"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "run_id": os.environ.get(RUN_ID_ENV),
            "rank": self.rank,
            "start": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> OutputDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
