"""compute_dtype auto: measured, cached per host, fp32 on a CPU without native bf16, bf16 where it is native."""

from __future__ import annotations

import pytest
import torch

from campaign_orchestrator import hardware
from campaign_orchestrator.hardware import CpuPeak, resolve_compute_dtype

AVX2_EPYC = CpuPeak(host="h", capability="AVX2", threads=2, torch="2.13.0", fp32_gflops=150.0, bf16_gflops=0.3)
SAPPHIRE = CpuPeak(host="h", capability="AVX512", threads=2, torch="2.13.0", fp32_gflops=175.0, bf16_gflops=400.0)
AVX512_NO_BF16 = CpuPeak(host="h", capability="AVX512", threads=2, torch="2.13.0", fp32_gflops=170.0, bf16_gflops=9.0)


def test_auto_is_fp32_without_native_bf16_and_bf16_where_native():
    assert resolve_compute_dtype("auto", "cpu", AVX2_EPYC).dtype == "float32"
    assert resolve_compute_dtype("auto", "cpu", AVX512_NO_BF16).dtype == "float32"  # the capability string alone lies
    native = resolve_compute_dtype("auto", "cpu", SAPPHIRE)
    assert native.dtype == "bfloat16" and "400.0 GFLOP/s" in native.reason and native.capability == "AVX512"


def test_explicit_bf16_on_a_cpu_without_it_warns_with_the_measured_slowdown():
    r = resolve_compute_dtype("bfloat16", "cpu", AVX2_EPYC)
    assert r.dtype == "bfloat16" and "500.0x slower" in r.warning and "auto" in r.warning
    assert resolve_compute_dtype("bfloat16", "cpu", SAPPHIRE).warning is None
    assert resolve_compute_dtype("float32", "cpu", AVX2_EPYC).warning is None


def test_cuda_branch(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_compute_dtype("auto", "cuda").dtype == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_compute_dtype("auto", "cuda").dtype == "float16"


def test_the_measurement_runs_once_per_host_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(hardware.CACHE_ENV, str(tmp_path))
    calls = []
    real = hardware._time_matmul

    def counted(dtype, n=hardware.MATMUL_N, rounds=5):
        calls.append(dtype)
        return real(dtype, 64, 2)  # small and quick: the test checks the caching, not the speed

    monkeypatch.setattr(hardware, "_time_matmul", counted)
    first = hardware.measure_cpu_peak()
    # the one-thread verdict (both dtypes), then on more threads both dtypes again, the faster one big, and big
    # on one thread (the floor); on one thread the verdict's figures are reused
    n = 6 if torch.get_num_threads() > 1 else 3
    assert len(calls) == n and first.fp32_gflops > 0 and first.bf16_gflops > 0
    assert hardware.measure_cpu_peak() == first and len(calls) == n  # cached
    assert (tmp_path / "cpu_peak.json").exists()


def test_a_contended_many_thread_peak_is_floored_at_the_one_thread_peak(tmp_path, monkeypatch):
    """Another process holding a core slows a 2-thread matmul below a 1-thread one (22.5 against 69 GFLOP/s,
    measured here): the peak the planner uses is never below the one-thread figure."""
    monkeypatch.setenv(hardware.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(
        hardware,
        "_time_matmul",
        lambda dtype, n=hardware.MATMUL_N, rounds=5: (
            (69.0 if threads and threads[-1] == 1 else 22.5) if dtype == torch.float32 else 0.5
        ),
    )
    peak = hardware.measure_cpu_peak()
    assert peak.fp32_gflops == 69.0 and peak.threads == 2
    assert threads == [1, 2, 1, 2]  # the one-thread verdict, then the one-thread floor: restored to 2 after each


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="auto, bfloat16, float16 or float32"):
        resolve_compute_dtype("int8", "cpu", AVX2_EPYC)


def test_measuring_never_moves_the_global_rng():
    """The trainer seeds torch and then resolves its dtype; a measurement (first run) and a cache hit (the
    next run, another rank) must leave the same random state, or LoRA init differs between them."""
    import torch

    torch.manual_seed(0)
    hardware._time_matmul(torch.float32, 64, 1)
    measured = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(measured, torch.rand(4))


def test_one_verdict_per_host_whatever_the_thread_count(tmp_path, monkeypatch):
    """The resolved dtype is part of cache keys, so a 2-thread process and a 1-thread one of the same host must
    agree, even when a contended 2-thread measurement reads bf16 slower than fp32 (it did here, under load)."""
    monkeypatch.setenv(hardware.CACHE_ENV, str(tmp_path))

    def fake_matmul(dtype, n=hardware.MATMUL_N, rounds=5):
        one_thread = torch.get_num_threads() == 1
        if dtype == torch.bfloat16:
            return 440.0 if one_thread else 20.0  # the 2-thread bf16 round lost its core to another process
        return 99.0 if one_thread else 120.0

    monkeypatch.setattr(hardware, "_time_matmul", fake_matmul)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = hardware.measure_cpu_peak()
        torch.set_num_threads(1)
        one = hardware.measure_cpu_peak()
    finally:
        torch.set_num_threads(threads)
    assert two.threads == 2 and one.threads == 1
    assert two.bf16_native and one.bf16_native  # one host, one verdict (the 2-thread figures alone would say fp32)
    assert (
        resolve_compute_dtype("auto", "cpu", two).dtype == resolve_compute_dtype("auto", "cpu", one).dtype == "bfloat16"
    )
