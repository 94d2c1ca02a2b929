"""transformers' continuous batching, ``model.generate_batch``: a paged key/value cache, requests scheduled in and
out of one running batch by transformers (CUDA-graph warm-up on a GPU).

Greedy only, and no top-k log-probabilities: it returns the chosen token's log-probability alone, so ``auto``
never picks it for a request that asks for top-k (:attr:`GenerateBatchEngine.top_logprobs`). Its paged cache is
sized here, not left to transformers' default (a share of the whole device's memory, which on a CPU host means
allocating and touching gigabytes for a few prompts): the pages the call's rows need, capped on a GPU by
``KV_FREE_SHARE`` of the memory the device has free. The API moved between transformers releases: with
``ContinuousBatchingConfig`` (5.25 and later) the sizes go there; before it they go on the ``GenerationConfig``
and the model is switched to paged attention for the call. Imports torch: load lazily.
"""

from __future__ import annotations

import inspect
import math
import time

import torch

from campaign_orchestrator.generation.completion import Completion
from campaign_orchestrator.generation.engines.common import cut_at_stop, finished, skip_too_long

PAGE_TOKENS = 64  # tokens per page of the paged cache
KV_FREE_SHARE = 0.8  # on a GPU: at most this share of the device's free memory goes to the paged cache
MAX_PAGES_CPU = 4096  # on a CPU: the paged cache never holds more than this many pages


class GenerateBatchEngine:
    """``model.generate_batch`` over ``gen`` (a :class:`~campaign_orchestrator.generation.local.LocalModel`)."""

    name = "generate_batch"
    top_logprobs = False
    # a candidate of ``auto`` on GPUs only: on a CPU it runs (and answers alike) but far slower than the continuous
    # engine (benchmarks/generation_speed.py), and probing it there would cost seconds for a known loser
    devices = ("cuda",)

    def __init__(self, gen):
        self.g = gen

    def unavailable(self) -> str | None:
        if not callable(getattr(self.g.model, "generate_batch", None)):
            import transformers

            return f"transformers {transformers.__version__} has no model.generate_batch"
        return None

    def _pages(self, rows: list[list[int]], max_new_tokens: int) -> int:
        """Pages for every row at its full length, capped by the device's free memory (GPU) or MAX_PAGES_CPU."""
        need = sum(math.ceil((len(e) + max_new_tokens) / PAGE_TOKENS) for e in rows) + 1
        dev = self.g.device
        if dev.type == "cuda":
            free, _total = torch.cuda.mem_get_info(dev)
            page_bytes = self.g.cache_bytes_per_token() * PAGE_TOKENS
            return max(1, min(need, int(free * KV_FREE_SHARE) // page_bytes))
        return max(1, min(need, MAX_PAGES_CPU))

    @torch.no_grad()
    def generate(self, enc, max_new_tokens, logprobs=None, progress=None, on_result=None) -> list[Completion]:
        from transformers import GenerationConfig

        if logprobs:
            raise ValueError(
                "engine generate_batch cannot return top-k log-probabilities; use engine auto, "
                "continuous or hf_generate for requests that ask for them"
            )
        g = self.g
        out: list[Completion | None] = [None] * len(enc)
        fits = skip_too_long(enc, max_new_tokens, g.context_length, out, on_result, progress)
        if not fits:
            return out  # type: ignore[return-value]
        rows = [list(enc[i]) for i in fits]
        pages = self._pages(rows, max_new_tokens)
        max_batch = min(sum(len(r) for r in rows) + len(rows), g.batch_size * 64)
        cfg = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(g.stop_ids),
            pad_token_id=g.tok.pad_token_id,
        )
        kw: dict = {"progress_bar": False}
        params = inspect.signature(g.model.generate_batch).parameters
        switched = None
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            ContinuousBatchingConfig = None  # noqa: N806 - older transformers: sizes on the GenerationConfig
        if ContinuousBatchingConfig is not None and "continuous_batching_config" in params:
            kw["continuous_batching_config"] = ContinuousBatchingConfig(
                num_blocks=pages,
                page_size=PAGE_TOKENS,
                max_batch_tokens=max_batch,
                use_cuda_graph=None if g.device.type == "cuda" else False,
            )
        else:
            cfg.num_blocks, cfg.block_size, cfg.max_batch_tokens = pages, PAGE_TOKENS, max_batch
            impl = getattr(g.model.config, "_attn_implementation", "sdpa") or "sdpa"
            if not impl.startswith("paged"):
                switched = impl
                g.model.set_attn_implementation(f"paged|{impl}" if impl in ("sdpa", "eager") else "paged|sdpa")
        if "warmup" in params:
            kw["warmup"] = g.device.type == "cuda"
        t0 = time.perf_counter()
        try:
            results = g.model.generate_batch(rows, generation_config=cfg, **kw)
        finally:
            if switched is not None:
                g.model.set_attn_implementation(switched)
        end = time.perf_counter()
        got = list(results.values())
        if len(got) != len(rows):
            raise RuntimeError(
                f"generate_batch answered {len(got)} of {len(rows)} prompts (transformers logged "
                "which failed); use engine continuous or hf_generate"
            )
        stops = set(g.stop_ids)
        for i, r in zip(fits, got, strict=True):
            if r.error is not None:
                out[i] = Completion.failed(f"generate_batch failed the prompt: {r.error}", len(enc[i]))
            else:
                toks = cut_at_stop(list(r.generated_tokens), stops, max_new_tokens)
                lat = (r.lifespan[1] - t0) if r.lifespan and r.lifespan[1] > t0 else end - t0
                out[i] = finished(g.tok, stops, toks, len(enc[i]), lat)
            if on_result:
                on_result(i, out[i])
        if progress:
            progress(len(fits))
        return out  # type: ignore[return-value]
