"""The compute dtype for the hardware a model runs on, decided by measurement, cached per host.

``compute_dtype: auto`` (the default for training, local teacher generation and local evaluation):

* CUDA: bf16 where the GPU supports it (``torch.cuda.is_bf16_supported()``), else fp16.
* CPU: a short timed matmul (fp32 and bf16 at 512² on one thread, about a second once per host; best of
  several rounds, since other processes only ever slow a round down); bf16 when it is at least as fast
  as fp32 (AMX, avx512_bf16), else fp32. The verdict is one per host, whatever a process's thread count:
  the resolved dtype is part of cache keys, so a 2-thread Dagster run and a 1-thread trainer agree. The chosen dtype is
  then timed at 2048²,
  compute bound, for the planner's peak. A CPU can report
  ``AVX512`` and still have no native bf16 instruction, where bf16 runs hundreds of times slower than fp32
  (docs/results.md, "Compute dtype on CPU"). The capability string is recorded, never trusted alone.

The measurement is cached in ``$CAMPAIGN_CACHE_DIR`` (default ``~/.cache/campaign-orchestrator``),
keyed by host, CPU capability, torch version and thread count, so a pod, a laptop and a CI runner
each measure once. Its GFLOP/s figures are also the planner's peak for the dtype used on CPU.
torch is imported inside the functions.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

AUTO = "auto"
DTYPES = ("bfloat16", "float16", "float32")
CACHE_ENV = "CAMPAIGN_CACHE_DIR"
MATMUL_N = 512  # the fp32-against-bf16 comparison (a slow bf16 path still answers in well under a second)
PEAK_N = 2048  # the faster dtype's peak, for the planner (compute bound; ~0.1 s per product at 150 GFLOP/s)
MIN_SECONDS = 0.05


@dataclass(frozen=True)
class CpuPeak:
    """Measured matmul throughput of this host's CPU (GFLOP/s) for fp32 and bf16."""

    host: str
    capability: str
    threads: int
    torch: str
    fp32_gflops: float
    bf16_gflops: float
    native: bool | None = None  # the host's one-thread verdict (:func:`measure_cpu_peak`); None: from these figures

    @property
    def bf16_native(self) -> bool:
        return self.native if self.native is not None else self.bf16_gflops >= self.fp32_gflops

    @property
    def bf16_slowdown(self) -> float:
        """How many times slower bf16 is than fp32 here (1.0 or less: not slower)."""
        return self.fp32_gflops / self.bf16_gflops if self.bf16_gflops > 0 else float("inf")

    def gflops(self, dtype: str) -> float:
        return self.bf16_gflops if dtype == "bfloat16" else self.fp32_gflops


@dataclass(frozen=True)
class Resolved:
    """What a ``compute_dtype`` setting resolved to, and why (recorded in metadata and the adapter)."""

    requested: str
    dtype: str
    device: str
    reason: str
    capability: str | None = None
    warning: str | None = None

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def cpu_capability() -> str:
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older torch or an exotic build
        return platform.machine()


def cache_dir() -> Path:
    """Where per-host measurements live (``$CAMPAIGN_CACHE_DIR``, else ``~/.cache/campaign-orchestrator``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "campaign-orchestrator")


def read_host_cache(path: Path) -> dict:
    """A JSON cache of per-host measurements ({} when missing or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_host_cache(path: Path, cached: dict) -> None:
    """Write ``cached`` atomically (a concurrent rank reads the old file or the new one, never half); a
    read-only home only means measuring again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=2))
        os.replace(tmp, path)
    except OSError:
        pass


@contextmanager
def host_lock(path: Path):
    """An exclusive lock beside the host cache file ``path`` (``<path>.lock``), held for the ``with`` block: the first
    process of a host measures while the others wait, then read its record (no lock where the directory cannot be
    written: each process then measures for itself)."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 - held open for the with block, closed below
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


def measured_once(path: Path, key: str, measure) -> tuple[dict, bool]:
    """The record under ``key`` in the host cache ``path``, and whether this call measured it: ``measure()`` (a
    dict) runs only when the key is absent, under :func:`host_lock`, so of the processes of a host that ask together
    exactly one measures and the others read its record."""
    cached = read_host_cache(path)
    if key in cached:
        return cached[key], False
    with host_lock(path):
        cached = read_host_cache(path)
        if key in cached:
            return cached[key], False
        record = measure()
        cached[key] = record
        write_host_cache(path, cached)
    return record, True


def _cache_file() -> Path:
    return cache_dir() / "cpu_peak.json"


def _time_matmul(dtype, n: int = MATMUL_N, rounds: int = 5) -> float:
    """GFLOP/s of an n×n matmul in ``dtype``: the best of ``rounds`` timings (another process competing for
    the cores only ever slows a round down, so the best one is the machine's own speed)."""
    import torch

    g = torch.Generator().manual_seed(0)  # its own generator: measuring never moves the global RNG (the
    a = torch.randn(n, n, generator=g).to(dtype)  # trainer seeds it before resolving its dtype, and a cache hit
    b = torch.randn(n, n, generator=g).to(dtype)  # measures nothing: LoRA init would differ run to run, rank to rank)
    a @ b  # warm-up (kernel selection, packing)
    best = 0.0
    for _ in range(rounds):
        reps, elapsed = 0, 0.0
        t0 = time.perf_counter()
        while elapsed < MIN_SECONDS or reps < 2:
            a @ b
            reps += 1
            elapsed = time.perf_counter() - t0
            if elapsed > 0.5:  # very slow bf16 emulation: one product is evidence enough
                break
        best = max(best, 2 * n**3 * reps / elapsed / 1e9)
        if elapsed > 1.0:
            break
    return best


def _one_thread_peak(dtype) -> float:
    """The peak on one thread: a floor for the n-thread figure. On an idle host n threads are never slower
    than one, but while another process holds a core the n-thread matmul waits on its slowest thread and can
    fall below the one-thread figure (docs/results.md, "Compute dtype on CPU"); the floor keeps one busy
    minute from making the planner's time estimate several times too long for good (the cache keeps the best)."""
    import torch

    threads = torch.get_num_threads()
    if threads <= 1:
        return 0.0
    torch.set_num_threads(1)
    try:
        return _time_matmul(dtype, PEAK_N, rounds=3)
    finally:
        torch.set_num_threads(threads)


def _bf16_native(cached: dict, key: dict) -> bool:
    """Whether this host computes bf16 natively: one verdict per host, capability and torch, measured once on
    one thread and shared by every thread count (stored in ``cached`` under ``...|native``). The resolved
    dtype enters cache keys, so two processes of one host (a Dagster run on 2 threads, a trainer on 1) must
    never disagree: a contended 2-thread measurement can, one thread needs only one free core. The two
    kinds of CPU are far apart (native bf16 is several times fp32's speed, emulated bf16 hundreds of times
    slower: docs/results.md, "Compute dtype on CPU"), so one comparison is decisive."""
    import torch

    k = "|".join(str(key[f]) for f in ("host", "capability", "torch")) + "|native"
    if k in cached:
        return bool(cached[k]["bf16_native"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = _time_matmul(torch.float32), _time_matmul(torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    cached[k] = {
        "bf16_native": bf16 >= fp32,
        "fp32_gflops_1thread": round(fp32, 2),
        "bf16_gflops_1thread": round(bf16, 2),
    }
    return bf16 >= fp32


def measure_cpu_peak(refresh: bool = False) -> CpuPeak:
    """This host's fp32 and bf16 matmul GFLOP/s, measured once and cached per host."""
    import torch

    key = {
        "host": socket.gethostname(),
        "capability": cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    path = _cache_file()
    cached = read_host_cache(path)
    k = "|".join(str(v) for v in key.values())
    if not refresh and k in cached:
        entry = dict(cached[k])
        if entry.get("native") is None:  # an entry from before the one-thread verdict
            entry["native"] = _bf16_native(cached, key)
            write_host_cache(path, cached)
        return CpuPeak(**entry)
    native = _bf16_native(cached, key)
    if key["threads"] == 1:  # the verdict's own one-thread figures: nothing to measure twice
        one = cached["|".join(str(key[f]) for f in ("host", "capability", "torch")) + "|native"]
        fp32, bf16 = one["fp32_gflops_1thread"], one["bf16_gflops_1thread"]
    else:
        fp32, bf16 = _time_matmul(torch.float32), _time_matmul(torch.bfloat16)
    fast = torch.bfloat16 if native else torch.float32  # the dtype auto picks: its peak, compute bound
    peak_n = max(_time_matmul(fast, PEAK_N, rounds=3), _one_thread_peak(fast))
    if fast is torch.bfloat16:
        bf16 = max(bf16, peak_n)
    else:
        fp32 = max(fp32, peak_n)
    peak = CpuPeak(**key, fp32_gflops=round(fp32, 2), bf16_gflops=round(bf16, 2), native=native)
    if k in cached:  # a refresh keeps the best figure this host has shown (load only ever slows a measurement)
        old = cached[k]
        peak = CpuPeak(
            **key,
            fp32_gflops=max(peak.fp32_gflops, old["fp32_gflops"]),
            bf16_gflops=max(peak.bf16_gflops, old["bf16_gflops"]),
            native=native,
        )
    cached[k] = asdict(peak)
    write_host_cache(path, cached)
    return peak


def resolve_compute_dtype(requested: str, device: str | None = None, peak: CpuPeak | None = None) -> Resolved:
    """The dtype to compute in on ``device`` (``cuda``/``cpu``; default: CUDA when visible).

    ``peak`` overrides the CPU measurement (tests inject one)."""
    import torch

    if requested not in (AUTO, *DTYPES):
        raise ValueError(f"compute_dtype must be auto, bfloat16, float16 or float32, got {requested!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        bf16 = torch.cuda.is_bf16_supported()
        if requested == AUTO:
            return Resolved(
                AUTO,
                "bfloat16" if bf16 else "float16",
                device,
                "GPU supports bf16" if bf16 else "GPU without bf16: fp16",
            )
        return Resolved(requested, requested, device, "set in the campaign")
    peak = peak or measure_cpu_peak()
    why = (
        f"CPU {peak.capability}: bf16 matmul {peak.bf16_gflops:.1f} GFLOP/s, fp32 {peak.fp32_gflops:.1f} "
        f"(measured, {peak.threads} threads)"
    )
    if requested == AUTO:
        return Resolved(AUTO, "bfloat16" if peak.bf16_native else "float32", device, why, peak.capability)
    warning = None
    if requested in ("bfloat16", "float16") and not peak.bf16_native:
        warning = (
            f"compute_dtype {requested} on a CPU without native bf16 ({peak.capability}): bf16 matmul measured "
            f"{peak.bf16_slowdown:.1f}x slower than fp32 here; `compute_dtype: auto` picks float32"
        )
    return Resolved(requested, requested, device, "set in the campaign; " + why, peak.capability, warning)


def device_kind(device: str) -> str:
    """``cuda`` for any CUDA device (``cuda``, ``cuda:1``), else ``cpu``."""
    return "cuda" if str(device).startswith("cuda") else "cpu"


def device_memory_gb(device) -> float:
    """The memory a device (``torch.device`` or its name) offers training, decimal GB: the GPU's total memory, or the
    host's physical memory for the CPU (the memory policy sizes ``auto`` fields against it)."""
    if device_kind(str(device)) == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory / 1e9
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def default_device() -> str:
    """Where a local model runs unless told otherwise (the local generator, local evaluation, the local
    trainer): ``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def key_precision(requested: str, device: str | None = None, peak: CpuPeak | None = None) -> str:
    """What a ``compute_dtype`` setting computes in on ``device`` (default: :func:`default_device`), as it
    enters cache keys: ``<device kind>:<resolved dtype>`` (``cpu:float32``, ``cuda:bfloat16``), never
    ``auto``. Cheap: on a CPU it reads this host's cached measurement (:func:`measure_cpu_peak`, measured
    once per host). Imports torch: call it while a stage runs, never when the code location loads."""
    r = resolve_compute_dtype(requested, device or default_device(), peak)
    return f"{device_kind(r.device)}:{r.dtype}"


def library_versions() -> dict[str, str]:
    """Versions of the libraries a result depends on (for the reproducibility card)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in (
        "torch",
        "transformers",
        "peft",
        "bitsandbytes",
        "accelerate",
        "tokenizers",
        "safetensors",
        "campaign-orchestrator",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out
