"""Batched generation with a local ``transformers`` model (optionally 4-bit, optionally + LoRA).

Used by the ``transformers`` teacher backend and by evaluation. Prompts are bucketed by
length (sorted, then batched) so that left padding stays small; results come back in input
order. A prompt that does not fit the context with ``max_new_tokens`` is not generated: its
completion carries an error (a counted skip), the others go on. With ``logprobs=k`` each
completion carries the top-k log-probabilities of every generated token (raw model
distribution, captured by a logits processor as generation runs, so memory stays at
batch x k per step). Each completion's ``latency_s`` is measured per item: from the start of its
batch until its last token was chosen (a logits processor notes when each decoding step ends), so
a short answer in a batch of long ones is not charged the whole batch's time. The model runs on the GPU when torch sees one (``cuda``), else on the CPU
(:func:`default_device`); inputs go to the model's device and results come back to the CPU.
Prompts are rendered by :func:`campaign_orchestrator.dataset.formatting.render_prompt_ids`, the
function the dataset stage uses for training rows, so a model is asked exactly what it was
trained on: a string prompt is one user turn under the tokenizer's chat template (or ``[bos] +
prompt`` without one), a list of messages is the whole conversation (context distillation's
system prompt and few-shot turns). Generation stops at any of the generation config's stop ids
(EOS and, for chat models, the end-of-turn token). An adapter on an unquantized base is merged into
its weights once at load (generation then runs at the base's speed; on a 4-bit base it stays a PEFT
model, since merging would re-quantize). The tokenizer comes from the adapter
directory when the adapter carries one (the trainer copies the base's tokenizer, chat template
and generation config into it). The compute dtype is resolved for the device
(:mod:`campaign_orchestrator.hardware`, ``auto`` by default). Imports torch: load this module lazily.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from campaign_orchestrator import allocator
from campaign_orchestrator.dataset.formatting import render_prompt_ids
from campaign_orchestrator.hardware import Resolved, resolve_compute_dtype
from campaign_orchestrator.generation.completion import Completion

__all__ = ["Completion", "LocalGenerator", "Scored", "default_device", "load_model"]

_log = logging.getLogger(__name__)


@dataclass
class Scored:
    """Log-likelihood of a given continuation under the model (no generation): one entry per continuation
    token; ``top_logprobs`` (with ``top_k``) as :class:`Completion` carries them."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, None, float]]] | None = None
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def total(self) -> float:
        return float(sum(self.logprobs))


PREFIX_MIN_TOKENS = 32  # a shared prefix at least this long is prefilled once per call and reused by every batch
GROUP_PREFIX_MIN_TOKENS = 8  # continuous engine: prompts sharing at least this many first tokens share one prefill
ENGINES = ("auto", "continuous", "hf_generate")
ENGINE_ENV = "CAMPAIGN_GENERATION_ENGINE"  # a measurement switch: what ``auto`` resolves to in every LocalGenerator


def auto_engine(dtype: str | None) -> str:
    """The engine ``auto`` picks: the continuous engine for greedy requests, in every dtype.

    In fp32 its answers are token-identical to ``generate``'s. In bf16 no batched path is: an answer depends on
    the padding and on which prompts shared its batch, in either engine, as in any serving engine. Measured on
    campaigns/smollm2.yaml's evaluation prompts (2026-12-03, AVX512-BF16 CPU, docs/teacher.md), the continuous
    engine's bf16 answers agree with the model's fp32 answers *more* often than ``generate``'s (base plurals 104
    against 100 of 120, teacher plurals 118 against 117, general 117 against 115 of 150; the teacher's plural
    exact match 97 and 99, fp32 98). ``$CAMPAIGN_GENERATION_ENGINE`` (``continuous`` or ``hf_generate``)
    overrides the choice for a whole process tree (old-against-new wall times of a campaign run:
    docs/teacher.md). No cache key holds the engine: in fp32 it changes nothing, in bf16 the batch a prompt
    shared already does. ``dtype`` is kept for callers; it no longer changes the choice."""
    forced = os.environ.get(ENGINE_ENV, "").strip()
    if forced:
        if forced not in ENGINES[1:]:
            raise ValueError(f"${ENGINE_ENV}={forced!r} is unknown: set it to continuous or hf_generate, or unset it "
                             "(auto: continuous)")
        return forced
    return "continuous"


MAX_ROWS_PER_BUDGET = 4  # continuous engine: at most this many x batch_size rows decode together (short prompts)
# continuous engine: the key/value cache may always hold this many bytes, even when batch_size x (longest prompt
# + max_new_tokens) is less (short prompts: more rows share a decoding step, whose cost is mostly reading the weights)
MIN_CACHE_BYTES = 128 * 2**20


def prefix_groups(seqs: Sequence[list[int]], min_tokens: int = GROUP_PREFIX_MIN_TOKENS) -> list[tuple[list[int], int]]:
    """Indexes of ``seqs`` grouped by a shared prefix: ``[(indexes, prefix_length)]``. Sequences are
    sorted by their tokens; neighbours that share at least ``min_tokens`` first tokens join a group
    whose prefix is what all its members share (each keeps a token of its own). Sequences in no such
    group come back together with prefix 0, last."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and shared_prefix_length([seqs[groups[-1][-1]], seqs[i]]) >= min_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    out, rest = [], []
    for g in groups:
        if len(g) < 2:
            rest += g
            continue
        out.append((g, shared_prefix_length([seqs[i] for i in g])))
    if rest:
        out.append((rest, 0))
    return out


def shared_prefix_length(seqs: Sequence[list[int]]) -> int:
    """Tokens every sequence starts with (at most the shortest minus one: each keeps a token of its own)."""
    if len(seqs) < 2:
        return 0
    first, limit = seqs[0], min(len(s) for s in seqs) - 1
    n = 0
    while n < limit and all(s[n] == first[n] for s in seqs):
        n += 1
    return n


def default_device() -> str:
    """Where a local model runs unless told otherwise: ``cuda`` when torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


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


def load_model(model_dir: str | Path, adapter_dir: str | Path | None = None, load_in_4bit: bool = False,
               compute_dtype: str = "auto", device: str | None = None):
    """The model (on ``device``, default :func:`default_device`; eval mode, in the resolved compute
    dtype), its tokenizer (left padding; the adapter's when it carries one) and the dtype resolution.
    A 4-bit model is placed at load time (``device_map``), others are moved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    allocator.trim()  # a model released before this one (evaluation's roles, one after another) gives its pages back
    dev = torch.device(device or default_device())
    precision = resolve_compute_dtype(compute_dtype, dev.type)
    dt = getattr(torch, precision.dtype)
    kwargs: dict = {"dtype": dt}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dt, bnb_4bit_quant_storage=dt
        )
        if dev.type == "cuda":  # bitsandbytes weights are quantized where they land: load them on the GPU
            kwargs["device_map"] = {"": dev.index if dev.index is not None else torch.cuda.current_device()}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
        if not load_in_4bit:  # fold the adapter into the weights: same function, no extra LoRA matmuls per token
            model = model.merge_and_unload()
    if not load_in_4bit and dev.type != "cpu":
        model.to(dev)
    model.eval()
    _contiguous_head_input(model)
    tok_dir = adapter_dir if adapter_dir is not None and (Path(adapter_dir) / "tokenizer_config.json").exists() else model_dir
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok, precision


def _contiguous_head_input(model) -> None:
    """Hand the output projection a contiguous input. ``logits_to_keep=1`` gives it ``hidden[:, -1:, :]``, a
    strided view; with frozen weights (``requires_grad`` False, as after ``merge_and_unload``) ``torch.matmul``
    then takes its batched path and copies the whole weight once per row: prefilling 120 prompts with a merged
    adapter took 27.8 s and ~6.8 GB instead of 5.7 s (SmolLM2-135M, bf16, measured 2026-12-03). Same logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        head.register_forward_pre_hook(lambda _m, args: (args[0].contiguous(), *args[1:]) if args else args)


def stop_token_ids(model, tok) -> list[int]:
    """The ids generation stops at: the generation config's ``eos_token_id`` (one or a list) and the tokenizer's EOS."""
    cfg = getattr(model, "generation_config", None)
    ids = getattr(cfg, "eos_token_id", None) if cfg is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


_SLAB: type | None = None


def _slab_layer_class() -> type:
    """A ``DynamicLayer`` whose keys and values are views ``[:, :, :n]`` of buffers with ``room`` positions to
    spare: a decoding step writes its one position in place instead of concatenating (copying) the whole cache,
    as ``DynamicLayer.update`` does every step. Same numbers (the views hold what the concatenation would)."""
    global _SLAB
    if _SLAB is None:
        from transformers.cache_utils import DynamicLayer as base

        class SlabLayer(base):
            def __init__(self, keys, values, room: int):
                super().__init__()
                self._alloc(keys.shape[0], keys.shape[1], keys.shape[2] + room, keys.shape[3], keys)
                self._k[:, :, :keys.shape[2]] = keys
                self._v[:, :, :keys.shape[2]] = values
                self._set_length(keys.shape[2])

            @classmethod
            def joined(cls, keys: tuple, values: tuple, room: int):
                """One layer of rows ``keys[0]`` then rows ``keys[1]`` (same length), written into the buffer
                directly (no concatenated copy first)."""
                self = cls.__new__(cls)
                base.__init__(self)
                (ka, kb), (va, vb) = keys, values
                rows, t = ka.shape[0] + kb.shape[0], ka.shape[2]
                self._alloc(rows, ka.shape[1], t + room, ka.shape[3], ka)
                for buf, a, b in ((self._k, ka, kb), (self._v, va, vb)):
                    buf[:a.shape[0], :, :t] = a
                    buf[a.shape[0]:, :, :t] = b
                self._set_length(t)
                return self

            def _alloc(self, rows, heads, capacity, dim, like):
                self._k = like.new_empty((rows, heads, capacity, dim))
                self._v = like.new_empty((rows, heads, capacity, dim))
                self.dtype, self.device, self.is_initialized = like.dtype, like.device, True

            def _set_length(self, n: int):
                self.n = n
                self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

            def update(self, key_states, value_states, *args, **kwargs):
                q = key_states.shape[-2]
                if self.n + q > self._k.shape[2]:  # out of room: grow (one copy), rarely
                    keys, values = self.keys, self.values
                    self._alloc(keys.shape[0], keys.shape[1], 2 * (self.n + q), keys.shape[3], keys)
                    self._k[:, :, :self.n] = keys
                    self._v[:, :, :self.n] = values
                self._k[:, :, self.n:self.n + q] = key_states
                self._v[:, :, self.n:self.n + q] = value_states
                self._set_length(self.n + q)
                return self.keys, self.values

        _SLAB = SlabLayer
    return _SLAB


class LocalGenerator:
    """Generate completions for many prompts with one loaded model."""

    def __init__(self, model, tokenizer, batch_size: int = 64, precision: Resolved | None = None,
                 engine: str = "auto", max_batch_tokens: int | None = None,
                 log: Callable[[str], None] | None = None):
        if engine not in ENGINES:
            raise ValueError(f"LocalGenerator engine {engine!r} is unknown: use one of {', '.join(ENGINES)}")
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        if engine == "auto":
            dtype = precision.dtype if precision is not None else str(getattr(model, "dtype", "")).removeprefix("torch.")
            engine = auto_engine(dtype or None)
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens  # None: batch_size x (longest prompt + max_new_tokens) of the call
        self.log = log  # progress lines (prompts/s, tokens/s) of the continuous engine
        self.last_stats: dict = {}
        self._continuous_ok: bool | None = None
        self._cache_kw: str | None = None
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        self.precision = precision
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.prefix_caching = True  # reuse the key/value cache of a prefix every prompt of a call shares
        self.last_shared_prefix = 0

    @classmethod
    def from_path(cls, model_dir, adapter_dir=None, load_in_4bit=False, compute_dtype="auto", batch_size=64,
                  device=None, engine: str = "auto", max_batch_tokens: int | None = None):
        model, tok, precision = load_model(model_dir, adapter_dir, load_in_4bit, compute_dtype, device)
        return cls(model, tok, batch_size, precision, engine=engine, max_batch_tokens=max_batch_tokens)

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (and so where its inputs must go)."""
        dev = getattr(self.model, "device", None)
        return dev if isinstance(dev, torch.device) else next(self.model.parameters()).device

    def _batch_inputs(self, seqs: Sequence[list[int]], width: int, prefix: Sequence[int] = ()
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input ids and attention mask for ``seqs``, on the model's device. With a shared
        ``prefix`` (removed from ``seqs``) each row is ``[prefix][pad][rest]``: the prefix's cached keys stay
        at positions 0..P-1, and positions come from the mask, so every row computes what it would alone."""
        p = len(prefix)
        ids = torch.full((len(seqs), p + width), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), p + width), dtype=torch.long)
        if p:
            ids[:, :p] = torch.tensor(list(prefix))
            mask[:, :p] = 1
        for row, s in enumerate(seqs):
            ids[row, p + width - len(s):] = torch.tensor(s)
            mask[row, p + width - len(s):] = 1
        dev = self.device
        return ids.to(dev), mask.to(dev)  # built on the CPU, copied once

    def _prefix_cache(self, prefix: list[int]):
        """The key/value cache of ``prefix`` (one forward pass), or None when the model cannot reuse one."""
        from transformers import DynamicCache

        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([prefix], device=self.device), use_cache=True)
        cache = out.past_key_values
        return cache if isinstance(cache, DynamicCache) and hasattr(cache, "batch_repeat_interleave") else None

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str | Sequence[dict]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
        logprobs: int | None = None,
        on_result: Callable[[int, Completion], None] | None = None,
    ) -> list[Completion]:
        """One completion per prompt (a string, or a list of chat messages), in input order.
        ``on_result(i, completion)`` is called as each batch finishes (``i`` indexes ``prompts``);
        ``progress(n)`` after each batch (the continuous engine: as prompts finish).

        Greedy requests run on the continuous engine (:meth:`_generate_continuous`) when ``engine`` is
        ``continuous`` (``auto``, the default, picks it in fp32: :func:`auto_engine`); sampling (``temperature > 0``) always runs on ``transformers``'
        ``generate`` (its seeds and random stream are kept as they were)."""
        enc = [render_prompt_ids(self.tok, p) for p in prompts]
        try:
            if self.engine == "continuous" and temperature <= 0 and self._supports_continuous():
                return self._generate_continuous(enc, max_new_tokens, progress, logprobs, on_result)
            return self._generate_hf(prompts, enc, max_new_tokens, temperature, top_p, seed, progress, logprobs,
                                     on_result)
        finally:  # the call's key/value caches are gone: their pages go back, not into the next model's peak
            allocator.trim(collect=False)

    def _generate_hf(self, prompts, enc, max_new_tokens, temperature, top_p, seed, progress, logprobs, on_result):
        """The ``transformers`` ``generate`` path: length-sorted batches of ``batch_size`` rows, each decoded
        until its longest answer ends, one shared prefix per call prefilled once."""
        from transformers import LogitsProcessorList

        import copy

        fits = [e for e in enc if not self.context_length or len(e) + max_new_tokens <= self.context_length]
        shared = shared_prefix_length(fits) if self.prefix_caching else 0
        prefix, prefix_cache = (enc and fits and fits[0][:shared]) or [], None
        if shared >= PREFIX_MIN_TOKENS:  # a teacher's context, a few-shot header: prefill it once for the whole call
            prefix_cache = self._prefix_cache(prefix)
        if prefix_cache is None:
            prefix = []
        self.last_shared_prefix = len(prefix)
        order = sorted(range(len(prompts)), key=lambda i: len(enc[i]))
        out: list[Completion | None] = [None] * len(prompts)
        stops = set(self.stop_ids)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            too_long = [i for i in idx if self.context_length and len(enc[i]) + max_new_tokens > self.context_length]
            for i in too_long:
                out[i] = Completion.failed(f"prompt of {len(enc[i])} tokens + {max_new_tokens} new tokens exceeds the "
                                           f"teacher's context of {self.context_length}", len(enc[i]))
                if on_result:
                    on_result(i, out[i])
            idx = [i for i in idx if i not in too_long]
            if not idx:
                if progress and too_long:
                    progress(len(too_long))
                continue
            p = len(prefix)
            width = max(len(enc[i]) - p for i in idx)
            ids, mask = self._batch_inputs([enc[i][p:] for i in idx], width, prefix)
            width += p
            gen_kwargs: dict = {"max_new_tokens": max_new_tokens, "pad_token_id": self.tok.pad_token_id,
                                "eos_token_id": list(self.stop_ids)}
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
            seqs = self.model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
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
                    toks = [t for t in toks if t != self.tok.pad_token_id]
                    reason, n_out = "length", len(toks)
                    ids_out = list(toks)
                text = self.tok.decode(toks, skip_special_tokens=True)
                top = None
                if recorder is not None:
                    top = [[(tid, None, lp) for tid, lp in zip(top_i[row][step], top_v[row][step], strict=True)]
                           for step in range(n_out)]
                out[i] = Completion(text, reason, len(enc[i]), n_out, clock.latency(t0, end, n_out), top_logprobs=top,
                                    token_ids=ids_out)
                if on_result:
                    on_result(i, out[i])
            if progress:
                progress(len(idx) + len(too_long))
        return out  # type: ignore[return-value]  # every index was filled above

    # ------------------------------------------------------------------ the continuous engine

    def _supports_continuous(self) -> bool:
        """Whether the model's cache is a plain :class:`DynamicCache` of full-attention layers (rows can
        be dropped, padded and joined); other models (sliding windows, recurrent states) use ``generate``."""
        if self._continuous_ok is None:
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer

            try:
                with torch.no_grad():
                    _, cache = self._forward(None, input_ids=torch.tensor([[self.tok.pad_token_id]], device=self.device))
                self._continuous_ok = (isinstance(cache, DynamicCache) and len(cache.layers) > 0
                                       and all(type(layer) is DynamicLayer for layer in cache.layers))
            except Exception:  # a model that cannot be driven step by step: stay on generate
                self._continuous_ok = False
        return self._continuous_ok

    def _cache_bytes_per_token(self) -> int:
        """Bytes one token of one row takes in the key/value cache (keys and values of every layer)."""
        cfg = self.model.config
        get = getattr(cfg, "get_text_config", None)
        cfg = get(decoder=True) if get else cfg
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        size = next(self.model.parameters()).element_size()
        return max(1, 2 * cfg.num_hidden_layers * heads * dim * size)

    def _forward(self, cache, **kw):
        """The model's forward with ``cache`` passed under the name this transformers version takes; returns
        (float32 logits of the last position, the cache)."""
        if self._cache_kw is None:
            import inspect

            self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        o = self.model(**kw, **{self._cache_kw: cache}, use_cache=True)
        new = getattr(o, "past_key_values", None)
        if new is None:
            new = getattr(o, "cache", None)
        return o.logits[:, -1, :].float(), new

    def _prefill(self, seqs: Sequence[list[int]], prefix: list[int], prefix_cache):
        """One forward pass over new prompts (``[prefix][pad][rest]`` rows, the prefix from its cache):
        the last position's float32 logits, the cache and the attention mask."""
        import copy

        p = len(prefix) if prefix_cache is not None else 0
        width = max(len(s) - p for s in seqs)
        ids, mask = self._batch_inputs([s[p:] for s in seqs], width, prefix[:p])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = None
        if prefix_cache is not None:
            cache = copy.deepcopy(prefix_cache)
            cache.batch_repeat_interleave(len(seqs))
        logits, cache = self._forward(cache, input_ids=ids[:, p:], attention_mask=mask, position_ids=pos[:, p:],
                                      logits_to_keep=1)
        return logits, cache, mask

    @staticmethod
    def _join(cache, mask, new_cache, new_mask, room: int = 0):
        """The rows of ``new_cache`` appended to ``cache``: the shorter side left-padded (masked) to the other's
        length; each layer becomes a slab layer (:func:`_slab_layer_class`) with ``room`` free positions (one layer at a time)."""
        t, tn, slab = mask.shape[1], new_mask.shape[1], _slab_layer_class()
        for n, (a, b) in enumerate(zip(cache.layers, new_cache.layers, strict=True)):
            kv = []
            for name in ("keys", "values"):
                x, y = getattr(a, name), getattr(b, name)
                if tn < t:
                    y = torch.nn.functional.pad(y, (0, 0, t - tn, 0))
                elif t < tn:
                    x = torch.nn.functional.pad(x, (0, 0, tn - t, 0))
                kv.append((x, y))
            cache.layers[n] = slab.joined(kv[0], kv[1], room)
        if tn < t:
            new_mask = torch.nn.functional.pad(new_mask, (t - tn, 0))
        elif t < tn:
            mask = torch.nn.functional.pad(mask, (tn - t, 0))
        return cache, torch.cat([mask, new_mask], dim=0)

    @staticmethod
    def _keep(cache, mask, keep: torch.Tensor, room: int = 0):
        """Only the rows ``keep`` of the cache and mask, less the leading columns no kept row attends to; each
        layer becomes a slab layer (:func:`_slab_layer_class`) with ``room`` free positions (one layer at a time)."""
        mask = mask.index_select(0, keep)
        first, slab = int(mask.any(0).to(torch.int8).argmax()), _slab_layer_class()
        for n, layer in enumerate(cache.layers):
            cache.layers[n] = slab(layer.keys[:, :, first:].index_select(0, keep),
                                         layer.values[:, :, first:].index_select(0, keep), room)
        return cache, mask[:, first:]

    @staticmethod
    def _slab(cache, room: int):
        """``cache`` with every layer a slab layer (:func:`_slab_layer_class`, ``room`` free positions)."""
        slab = _slab_layer_class()
        for n, layer in enumerate(cache.layers):
            cache.layers[n] = slab(layer.keys, layer.values, room)
        return cache

    @torch.no_grad()
    def _generate_continuous(self, enc, max_new_tokens, progress, logprobs, on_result) -> list[Completion]:
        """Greedy decoding over the model's forward with a :class:`DynamicCache`: prompts grouped by a shared
        prefix (its cache prefilled once per group), then, per group, length-sorted prompts are admitted while
        the batch has rows and tokens to spare (``batch_size`` x ``MAX_ROWS_PER_BUDGET`` rows, ``max_batch_tokens``
        of prompt + new tokens); each row stops at its own stop id or ``max_new_tokens`` and leaves the batch at
        once (its cache rows are dropped), and waiting prompts take the freed room. A completion's
        ``latency_s`` runs from its admission to its last token."""
        n = len(enc)
        out: list[Completion | None] = [None] * n
        fits = []
        for i, e in enumerate(enc):
            if self.context_length and len(e) + max_new_tokens > self.context_length:
                out[i] = Completion.failed(f"prompt of {len(e)} tokens + {max_new_tokens} new tokens exceeds the "
                                           f"teacher's context of {self.context_length}", len(e))
                if on_result:
                    on_result(i, out[i])
            else:
                fits.append(i)
        if progress and len(fits) < n:
            progress(n - len(fits))
        stats = {"prompts": 0, "new_tokens": 0, "forward_passes": 0, "prefills": 0, "wall_s": 0.0}
        self.last_stats = stats
        if not fits:
            return out  # type: ignore[return-value]
        floor = MIN_CACHE_BYTES // self._cache_bytes_per_token()
        max_rows = self.batch_size * MAX_ROWS_PER_BUDGET
        stops = set(self.stop_ids)
        t_call = time.perf_counter()
        self.last_shared_prefix = 0
        last_log = [t_call]

        def report(force=False):
            now = time.perf_counter()
            stats["wall_s"] = now - t_call
            if force or now - last_log[0] >= 10.0:
                last_log[0] = now
                el = max(stats["wall_s"], 1e-9)
                (self.log or _log.info)(f"generated {stats['prompts']}/{len(fits)} prompts, {stats['new_tokens']} tokens in "
                         f"{el:.1f} s: {stats['prompts'] / el:.2f} prompts/s, {stats['new_tokens'] / el:.1f} tokens/s")

        groups = prefix_groups([enc[i] for i in fits])
        for members, shared in groups:
            idx = [fits[j] for j in members]
            prefix, prefix_cache = [], None
            if self.prefix_caching and shared >= GROUP_PREFIX_MIN_TOKENS:
                prefix = enc[idx[0]][:shared]
                prefix_cache = self._prefix_cache(prefix)
                stats["forward_passes"] += 1
                if prefix_cache is None:
                    prefix = []
            self.last_shared_prefix = max(self.last_shared_prefix, len(prefix))
            # rows that repeat a long shared prefix (a teacher's few-shot context) in their cache: batch_size rows,
            # as generate takes; more would fill the room with copies of the prefix, not with answers
            group_rows = self.batch_size if len(prefix) >= PREFIX_MIN_TOKENS else max_rows
            # the group's own longest prompt sizes its room (a call's few long context prompts do not widen it)
            budget = self.max_batch_tokens or max(self.batch_size * (max(len(enc[i]) for i in idx) + max_new_tokens),
                                                  floor)
            queue = sorted(idx, key=lambda i: len(enc[i]))[::-1]  # pop() takes the shortest
            rows: list[int] = []  # prompt index per batch row
            gen: list[list[int]] = []
            tops: list[list] = []
            t_in: list[float] = []
            cache = mask = pos = last = None
            used = 0  # prompt + max_new_tokens over the rows in the batch
            while queue or rows:
                take: list[int] = []
                # refill once a quarter of the room is free (one prefill admits many prompts)
                if queue and (not rows or (len(rows) <= group_rows - max(1, self.batch_size // 4)
                                           and used <= budget - budget // 4)):
                    while queue and len(rows) + len(take) < group_rows:
                        cost = len(enc[queue[-1]]) + max_new_tokens
                        if (rows or take) and used + cost > budget:
                            break
                        take.append(queue.pop())
                        used += cost
                t0 = time.perf_counter()
                if take:  # admit: prefill the new prompts, join their cache rows to the batch
                    logits, new_cache, new_mask = self._prefill([enc[i] for i in take], prefix, prefix_cache)
                    stats["prefills"] += 1
                    new_pos = new_mask.sum(-1)
                    if cache is None:
                        cache, mask, pos = self._slab(new_cache, max_new_tokens), new_mask, new_pos
                    else:
                        cache, mask = self._join(cache, mask, new_cache, new_mask, max_new_tokens)
                        pos = torch.cat([pos, new_pos])
                    first_new = len(rows)
                    rows += take
                    gen += [[] for _ in take]
                    tops += [[] for _ in take]
                    t_in += [t0] * len(take)
                    chosen_rows = range(first_new, len(rows))
                else:  # one decoding step for every row
                    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
                    logits, cache = self._forward(cache, input_ids=last[:, None], attention_mask=mask,
                                                  position_ids=pos[:, None])
                    pos = pos + 1
                    chosen_rows = range(len(rows))
                stats["forward_passes"] += 1
                nxt = logits.argmax(-1)
                if logprobs:
                    tv, ti = torch.log_softmax(logits, dim=-1).topk(min(logprobs, logits.shape[-1]), dim=-1)
                    tv, ti = tv.cpu().tolist(), ti.cpu().tolist()
                now = time.perf_counter()
                nxt_l = nxt.cpu().tolist()
                if take:
                    last = nxt if last is None else torch.cat([last, nxt])
                else:
                    last = nxt
                done = []
                for j, r in enumerate(chosen_rows):
                    t = nxt_l[j]
                    gen[r].append(t)
                    if logprobs:
                        tops[r].append([(tid, None, lp) for tid, lp in zip(ti[j], tv[j], strict=True)])
                    if t in stops or len(gen[r]) >= max_new_tokens:
                        done.append(r)
                for r in done:
                    i, toks = rows[r], gen[r]
                    stopped = toks[-1] in stops
                    text = self.tok.decode(toks[:-1] if stopped else toks, skip_special_tokens=True)
                    out[i] = Completion(text, "stop" if stopped else "length", len(enc[i]), len(toks), now - t_in[r],
                                        top_logprobs=tops[r] if logprobs else None, token_ids=list(toks))
                    used -= len(enc[i]) + max_new_tokens
                    stats["prompts"] += 1
                    stats["new_tokens"] += len(toks)
                    if on_result:
                        on_result(i, out[i])
                if done:
                    gone = set(done)
                    keep_l = [r for r in range(len(rows)) if r not in gone]
                    if progress:
                        progress(len(done))
                    if not keep_l:
                        rows, gen, tops, t_in, cache, mask, pos, last = [], [], [], [], None, None, None, None
                    else:
                        keep = torch.tensor(keep_l, device=mask.device)
                        cache, mask = self._keep(cache, mask, keep, max_new_tokens)
                        pos, last = pos.index_select(0, keep), last.index_select(0, keep)
                        rows = [rows[r] for r in keep_l]
                        gen = [gen[r] for r in keep_l]
                        tops = [tops[r] for r in keep_l]
                        t_in = [t_in[r] for r in keep_l]
                    report()
        report(force=True)
        return out  # type: ignore[return-value]  # every index was filled above

    # ------------------------------------------------------------------ log-likelihood without generation

    @torch.no_grad()
    def score(self, prompts: Sequence[str | Sequence[dict]], continuations: Sequence[str | Sequence[int]],
              top_k: int | None = None) -> list[Scored]:
        """Per-token log-probabilities of each continuation (text, appended to the rendered prompt, or token
        ids) given its prompt, from one forward pass per batch (length-sorted, left-padded, ``batch_size``
        rows); with ``top_k`` also the top-k of every position. Results in input order; a pair that does not
        fit the context is not scored (``error`` set)."""
        if len(prompts) != len(continuations):
            raise ValueError(f"score() takes one continuation per prompt: got {len(prompts)} prompts and "
                             f"{len(continuations)} continuations")
        enc = [render_prompt_ids(self.tok, p) for p in prompts]
        cont = [list(c) if not isinstance(c, str) else self.tok(c, add_special_tokens=False)["input_ids"]
                for c in continuations]
        out: list[Scored | None] = [None] * len(prompts)
        todo = []
        for i, (e, c) in enumerate(zip(enc, cont, strict=True)):
            if self.context_length and len(e) + len(c) > self.context_length:
                out[i] = Scored(c, [], None, len(e), f"prompt of {len(e)} tokens + continuation of {len(c)} tokens "
                                                     f"exceeds the model's context of {self.context_length}")
            elif not c:
                out[i] = Scored([], [], [] if top_k else None, len(e))
            else:
                todo.append(i)
        todo.sort(key=lambda i: len(enc[i]) + len(cont[i]))
        for start in range(0, len(todo), self.batch_size):
            idx = todo[start:start + self.batch_size]
            full = [enc[i] + cont[i] for i in idx]
            width = max(len(f) for f in full)
            ids, mask = self._batch_inputs(full, width)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            n_c = max(len(cont[i]) for i in idx)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                                logits_to_keep=n_c + 1).logits.float()  # the last n_c + 1 positions
            lp = torch.log_softmax(logits[:, :-1], dim=-1)  # position t predicts token t + 1
            for row, i in enumerate(idx):
                c = cont[i]
                rows_lp = lp[row, n_c - len(c):]  # the continuation's predicting positions
                tgt = torch.tensor(c, device=rows_lp.device)
                vals = rows_lp.gather(-1, tgt[:, None])[:, 0].cpu().tolist()
                top = None
                if top_k:
                    tv, ti = rows_lp.topk(min(top_k, rows_lp.shape[-1]), dim=-1)
                    top = [[(t, None, v) for t, v in zip(a, b, strict=True)]
                           for a, b in zip(ti.cpu().tolist(), tv.cpu().tolist(), strict=True)]
                out[i] = Scored(list(c), vals, top, len(enc[i]))
        return out  # type: ignore[return-value]
