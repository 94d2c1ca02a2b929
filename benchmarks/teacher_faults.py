"""Benchmark (c): the openai backend against a faulty server. 2,000 prompts at concurrency 64;
the server (its own process, 50 ms per answer) fails 20% of requests with 429 (with
Retry-After) or 500 and lets 5% hang past the client's timeout. Every prompt must still
complete, none may be answered twice, and every retry must be counted.

    python benchmarks/teacher_faults.py [--prompts 2000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter

from teacher_common import emit, load_average, prompts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=1.0, help="client request timeout; hung requests hold 3x this")
    a = ap.parse_args()
    from campaign_orchestrator.generation.backends import OpenAIBackend
    from campaign_orchestrator.generation.blobstore import LocalStore
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.openai_client import OpenAICompatibleClient
    from campaign_orchestrator.generation.requests import Sampling, namespace
    from campaign_orchestrator.generation.runner import run_generation
    from tests.support.testserver import ServerProcess

    rows = prompts(a.prompts)
    load0 = load_average()
    server_args = [
        "--latency-ms",
        "50",
        "--fail-429",
        "0.1",
        "--fail-500",
        "0.1",
        "--timeout-rate",
        "0.05",
        "--hang-s",
        str(3 * a.timeout_s),
        "--retry-after-s",
        "0.2",
        "--seed",
        "7",
    ]
    with ServerProcess(*server_args) as srv:
        client = OpenAICompatibleClient(
            srv.base_url,
            "teacher",
            max_concurrency=a.concurrency,
            timeout_s=a.timeout_s,
            max_retries=10,
            backoff_initial_s=0.1,
            backoff_max_s=5.0,
        )
        backend = OpenAIBackend(client)
        s = Sampling(max_new_tokens=16)
        d = tempfile.mkdtemp()
        t0 = time.perf_counter()
        res = run_generation(
            rows, backend, s, GenerationCache(LocalStore(d), namespace(backend.identity, s), d + "/spool")
        )
        wall = time.perf_counter() - t0
        time.sleep(3 * a.timeout_s + 0.5)  # let hung requests end server-side before counting
        server = srv.stats()
    st = res.stats
    ok_counts = Counter(server["ok_by_prompt"].values())
    status = server["by_status"]
    failed_attempts = server["received"] - server["ok"]
    every_prompt_once = len(server["ok_by_prompt"]) == a.prompts and set(ok_counts) == {1}
    correct = sum(r["completion"] == " " + p["reference"] for r, p in zip(res.rows, rows, strict=True))
    ok = (
        st.failed == 0
        and st.generated == a.prompts
        and every_prompt_once
        and correct == a.prompts
        and st.retries == failed_attempts
    )
    return emit(
        {
            "benchmark": "teacher_faults",
            "prompts": a.prompts,
            "concurrency": a.concurrency,
            "client_timeout_s": a.timeout_s,
            "wall_s": round(wall, 2),
            "server_received": server["received"],
            "server_answered_ok": server["ok"],
            "server_429": status.get("429", 0),
            "server_500": status.get("500", 0),
            "server_hung_past_timeout": status.get("504", 0),
            "server_failed_attempts": failed_attempts,
            "client_retries": st.retries,
            "client_retry_reasons": st.retry_reasons,
            "completed": st.generated,
            "failed": st.failed,
            "correct_completions": correct,
            "every_prompt_answered_exactly_once": every_prompt_once,
            "retries_match_server_failures": st.retries == failed_attempts,
            "pass": ok,
            "load_average_before": load0,
            "load_average_after": load_average(),
        }
    )


if __name__ == "__main__":
    raise SystemExit(main())
