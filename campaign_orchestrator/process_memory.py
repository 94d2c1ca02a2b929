"""This process's peak resident memory, as its own: ``VmHWM`` of ``/proc/self/status`` on Linux.

``getrusage(RUSAGE_SELF).ru_maxrss`` is not that on Linux: at ``exec`` the kernel folds the old address space's
high-water mark into the new process's, and a child started by ``fork``/``vfork`` + ``exec`` (``subprocess``,
torchrun's ranks, the local launcher's trainers) starts from its *parent's* peak. Measured: a parent holding
800 MB started a child whose ``ru_maxrss`` read 813 MB and its ``VmHWM`` 14 MB; a benchmark whose parent had
converted a model (1.6 GB) gave every worker the same 1,603 MB "peak". ``VmHWM`` belongs to the address space
``exec`` created. Other systems: ``ru_maxrss`` (bytes on macOS, KiB elsewhere). No torch import."""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def peak_rss_mb() -> float:
    """The most memory this process has held resident since it started (its ``exec``), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024
