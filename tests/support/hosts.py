"""The two kinds of 2-core hosts this project runs on, for tests: AVX512-BF16 (``compute_dtype: auto`` resolves
to bfloat16) and AVX2-only (float32). A test whose outcome depends on the compute dtype names it explicitly and
runs both ways (:data:`DTYPES`); a whole session can run as the other kind of host (``CAMPAIGN_TEST_AUTO_DTYPE``,
tests/conftest.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

# parametrize a test over both compute dtypes: `@pytest.mark.parametrize("dtype", DTYPES)`
DTYPES = [pytest.param("float32", id="fp32"), pytest.param("bfloat16", id="bf16")]


def force_auto_dtype(cache_dir: Path, dtype: str) -> Path:
    """Write this host's bf16 verdict into a compute-dtype cache at ``cache_dir`` (campaign_orchestrator.hardware)
    so that ``auto`` resolves to ``dtype`` there: the verdict is measured once per host and kept, so every process
    that reads this cache decides as a host of the other kind would. The matmul peaks are still measured."""
    import torch

    from campaign_orchestrator import hardware

    key = "|".join((socket.gethostname(), hardware.cpu_capability(), torch.__version__)) + "|native"
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / hardware._cache_file().name
    cached = hardware.read_host_cache(path)
    cached[key] = {"bf16_native": dtype == "bfloat16", "forced_by": "tests (CAMPAIGN_TEST_AUTO_DTYPE)"}
    hardware.write_host_cache(path, cached)
    return cache_dir
