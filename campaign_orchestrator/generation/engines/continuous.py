"""The continuous greedy engine: the model's forward over a ``DynamicCache``, rows that leave and join.

Prompts are grouped by a shared prefix (its cache prefilled once per group); per group, length-sorted prompts are
admitted while the batch has rows and tokens to spare; each row stops at its own stop id or ``max_new_tokens`` and
leaves the batch at once, and waiting prompts take the freed room. In fp32 its answers are token-identical to
``generate``'s (tests/campaign_orchestrator/generation/test_local_engine.py).

Tuned on CPUs, where it is the fastest engine (benchmarks/generation_speed.py): a finished row's leaving copies
every layer's cache once (:meth:`ContinuousEngine._keep`), each step reads the chosen tokens back to the host and
loops over the rows in Python, and late rows are left-padded. On a GPU those costs dominate a real model's step,
so it is not a candidate there (:attr:`devices`): transformers' paged ``generate_batch``, ``generate`` and vLLM
are (:mod:`campaign_orchestrator.generation.auto`). Imports torch: load lazily.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from campaign_orchestrator.generation.completion import Completion
from campaign_orchestrator.generation.engines.common import GROUP_PREFIX_MIN_TOKENS, prefix_groups

_log = logging.getLogger("campaign_orchestrator.generation.local")

PREFIX_MIN_TOKENS = 32  # a shared prefix at least this long: the group decodes batch_size rows, as generate takes
MAX_ROWS_PER_BUDGET = 4  # at most this many x batch_size rows decode together (short prompts)
# the key/value cache may always hold this many bytes, even when batch_size x (longest prompt + max_new_tokens) is
# less (short prompts: more rows share a decoding step, whose cost is mostly reading the weights)
MIN_CACHE_BYTES = 128 * 2**20


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
                self._k[:, :, : keys.shape[2]] = keys
                self._v[:, :, : keys.shape[2]] = values
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
                    buf[: a.shape[0], :, :t] = a
                    buf[a.shape[0] :, :, :t] = b
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
                    self._k[:, :, : self.n] = keys
                    self._v[:, :, : self.n] = values
                self._k[:, :, self.n : self.n + q] = key_states
                self._v[:, :, self.n : self.n + q] = value_states
                self._set_length(self.n + q)
                return self.keys, self.values

        _SLAB = SlabLayer
    return _SLAB


class ContinuousEngine:
    """The continuous greedy engine over ``gen`` (a :class:`~campaign_orchestrator.generation.local.LocalModel`:
    its model, tokenizer, batch settings; ``gen.last_stats`` and ``gen.last_shared_prefix`` report each call)."""

    name = "continuous"
    top_logprobs = True
    devices = ("cpu",)

    def __init__(self, gen):
        self.g = gen
        self._ok: bool | None = None
        self._cache_kw: str | None = None

    def unavailable(self) -> str | None:
        if not self._supports_continuous():
            return "the model's cache is not a plain DynamicCache of full-attention layers"
        return None

    def generate(self, enc, max_new_tokens, logprobs=None, progress=None, on_result=None) -> list[Completion]:
        return self._generate_continuous(enc, max_new_tokens, progress, logprobs, on_result)

    def _supports_continuous(self) -> bool:
        """Whether the model's cache is a plain :class:`DynamicCache` of full-attention layers (rows can
        be dropped, padded and joined); other models (sliding windows, recurrent states) use ``generate``."""
        g = self.g
        if self._ok is None:
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer

            try:
                with torch.no_grad():
                    _, cache = self._forward(None, input_ids=torch.tensor([[g.tok.pad_token_id]], device=g.device))
                self._ok = (
                    isinstance(cache, DynamicCache)
                    and len(cache.layers) > 0
                    and all(type(layer) is DynamicLayer for layer in cache.layers)
                )
            except Exception:  # a model that cannot be driven step by step: stay on generate
                self._ok = False
        return self._ok

    def _cache_bytes_per_token(self) -> int:
        """Bytes one token of one row takes in the key/value cache (keys and values of every layer)."""
        return self.g.cache_bytes_per_token()

    def _forward(self, cache, **kw):
        """The model's forward with ``cache`` passed under the name this transformers version takes; returns
        (float32 logits of the last position, the cache)."""
        g = self.g
        if self._cache_kw is None:
            import inspect

            self._cache_kw = "cache" if "cache" in inspect.signature(g.model.forward).parameters else "past_key_values"
        o = g.model(**kw, **{self._cache_kw: cache}, use_cache=True)
        new = getattr(o, "past_key_values", None)
        if new is None:
            new = getattr(o, "cache", None)
        return o.logits[:, -1, :].float(), new

    def _prefill(self, seqs: Sequence[list[int]], prefix: list[int], prefix_cache):
        """One forward pass over new prompts (``[prefix][pad][rest]`` rows, the prefix from its cache):
        the last position's float32 logits, the cache and the attention mask."""
        g = self.g
        import copy

        p = len(prefix) if prefix_cache is not None else 0
        width = max(len(s) - p for s in seqs)
        ids, mask = g._batch_inputs([s[p:] for s in seqs], width, prefix[:p])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = None
        if prefix_cache is not None:
            cache = copy.deepcopy(prefix_cache)
            cache.batch_repeat_interleave(len(seqs))
        logits, cache = self._forward(
            cache, input_ids=ids[:, p:], attention_mask=mask, position_ids=pos[:, p:], logits_to_keep=1
        )
        return logits, cache, mask

    @staticmethod
    def _join(cache, mask, new_cache, new_mask, room: int = 0):
        """The rows of ``new_cache`` appended to ``cache``: the shorter side left-padded (masked) to the other's
        length; each layer becomes a slab layer (:func:`_slab_layer_class`) with ``room`` free positions (one layer
        at a time)."""
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
            cache.layers[n] = slab(
                layer.keys[:, :, first:].index_select(0, keep), layer.values[:, :, first:].index_select(0, keep), room
            )
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
        g = self.g
        n = len(enc)
        out: list[Completion | None] = [None] * n
        fits = []
        for i, e in enumerate(enc):
            if g.context_length and len(e) + max_new_tokens > g.context_length:
                out[i] = Completion.failed(
                    f"prompt of {len(e)} tokens + {max_new_tokens} new tokens exceeds the "
                    f"teacher's context of {g.context_length}",
                    len(e),
                )
                if on_result:
                    on_result(i, out[i])
            else:
                fits.append(i)
        if progress and len(fits) < n:
            progress(n - len(fits))
        stats = {"prompts": 0, "new_tokens": 0, "forward_passes": 0, "prefills": 0, "wall_s": 0.0}
        g.last_stats = stats
        if not fits:
            return out  # type: ignore[return-value]
        floor = MIN_CACHE_BYTES // self._cache_bytes_per_token()
        max_rows = g.batch_size * MAX_ROWS_PER_BUDGET
        stops = set(g.stop_ids)
        t_call = time.perf_counter()
        g.last_shared_prefix = 0
        last_log = [t_call]

        def report(force=False):
            now = time.perf_counter()
            stats["wall_s"] = now - t_call
            if force or now - last_log[0] >= 10.0:
                last_log[0] = now
                el = max(stats["wall_s"], 1e-9)
                (g.log or _log.info)(
                    f"generated {stats['prompts']}/{len(fits)} prompts, {stats['new_tokens']} "
                    f"tokens in {el:.1f} s: {stats['prompts'] / el:.2f} prompts/s, "
                    f"{stats['new_tokens'] / el:.1f} tokens/s"
                )

        groups = prefix_groups([enc[i] for i in fits])
        for members, shared in groups:
            idx = [fits[j] for j in members]
            prefix, prefix_cache = [], None
            if g.prefix_caching and shared >= GROUP_PREFIX_MIN_TOKENS:
                prefix = enc[idx[0]][:shared]
                prefix_cache = g._prefix_cache(prefix)
                stats["forward_passes"] += 1
                if prefix_cache is None:
                    prefix = []
            g.last_shared_prefix = max(g.last_shared_prefix, len(prefix))
            # rows that repeat a long shared prefix (a teacher's few-shot context) in their cache: batch_size rows,
            # as generate takes; more would fill the room with copies of the prefix, not with answers
            group_rows = g.batch_size if len(prefix) >= PREFIX_MIN_TOKENS else max_rows
            # the group's own longest prompt sizes its room (a call's few long context prompts do not widen it)
            budget = g.max_batch_tokens or max(g.batch_size * (max(len(enc[i]) for i in idx) + max_new_tokens), floor)
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
                if queue and (
                    not rows or (len(rows) <= group_rows - max(1, g.batch_size // 4) and used <= budget - budget // 4)
                ):
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
                    logits, cache = self._forward(
                        cache, input_ids=last[:, None], attention_mask=mask, position_ids=pos[:, None]
                    )
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
                    text = g.tok.decode(toks[:-1] if stopped else toks, skip_special_tokens=True)
                    out[i] = Completion(
                        text,
                        "stop" if stopped else "length",
                        len(enc[i]),
                        len(toks),
                        now - t_in[r],
                        top_logprobs=tops[r] if logprobs else None,
                        token_ids=list(toks),
                    )
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
