"""A CPU allocator setting for training when memory is what binds: glibc ``malloc`` serves blocks of
``$CAMPAIGN_CPU_MMAP_THRESHOLD`` bytes and more with ``mmap``, so a freed activation goes back to the
system instead of fragmenting the heap. Off by default (it costs speed).

By default glibc raises its mmap threshold each time an mmapped block is freed (up to 32 MiB), so after
the first step every activation comes from the heap. At SmolLM2-135M's shapes the segment-wise
attention allocates thousands of ~590 KB score and probability tensors a step (9 heads x 128 x 128
fp32); freed between differently sized blocks they fragment the heap, which keeps growing: peak RSS
was 2,233 MB with glibc's default against 1,782 MB with a fixed 512 KiB threshold (same run, same
loss, 1 thread; 1 MiB saved nothing, 128 KiB no more than 512 KiB). The price is a page fault per
fresh page of those blocks: 93.5 against 109 tokens/s in the same comparison, which is why it is
not the default (``benchmarks/train_throughput.py`` reports both as ``ours`` and ``ours_low_memory``).
``CAMPAIGN_CPU_MMAP_THRESHOLD=524288`` in the training process's environment turns it on; GPUs are
untouched (their memory is CUDA's caching allocator's). No effect off glibc (macOS, musl)."""

from __future__ import annotations

import ctypes
import os
import sys

ENV = "CAMPAIGN_CPU_MMAP_THRESHOLD"
DEFAULT_THRESHOLD = 0  # glibc's adaptive threshold
LOW_MEMORY_THRESHOLD = 512 * 1024
M_MMAP_THRESHOLD = -3  # glibc <malloc.h>


def threshold() -> int:
    """The threshold to set: ``$CAMPAIGN_CPU_MMAP_THRESHOLD`` when set, else 0 (leave glibc's)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_THRESHOLD
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${ENV} must be a number of bytes (0 keeps glibc's adaptive threshold), got {raw!r}") from None
    if value < 0:
        raise ValueError(f"${ENV} must be 0 or more bytes, got {value}")
    return value


def limit_heap_fragmentation() -> int | None:
    """Set glibc's mmap threshold for this process; the threshold set, or None when nothing was set (the
    variable is 0, or the C library is not glibc)."""
    value = threshold()
    if not value or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(value))
    except (OSError, AttributeError):
        return None
    return value if ok == 1 else None
