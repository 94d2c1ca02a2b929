"""``campaign dashboard --serve`` in a process of its own, as a person runs it beside the UI, or in a thread of this
one (fast: for tests that are not marked slow)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support import REPO_ROOT

SERVING = re.compile(r"serving the cost dashboards at (http://127\.0\.0\.1:\d+)/")


@contextmanager
def served_dashboards(root: Path, *args: str, timeout: float = 120) -> Iterator[tuple[str, list[str]]]:
    """Serve the dashboards of the artifact root ``root`` (``args``: e.g. ``--port 0``) until the block ends: the URL
    it says it serves at, and every line it printed up to then."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "campaign_app.cli", "dashboard", "--artifacts", str(root), "--serve", *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"`campaign dashboard --serve` exited ({proc.wait()}): {''.join(lines)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"`campaign dashboard --serve` never said where it serves: {''.join(lines)}")
            lines.append(line)
            m = SERVING.search(line)
            url = m.group(1) if m else None
        yield url, lines
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def served_here(root: Path, *args: str, timeout: float = 60) -> Iterator[str]:
    """``campaign dashboard --artifacts ROOT --serve ARGS`` through the CLI's entry point in a thread of this process
    until the block ends: the URL it serves at."""
    from campaign_app.cli import costs, main

    servers: list = []
    real = costs.serve

    def serve(folder, port, ready=None):  # the CLI's own serve, telling us its server too
        real(folder, port, lambda server: (ready and ready(server), servers.append(server)))

    costs.serve = serve
    thread = threading.Thread(target=main, args=(["dashboard", "--artifacts", str(root), "--serve", *args],))
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not servers:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError("`campaign dashboard --serve` did not start serving")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{servers[0].server_address[1]}"
    finally:
        costs.serve = real
        if servers:
            servers[0].shutdown()
        thread.join(timeout=30)
