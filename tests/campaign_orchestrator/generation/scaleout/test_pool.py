"""The pool's test of whether a stopped worker is gone: only once nothing of it can still hold its spool's lock."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import textwrap
import time

import pytest

from campaign_orchestrator.generation.scaleout.pool import _alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")

# A process whose leader thread exits first (pthread_exit) while another thread keeps the spool locked: the state a
# killed multi-threaded Ray worker passes through, its leader a zombie and its files still open.
CHILD = textwrap.dedent(
    """
    import ctypes, fcntl, os, sys, threading, time
    spool, release = sys.argv[1], sys.argv[2]
    f = open(spool, "a")
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    def hold():
        while not os.path.exists(release):
            time.sleep(0.02)
        os._exit(0)
    threading.Thread(target=hold).start()
    print("locked", flush=True)
    ctypes.CDLL(None).pthread_exit(None)
    """
)


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def _locked(path) -> bool:
    with open(path, "a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False


def test_a_zombie_leader_whose_threads_hold_the_spool_is_alive_and_a_reaped_or_exited_one_is_not(tmp_path):
    spool, release = tmp_path / "w.jsonl", tmp_path / "release"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(spool), str(release)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        deadline = time.monotonic() + 30
        while _state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(child.pid) == "Z" and _locked(spool)  # the leader is a zombie, the lock is still held
        assert _alive(child.pid)
        release.touch()
        deadline = time.monotonic() + 30
        while _alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child.pid) and not _locked(spool)  # gone (a zombie until reaped): the lock is free
    finally:
        release.touch()
        child.wait(timeout=30)
    assert not _alive(child.pid)  # reaped


def test_a_live_process_is_alive_and_an_unknown_pid_is_not():
    import os

    assert _alive(os.getpid())
    assert not _alive(2**22 + 12345)
