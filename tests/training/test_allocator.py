"""The CPU allocator setting: a fixed glibc mmap threshold when $CAMPAIGN_CPU_MMAP_THRESHOLD asks for one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from training import allocator


def test_threshold_is_off_by_default_and_reads_the_variable(monkeypatch):
    monkeypatch.delenv(allocator.ENV, raising=False)
    assert allocator.threshold() == 0 and allocator.limit_heap_fragmentation() is None
    monkeypatch.setenv(allocator.ENV, "524288")
    assert allocator.threshold() == allocator.LOW_MEMORY_THRESHOLD
    monkeypatch.setenv(allocator.ENV, "0")
    assert allocator.threshold() == 0 and allocator.limit_heap_fragmentation() is None  # 0: glibc's own
    monkeypatch.setenv(allocator.ENV, "lots")
    with pytest.raises(ValueError, match="CAMPAIGN_CPU_MMAP_THRESHOLD must be a number of bytes"):
        allocator.threshold()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_a_freed_block_over_the_threshold_goes_back_to_the_system():
    """In a fresh process: with the threshold set, 200 MB of 600 KB blocks freed (every other one kept, the
    pattern that fragments a heap) leave RSS near where it was; glibc's adaptive default keeps them."""
    code = """
import ctypes, sys
sys.path.insert(0, '.')
from training import allocator
set_ = sys.argv[1] == 'set'
if set_:
    assert allocator.limit_heap_fragmentation() == 512 * 1024
libc = ctypes.CDLL('libc.so.6'); libc.malloc.restype = ctypes.c_void_p; libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
first = libc.malloc(8 << 20); libc.free(first)  # an mmapped block freed: glibc's default raises its threshold
blocks = [libc.malloc(600 * 1024) for _ in range(340)]
for b in blocks:
    ctypes.memset(b, 1, 600 * 1024)
base = rss()
for b in blocks[::2]:
    libc.free(b)
print((base - rss()) / 2**20)
"""
    freed = {}
    for mode in ("set", "default"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True,
                             env={"CAMPAIGN_CPU_MMAP_THRESHOLD": "524288" if mode == "set" else ""})
        freed[mode] = float(out.stdout.strip())
    assert freed["set"] > 90 and freed["default"] < 10, freed  # ~100 MB back to the system, or kept by the heap
