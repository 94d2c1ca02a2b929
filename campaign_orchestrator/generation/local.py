"""Batched generation with a local ``transformers`` model (optionally 4-bit, optionally + LoRA): the
:class:`LocalModel` every stage answers prompts with, over the engines of
:mod:`campaign_orchestrator.generation.engines` (one module each), ``auto`` choosing among them by a measured
probe (:mod:`campaign_orchestrator.generation.auto`).

Used by the ``transformers`` teacher backend, evaluation, drift and on-policy sampling. Prompts are bucketed by
length (sorted, then batched) so that left padding stays small; results come back in input
order. A prompt that does not fit the context with ``max_new_tokens`` is not generated: its
completion carries an error (a counted skip), the others go on. With ``logprobs=k`` each
completion carries the top-k log-probabilities of every generated token (raw model
distribution, captured by a logits processor as generation runs, so memory stays at
batch x k per step). Each completion's ``latency_s`` is measured per item: from the start of its
batch until its last token was chosen (a logits processor notes when each decoding step ends), so
a short answer in a batch of long ones is not charged the whole batch's time. The model runs on the GPU when torch sees
one (``cuda``), else on the CPU
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from campaign_orchestrator import allocator
from campaign_orchestrator.dataset.formatting import render_prompt_ids
from campaign_orchestrator.generation.completion import Completion
from campaign_orchestrator.generation.engines import ENGINE_MODULES, engine_class
from campaign_orchestrator.generation.engines.common import (  # noqa: F401 - the names callers import from here
    GROUP_PREFIX_MIN_TOKENS,
    prefix_groups,
    shared_prefix_length,
)
from campaign_orchestrator.hardware import Resolved, resolve_compute_dtype

__all__ = ["Completion", "LocalModel", "Scored", "default_device", "load_model"]

_log = logging.getLogger(__name__)


@dataclass
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
ENGINES = ("auto", *ENGINE_MODULES)
ENGINE_ENV = "CAMPAIGN_GENERATION_ENGINE"  # a measurement switch: what ``auto`` resolves to in every LocalModel


def forced_engine() -> str | None:
    """The engine ``$CAMPAIGN_GENERATION_ENGINE`` names for every ``auto`` generator of the process tree, or None."""
    forced = os.environ.get(ENGINE_ENV, "").strip()
    if not forced:
        return None
    if forced not in ENGINES[1:]:
        raise ValueError(
            f"${ENGINE_ENV}={forced!r} is unknown: set it to one of {', '.join(ENGINES[1:])}, or "
            "unset it (auto: the engine measured fastest here)"
        )
    return forced


def default_device() -> str:
    """Where a local model runs unless told otherwise: ``cuda`` when torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    model_dir: str | Path,
    adapter_dir: str | Path | None = None,
    load_in_4bit: bool = False,
    compute_dtype: str = "auto",
    device: str | None = None,
):
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
    tok_dir = (
        adapter_dir if adapter_dir is not None and (Path(adapter_dir) / "tokenizer_config.json").exists() else model_dir
    )
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok, precision


def _contiguous_head_input(model) -> None:
    """Hand the output projection a contiguous input. ``logits_to_keep=1`` gives it ``hidden[:, -1:, :]``, a
    strided view; with frozen weights (``requires_grad`` False, as after ``merge_and_unload``) ``torch.matmul``
    then takes its batched path and copies the whole weight once per row (docs/results.md, "Measurements behind
    code defaults", has the prefill it cost). Same logits."""
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


class LocalModel:
    """Generate completions for many prompts with one loaded model.

    ``engine``: ``auto`` (the default: the fastest engine measured for this host, device, dtype and model shape
    that serves the request, :func:`campaign_orchestrator.generation.auto.choose`), or one of
    :data:`ENGINES` by name. Sampled requests (``temperature > 0``) always run on ``generate`` (its seeds and
    random stream are the project's); a request for top-k log-probabilities never runs on an engine that cannot
    return them (``generate_batch``): it runs on ``generate`` instead. ``source``: the checkpoint and adapter
    directories the model was loaded from (:meth:`from_path` sets it; the vLLM engine loads from them)."""

    def __init__(
        self,
        model,
        tokenizer,
        batch_size: int = 64,
        precision: Resolved | None = None,
        engine: str = "auto",
        max_batch_tokens: int | None = None,
        log: Callable[[str], None] | None = None,
        source: tuple | None = None,
        load_in_4bit: bool = False,
    ):
        if engine not in ENGINES:
            raise ValueError(f"LocalModel engine {engine!r} is unknown: use one of {', '.join(ENGINES)}")
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        self.setting = engine
        self.max_batch_tokens = max_batch_tokens  # None: batch_size x (longest prompt + max_new_tokens) of the call
        self.log = log  # progress lines (prompts/s, tokens/s) of the continuous engine, auto's choice
        self.last_stats: dict = {}
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        self.precision = precision
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.prefix_caching = True  # reuse the key/value cache of a prefix every prompt of a call shares
        self.last_shared_prefix = 0
        self.source, self.load_in_4bit = source, load_in_4bit
        self.engines: dict = {}  # name -> engine instance (built on first use)
        self.choice: dict = {}  # needs_topk -> auto's record (what was measured, what was chosen and why)
        self.last_engine: str | None = None

    @classmethod
    def from_path(
        cls,
        model_dir,
        adapter_dir=None,
        load_in_4bit=False,
        compute_dtype="auto",
        batch_size=64,
        device=None,
        engine: str = "auto",
        max_batch_tokens: int | None = None,
    ):
        model, tok, precision = load_model(model_dir, adapter_dir, load_in_4bit, compute_dtype, device)
        return cls(
            model,
            tok,
            batch_size,
            precision,
            engine=engine,
            max_batch_tokens=max_batch_tokens,
            source=(str(model_dir), str(adapter_dir) if adapter_dir is not None else None),
            load_in_4bit=load_in_4bit,
        )

    # ------------------------------------------------------------------ engines

    def engine_instance(self, name: str):
        """The engine ``name`` over this generator (built once)."""
        if name not in self.engines:
            self.engines[name] = engine_class(name)(self)
        return self.engines[name]

    def engine_for(self, needs_topk: bool = False, enc: Sequence[list[int]] | None = None) -> str:
        """The engine a greedy request runs on (``needs_topk``: it asks for top-k log-probabilities; ``enc``: its
        rendered prompts, whose shared prefix the first ``auto`` probe puts before its own prompts)."""
        name = self.setting
        if name == "auto":
            name = forced_engine() or self._auto(needs_topk, enc)
        if needs_topk and not getattr(engine_class(name), "top_logprobs", False):
            name = "hf_generate"  # the request asks for what this engine cannot return
        if name == "continuous" and not self.engine_instance(name)._supports_continuous():
            name = "hf_generate"  # a model whose cache cannot be driven row by row
        return name

    def _auto(self, needs_topk: bool, enc: Sequence[list[int]] | None = None) -> str:
        if needs_topk not in self.choice:
            from campaign_orchestrator.generation.auto import choose, shared_prefix

            engines = {n: self.engine_instance(n) for n in ENGINES[1:]}
            prefix = shared_prefix(list(enc or ()), PREFIX_MIN_TOKENS)
            name, record = choose(self, engines, needs_topk, log=self.log, prefix=prefix)
            self.choice[needs_topk] = record | {"chosen": name or "hf_generate"}
            if record.get("measured_now"):  # what the probe started and auto did not choose goes (a vLLM engine
                keep = {c["chosen"] for c in self.choice.values()} | {"hf_generate"}  # holds its process, memory)
                for n in [n for n in self.engines if n not in keep]:
                    close = getattr(self.engines.pop(n), "close", None)
                    if close is not None:
                        close()
        return self.choice[needs_topk]["chosen"]

    @property
    def engine(self) -> str:
        """The engine a plain greedy request runs on (``auto`` resolved: measured on first use)."""
        return self.engine_for(False)

    @engine.setter
    def engine(self, name: str) -> None:
        if name not in ENGINES:
            raise ValueError(f"LocalModel engine {name!r} is unknown: use one of {', '.join(ENGINES)}")
        self.setting = name

    def _supports_continuous(self) -> bool:
        return self.engine_instance("continuous")._supports_continuous()

    def cache_bytes_per_token(self) -> int:
        """Bytes one token of one row takes in the key/value cache (keys and values of every layer)."""
        cfg = self.model.config
        get = getattr(cfg, "get_text_config", None)
        cfg = get(decoder=True) if get else cfg
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        size = next(self.model.parameters()).element_size()
        return max(1, 2 * cfg.num_hidden_layers * heads * dim * size)

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (and so where its inputs must go)."""
        dev = getattr(self.model, "device", None)
        return dev if isinstance(dev, torch.device) else next(self.model.parameters()).device

    def _batch_inputs(
        self, seqs: Sequence[list[int]], width: int, prefix: Sequence[int] = ()
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
            ids[row, p + width - len(s) :] = torch.tensor(s)
            mask[row, p + width - len(s) :] = 1
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
        """One completion per prompt (a string, or a list of chat messages), in input order, the same structure
        whichever engine runs (:mod:`campaign_orchestrator.generation.engines`). ``on_result(i, completion)`` is
        called as results finish (``i`` indexes ``prompts``); ``progress(n)`` as they do. Greedy requests run on
        :meth:`engine_for` (``auto``: measured); sampling (``temperature > 0``) on ``generate``."""
        enc = [render_prompt_ids(self.tok, p) for p in prompts]
        try:
            if temperature > 0:
                self.last_engine = "hf_generate"
                return self.engine_instance("hf_generate").generate(
                    enc, max_new_tokens, logprobs, progress, on_result, temperature=temperature, top_p=top_p, seed=seed
                )
            name = self.engine_for(bool(logprobs), enc)
            self.last_engine = name
            return self.engine_instance(name).generate(enc, max_new_tokens, logprobs, progress, on_result)
        finally:  # the call's key/value caches are gone: their pages go back, not into the next model's peak
            allocator.trim(collect=False)

    # ------------------------------------------------------------------ log-likelihood without generation

    @torch.no_grad()
    def score(
        self,
        prompts: Sequence[str | Sequence[dict]],
        continuations: Sequence[str | Sequence[int]],
        top_k: int | None = None,
    ) -> list[Scored]:
        """Per-token log-probabilities of each continuation (text, appended to the rendered prompt, or token
        ids) given its prompt, from one forward pass per batch (length-sorted, left-padded, ``batch_size``
        rows); with ``top_k`` also the top-k of every position. Results in input order; a pair that does not
        fit the context is not scored (``error`` set)."""
        if len(prompts) != len(continuations):
            raise ValueError(
                f"score() takes one continuation per prompt: got {len(prompts)} prompts and "
                f"{len(continuations)} continuations"
            )
        enc = [render_prompt_ids(self.tok, p) for p in prompts]
        cont = [
            list(c) if not isinstance(c, str) else self.tok(c, add_special_tokens=False)["input_ids"]
            for c in continuations
        ]
        out: list[Scored | None] = [None] * len(prompts)
        todo = []
        for i, (e, c) in enumerate(zip(enc, cont, strict=True)):
            if self.context_length and len(e) + len(c) > self.context_length:
                out[i] = Scored(
                    c,
                    [],
                    None,
                    len(e),
                    f"prompt of {len(e)} tokens + continuation of {len(c)} tokens "
                    f"exceeds the model's context of {self.context_length}",
                )
            elif not c:
                out[i] = Scored([], [], [] if top_k else None, len(e))
            else:
                todo.append(i)
        todo.sort(key=lambda i: len(enc[i]) + len(cont[i]))
        for start in range(0, len(todo), self.batch_size):
            idx = todo[start : start + self.batch_size]
            full = [enc[i] + cont[i] for i in idx]
            width = max(len(f) for f in full)
            ids, mask = self._batch_inputs(full, width)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            n_c = max(len(cont[i]) for i in idx)
            logits = self.model(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=n_c + 1
            ).logits.float()  # the last n_c + 1 positions
            lp = torch.log_softmax(logits[:, :-1], dim=-1)  # position t predicts token t + 1
            for row, i in enumerate(idx):
                c = cont[i]
                rows_lp = lp[row, n_c - len(c) :]  # the continuation's predicting positions
                tgt = torch.tensor(c, device=rows_lp.device)
                vals = rows_lp.gather(-1, tgt[:, None])[:, 0].cpu().tolist()
                top = None
                if top_k:
                    tv, ti = rows_lp.topk(min(top_k, rows_lp.shape[-1]), dim=-1)
                    top = [
                        [(t, None, v) for t, v in zip(a, b, strict=True)]
                        for a, b in zip(ti.cpu().tolist(), tv.cpu().tolist(), strict=True)
                    ]
                out[i] = Scored(list(c), vals, top, len(enc[i]))
        return out  # type: ignore[return-value]
