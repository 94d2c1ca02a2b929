"""A process's peak memory is its own, not its parent's (ru_maxrss on Linux starts a child from the parent's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from campaign_orchestrator.process_memory import peak_rss_mb
from tests.support import REPO_ROOT

CHILD = (
    "import sys; sys.path.insert(0, '.'); from campaign_orchestrator.process_memory import peak_rss_mb; "
    "print(peak_rss_mb())"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM: Linux")
def test_a_child_of_a_large_parent_reports_its_own_peak():
    held = bytearray(400 * 2**20)  # the parent holds 400 MiB resident
    for i in range(0, len(held), 4096):
        held[i] = 1
    assert peak_rss_mb() >= 400
    child = float(
        subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
    )
    assert 5 < child < 200, child  # a bare interpreter: tens of MiB, not the parent's 400+
    del held
