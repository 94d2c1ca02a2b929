"""Benchmark (a): the openai backend against a local OpenAI-compatible server that answers each
request after a fixed 50 ms. 2,000 prompts at concurrency 64 against the same 2,000 one at a
time, through the full generation loop (cache writes included), in one run, after a short
warm-up on other prompts (imports, first connections) that neither side is timed on.

    python benchmarks/teacher_openai_concurrency.py [--prompts 2000] [--concurrency 64]

Target: concurrent >= 30x faster than sequential. The server runs in its own process. The
concurrent side is timed ``--repeats`` times (fresh caches) and its median is compared with the
one sequential pass (every time is printed): on a shared 2-core machine one load spike during
a ~2 s measurement otherwise decides the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from teacher_common import emit, load_average, prompts


def run(base_url: str, rows: list[dict], concurrency: int, cache_dir: str) -> tuple[float, dict]:
    from campaign_orchestrator.generation.backends import OpenAIBackend
    from campaign_orchestrator.generation.blobstore import LocalStore
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.openai_client import OpenAICompatibleClient
    from campaign_orchestrator.generation.requests import Sampling, namespace
    from campaign_orchestrator.generation.runner import run_generation

    s = Sampling(max_new_tokens=16)
    backend = OpenAIBackend(OpenAICompatibleClient(base_url, "teacher", max_concurrency=concurrency))
    cache = GenerationCache(LocalStore(cache_dir), namespace(backend.identity, s), cache_dir + "/spool")
    t0 = time.perf_counter()
    res = run_generation(rows, backend, s, cache)
    wall = time.perf_counter() - t0
    assert res.stats.generated == len(rows) and res.stats.failed == 0, res.stats
    return wall, res.stats.as_dict()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=3, help="timed concurrent passes (median)")
    a = ap.parse_args()
    from tests.support.testserver import ServerProcess

    rows = prompts(a.prompts)
    load0 = load_average()
    with ServerProcess("--latency-ms", str(a.latency_ms)) as srv:
        # warm-up (imports, first connections) on other prompts, so neither side pays it
        run(srv.base_url, prompts(a.concurrency, seed=1), a.concurrency, tempfile.mkdtemp())
        srv.reset()
        conc_all = [run(srv.base_url, rows, a.concurrency, tempfile.mkdtemp())[0] for _ in range(a.repeats)]
        conc_s = statistics.median(conc_all)
        in_flight = srv.stats(summary=True)["max_in_flight"]
        srv.reset()
        seq_s, seq = run(srv.base_url, rows, 1, tempfile.mkdtemp())
    speedup = seq_s / conc_s
    ideal = min(a.concurrency, a.prompts)
    return emit(
        {
            "benchmark": "teacher_openai_concurrency",
            "prompts": a.prompts,
            "server_latency_ms": a.latency_ms,
            "concurrency": a.concurrency,
            "concurrent_s": round(conc_s, 3),
            "concurrent_s_each": [round(x, 3) for x in conc_all],
            "sequential_s": round(seq_s, 3),
            "concurrent_rows_per_s": round(a.prompts / conc_s, 1),
            "sequential_rows_per_s": round(a.prompts / seq_s, 2),
            "speedup": round(speedup, 2),
            "ideal_speedup": ideal,
            "server_max_in_flight": in_flight,
            "target_speedup": 30.0,
            "pass": speedup >= 30.0,
            "load_average_before": load0,
            "load_average_after": load_average(),
        }
    )


if __name__ == "__main__":
    raise SystemExit(main())
