"""The C allocator of training processes: jemalloc preloaded when the host has it (CAMPAIGN_CPU_ALLOCATOR)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from campaign_orchestrator import allocator


def test_auto_preloads_the_first_jemalloc_found_and_keeps_other_preloads(tmp_path):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    cands = (str(tmp_path / "missing.so"), str(lib))
    assert allocator.preload_env({}, cands) == {"LD_PRELOAD": str(lib)}
    assert allocator.preload_env({"LD_PRELOAD": "/x/libfoo.so"}, cands) == {"LD_PRELOAD": f"{lib}:/x/libfoo.so"}
    assert allocator.preload_env({"LD_PRELOAD": str(lib)}, cands) == {"LD_PRELOAD": str(lib)}  # not twice
    assert allocator.preload_env({allocator.ENV: "glibc"}, cands) == {}
    assert allocator.preload_env({}, (str(tmp_path / "missing.so"),)) == {}  # auto without jemalloc: glibc


def test_asking_for_a_missing_jemalloc_or_an_unknown_allocator_says_what_to_do(tmp_path):
    with pytest.raises(allocator.AllocatorError, match="apt-get install libjemalloc2"):
        allocator.preload_env({allocator.ENV: "jemalloc"}, (str(tmp_path / "missing.so"),))
    with pytest.raises(allocator.AllocatorError, match="must be one of auto, jemalloc, glibc, got 'tcmalloc'"):
        allocator.preload_env({allocator.ENV: "tcmalloc"})


@pytest.mark.skipif(allocator.jemalloc_path() is None, reason="no jemalloc on this host (apt-get install libjemalloc2)")
def test_a_process_started_with_the_preload_runs_on_jemalloc():
    code = "import sys; sys.path.insert(0, '.'); from campaign_orchestrator import allocator; print(allocator.in_use())"
    env = {"PATH": "/usr/bin:/bin"}
    with_it = subprocess.run(
        [sys.executable, "-c", code], env=env | allocator.preload_env({}), capture_output=True, text=True, check=True
    ).stdout.strip()
    without = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert (with_it, without) == ("jemalloc", "glibc")


TRIM_PROBE = """
import sys; sys.path.insert(0, '.')
from campaign_orchestrator import allocator
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
blocks = [b'x' * 65536 for _ in range(2000)]  # 125 MiB of heap blocks (under glibc's mmap threshold)
keep = b'y' * 65536  # a live block above them: free() alone cannot shrink the heap
del blocks
freed = rss(); trimmed = allocator.trim(); print(trimmed, round(freed - rss()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim: Linux")
def test_trim_gives_freed_heap_pages_back_under_glibc_and_leaves_jemalloc_alone():
    env = {"PATH": "/usr/bin:/bin", allocator.ENV: "glibc"}
    out = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.split()
    assert out[0] == "True" and int(out[1]) > 100, out  # ~125 MiB freed but resident until trimmed
    if allocator.jemalloc_path() is not None:
        out = subprocess.run(
            [sys.executable, "-c", TRIM_PROBE],
            env=env | allocator.preload_env({}),
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout
        assert out.split()[0] == "False"
