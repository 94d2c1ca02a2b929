"""Benchmark (d): the transformers backend on the demo teacher, batched (length-bucketed,
left-padded batches) against one prompt at a time, tokens/s, in one run.

    python benchmarks/teacher_transformers.py [--prompts 512] [--single-prompts 128] [--batch-size 128]

tokens/s is a rate: one at a time is measured on the first ``--single-prompts`` of the same
prompts (all of them take minutes on a busy 2-core machine).

No GPU here: this is the CPU figure. (The vLLM backend's tokens/s needs a GPU machine.)
"""

from __future__ import annotations

import argparse
import tempfile
import time

from teacher_common import REPO, emit, load_average, prompts


def run(model_dir, rows, batch_size: int, gen) -> dict:
    from campaign_orchestrator.generation.backends import TransformersBackend
    from campaign_orchestrator.generation.blobstore import LocalStore
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.requests import Sampling, namespace
    from campaign_orchestrator.generation.runner import run_generation

    gen.batch_size = batch_size
    s = Sampling(max_new_tokens=16)
    backend = TransformersBackend(model_dir, "@demo/teacher", f"bench:{batch_size}", local_model=gen)
    d = tempfile.mkdtemp()
    t0 = time.perf_counter()
    res = run_generation(rows, backend, s, GenerationCache(LocalStore(d), namespace(backend.identity, s), d + "/spool"))
    wall = time.perf_counter() - t0
    st = res.stats
    correct = sum(r["completion"] == " " + p["reference"] for r, p in zip(res.rows, rows, strict=True))
    return {
        "batch_size": batch_size,
        "wall_s": round(wall, 3),
        "generate_s": round(st.generate_s, 3),
        "completion_tokens": st.new_completion_tokens,
        "tokens_per_s": round(st.tokens_per_s, 1),
        "rows_per_s": round(st.rows_per_s, 1),
        "correct": correct,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--single-prompts", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"))
    a = ap.parse_args()
    import torch

    from campaign_orchestrator.demo.recipe import resolve
    from campaign_orchestrator.generation.local import LocalModel

    model_dir = resolve("@demo/teacher", a.artifacts)
    if not (model_dir / "config.json").exists():
        raise SystemExit(
            f"demo teacher not built at {model_dir}: run `python -m campaign_orchestrator.demo --artifacts "
            f"{a.artifacts}`"
        )
    gen = LocalModel.from_path(model_dir)
    rows = prompts(a.prompts)
    load0 = load_average()
    run(model_dir, prompts(16, seed=1), a.batch_size, gen)  # warm-up
    batched = run(model_dir, rows, a.batch_size, gen)
    single = run(model_dir, rows[: a.single_prompts], 1, gen)
    return emit(
        {
            "benchmark": "teacher_transformers",
            "device": "cpu",
            "torch_threads": torch.get_num_threads(),
            "prompts": a.prompts,
            "max_new_tokens": 16,
            "batched": batched,
            "one_at_a_time": single,
            "tokens_per_s_speedup": round(batched["tokens_per_s"] / single["tokens_per_s"], 2),
            "all_correct": batched["correct"] == a.prompts and single["correct"] == len(rows[: a.single_prompts]),
            "vllm": "not measured: no GPU machine was available to this session",
            "load_average_before": load0,
            "load_average_after": load_average(),
        }
    )


if __name__ == "__main__":
    raise SystemExit(main())
