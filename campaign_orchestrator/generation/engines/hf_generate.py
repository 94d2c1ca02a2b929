"""transformers' ``model.generate`` in length-sorted batches of ``batch_size`` rows, each decoded until its longest
answer ends; a prefix every prompt of the call shares is prefilled once. The one engine that samples
(``temperature > 0``): its seeds and random stream are the project's. Imports torch: load lazily."""

from __future__ import annotations

import time

import torch

from campaign_orchestrator.generation.completion import Completion
from campaign_orchestrator.generation.engines.common import shared_prefix_length

PREFIX_MIN_TOKENS = 32  # a shared prefix at least this long is prefilled once per call and reused by every batch


class _TopKRecorder:
    """A logits processor that records log_softmax top-k of the scores it sees, per step.

    Custom processors run before the sampling warpers (temperature, top-p), so these are the
    model's own probabilities."""

    def __init__(self, k: int):
        self.k = k
        self.values: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        v, i = torch.log_softmax(scores.float(), dim=-1).topk(min(self.k, scores.shape[-1]), dim=-1)
        self.values.append(v)
        self.indices.append(i)
        return scores


class _StepClock:
    """A logits processor that only notes when each decoding step's scores are ready: the token of step
    k is chosen right after call k, so an item that ended with its n-th token was done at call n-1."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores

    def latency(self, t0: float, end: float, n_tokens: int) -> float:
        """Seconds from the batch's start until the item's last token (``end``: the batch's end)."""
        if n_tokens <= 0 or n_tokens > len(self.times):
            return end - t0
        return self.times[n_tokens - 1] - t0


class HFGenerateEngine:
    """``generate`` over ``gen`` (a :class:`~campaign_orchestrator.generation.local.LocalModel`)."""

    name = "hf_generate"
    top_logprobs = True
    devices = ("cpu", "cuda")

    def __init__(self, gen):
        self.g = gen

    def unavailable(self) -> str | None:
        return None

    def generate(
        self,
        enc,
        max_new_tokens,
        logprobs=None,
        progress=None,
        on_result=None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[Completion]:
        """The ``transformers`` ``generate`` path: length-sorted batches of ``batch_size`` rows, each decoded
        until its longest answer ends, one shared prefix per call prefilled once; sampling (``temperature > 0``)
        seeds each batch with ``seed`` + its first index."""
        import copy

        from transformers import LogitsProcessorList

        g = self.g
        prompts = enc

        fits = [e for e in enc if not g.context_length or len(e) + max_new_tokens <= g.context_length]
        shared = shared_prefix_length(fits) if g.prefix_caching else 0
        prefix, prefix_cache = (enc and fits and fits[0][:shared]) or [], None
        if shared >= PREFIX_MIN_TOKENS:  # a teacher's context, a few-shot header: prefill it once for the whole call
            prefix_cache = g._prefix_cache(prefix)
        if prefix_cache is None:
            prefix = []
        g.last_shared_prefix = len(prefix)
        order = sorted(range(len(prompts)), key=lambda i: len(enc[i]))
        out: list[Completion | None] = [None] * len(prompts)
        stops = set(g.stop_ids)
        for start in range(0, len(order), g.batch_size):
            idx = order[start : start + g.batch_size]
            too_long = [i for i in idx if g.context_length and len(enc[i]) + max_new_tokens > g.context_length]
            for i in too_long:
                out[i] = Completion.failed(
                    f"prompt of {len(enc[i])} tokens + {max_new_tokens} new tokens exceeds the "
                    f"teacher's context of {g.context_length}",
                    len(enc[i]),
                )
                if on_result:
                    on_result(i, out[i])
            idx = [i for i in idx if i not in too_long]
            if not idx:
                if progress and too_long:
                    progress(len(too_long))
                continue
            p = len(prefix)
            width = max(len(enc[i]) - p for i in idx)
            ids, mask = g._batch_inputs([enc[i][p:] for i in idx], width, prefix)
            width += p
            gen_kwargs: dict = {
                "max_new_tokens": max_new_tokens,
                "pad_token_id": g.tok.pad_token_id,
                "eos_token_id": list(g.stop_ids),
            }
            if prefix_cache is not None:
                cache = copy.deepcopy(prefix_cache)
                cache.batch_repeat_interleave(len(idx))
                gen_kwargs["past_key_values"] = cache
            if temperature > 0:
                torch.manual_seed(seed + start)
                gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p)
            else:
                gen_kwargs.update(do_sample=False)
            recorder = _TopKRecorder(logprobs) if logprobs else None
            clock = _StepClock()  # per-item latency: each item is done when its last token is
            gen_kwargs["logits_processor"] = LogitsProcessorList([clock] + ([recorder] if recorder is not None else []))
            t0 = time.perf_counter()
            seqs = g.model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
            end = time.perf_counter()
            new = seqs[:, width:].cpu()
            if recorder is not None:
                top_v = torch.stack(recorder.values, dim=1).cpu().tolist()  # (batch, steps, k)
                top_i = torch.stack(recorder.indices, dim=1).cpu().tolist()
            for row, i in enumerate(idx):
                toks = new[row].tolist()
                end = next((j for j, t in enumerate(toks) if t in stops), None)
                if end is not None:
                    stop = toks[end]
                    toks, reason = toks[:end], "stop"
                    n_out = len(toks) + 1
                    ids_out = toks + [stop]
                else:
                    toks = [t for t in toks if t != g.tok.pad_token_id]
                    reason, n_out = "length", len(toks)
                    ids_out = list(toks)
                text = g.tok.decode(toks, skip_special_tokens=True)
                top = None
                if recorder is not None:
                    top = [
                        [(tid, None, lp) for tid, lp in zip(top_i[row][step], top_v[row][step], strict=True)]
                        for step in range(n_out)
                    ]
                out[i] = Completion(
                    text, reason, len(enc[i]), n_out, clock.latency(t0, end, n_out), top_logprobs=top, token_ids=ids_out
                )
                if on_result:
                    on_result(i, out[i])
            if progress:
                progress(len(idx) + len(too_long))
        return out  # type: ignore[return-value]  # every index was filled above
