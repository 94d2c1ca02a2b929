"""Stand-ins for training nodes in launcher tests: real processes that behave as the trainer does on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

# The trainer installs its own SIGTERM handler at start-up (training/trainer.py), whatever disposition or mask it
# inherited; the stand-in does the same (default action: exit), then says it is up.
_NODE = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_DFL); "
         "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM]); print('ready', flush=True); time.sleep(60)")


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
