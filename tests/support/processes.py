"""Stand-ins for training nodes in launcher tests: real processes that behave as the trainer does on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

# The trainer installs its own SIGTERM handler at start-up (LoraFinetuneRecipe.setup, training/recipes), whatever
# disposition or mask it inherited; the stand-in does the same (default action: exit), then says it is up.
_NODE = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM]); print('ready', flush=True); time.sleep(60)"
)


def sleeping_node(log: Path, timeout_s: float = 60.0) -> subprocess.Popen:
    """A node that runs for a minute unless stopped, in its own session like the launcher's; returns once it is up
    (so that a stop is sent to a running node, not one still starting)."""
    p = subprocess.Popen([sys.executable, "-c", _NODE], stdout=log.open("w"), start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while "ready" not in log.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the stand-in node did not start (exit {p.poll()})")
        time.sleep(0.02)
    return p


def wait_for(pred, timeout_s: float, what: str, every_s: float = 0.05):
    """Poll ``pred`` until it returns something truthy (returned) or ``timeout_s`` passes (AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def run_processes(run_id: str) -> list[int]:
    """Pids of the live (non-zombie) processes carrying ``run_id`` in ``CAMPAIGN_RUN_ID`` (torchrun and its workers)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("CAMPAIGN_RUN_ID") == run_id:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def trainer_workers(job_file: Path) -> list[int]:
    """Pids of the live trainer workers (``python -m training --config JOB_FILE``, not torchrun) of one job file."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if (
            p.info["status"] != psutil.STATUS_ZOMBIE
            and str(job_file) in cmd
            and "training" in cmd
            and not any("torch.distributed.run" in c or "torchrun" in c for c in cmd)
        ):
            out.append(p.pid)
    return out
