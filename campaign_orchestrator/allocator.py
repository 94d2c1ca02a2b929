"""The C allocator training runs on: jemalloc when the host has it, as PyTorch's own CPU launcher does
(``python -m torch.backends.xeon.run_cpu --enable-jemalloc``).

glibc ``malloc`` raises its mmap threshold each time an mmapped block is freed (up to 32 MiB), so after
the first step every activation comes from the heap; with packed micro-batches every step allocates
blocks of a different size (``T x 576`` floats, T the step's token count), and the heap fragments and
keeps growing. jemalloc keeps the peak lower at the same speed; a fixed mmap threshold on glibc trades
speed for memory (a page fault per fresh page), and ``malloc_trim`` after every step recovers little
(the figures: docs/results.md, "The C allocator").

``$CAMPAIGN_CPU_ALLOCATOR``: ``auto`` (default: jemalloc when one of :data:`JEMALLOC_PATHS` exists, else
glibc), ``jemalloc`` (an error when it is missing), ``glibc``. The launcher puts the library in the
ranks' ``LD_PRELOAD`` (:func:`preload_env`); it has to be there when a process starts. Debian/Ubuntu:
``apt-get install libjemalloc2`` (``make system-deps`` and ``deploy/Dockerfile`` do). No torch import.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import sys
from collections.abc import Mapping
from pathlib import Path

ENV = "CAMPAIGN_CPU_ALLOCATOR"
CHOICES = ("auto", "jemalloc", "glibc")
JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
    "/opt/homebrew/lib/libjemalloc.2.dylib",
)


class AllocatorError(ValueError):
    pass


def jemalloc_path(candidates: tuple[str, ...] = JEMALLOC_PATHS) -> str | None:
    """The first jemalloc shared library that exists on this host, or None."""
    return next((p for p in candidates if Path(p).is_file()), None)


def choice(env: Mapping[str, str] | None = None) -> str:
    value = (env if env is not None else os.environ).get(ENV, "auto").strip() or "auto"
    if value not in CHOICES:
        raise AllocatorError(f"${ENV} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def preload_env(env: Mapping[str, str] | None = None, candidates: tuple[str, ...] = JEMALLOC_PATHS) -> dict[str, str]:
    """What to add to a training process's environment: ``{"LD_PRELOAD": ...}`` with jemalloc first, or {}."""
    env = dict(os.environ if env is None else env)
    want = choice(env)
    if want == "glibc":
        return {}
    path = jemalloc_path(candidates)
    if path is None:
        if want == "jemalloc":
            raise AllocatorError(
                f"${ENV}=jemalloc but no jemalloc library was found (looked for "
                f"{', '.join(candidates)}); install it (Debian/Ubuntu: apt-get install libjemalloc2) "
                f"or set {ENV}=auto"
            )
        return {}
    current = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != path]
    return {"LD_PRELOAD": ":".join([path, *current])}


@functools.cache  # fixed when the process starts (LD_PRELOAD); reading /proc/self/maps takes ~1 ms
def in_use() -> str:
    """The allocator of this process: ``jemalloc`` when it is mapped, else ``glibc`` (Linux; else ``system``)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "jemalloc" if "jemalloc" in maps else "glibc"


def trim(collect: bool = True) -> bool:
    """Give the C heap's free pages back to the OS after a large release (a model unloaded, a generation's
    key/value caches dropped): ``gc.collect()`` then glibc's ``malloc_trim(0)``, which returns every free page,
    not only the heap's top. True when it trimmed; jemalloc (which returns pages itself) and other hosts: False.

    Without it a process that loads models one after another (evaluation: candidate, base, teacher) keeps
    each one's freed pages, and its peak grows with every model (docs/results.md, "The C allocator").
    Costs milliseconds.
    ``collect=False`` skips the garbage collection (what was freed went by reference counting)."""
    if collect:
        gc.collect()
    if not sys.platform.startswith("linux") or in_use() != "glibc":
        return False
    try:
        ctypes.CDLL(None).malloc_trim(0)
        return True
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return False
