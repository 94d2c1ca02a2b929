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
Imports torch: load this module lazily.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from campaign_orchestrator.teacher.completion import Completion

__all__ = ["Completion", "LocalGenerator", "default_device", "load_model"]


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
               compute_dtype: str = "bfloat16", device: str | None = None):
    """The model (on ``device``, default :func:`default_device`; eval mode) and its tokenizer
    (left padding). A 4-bit model is placed at load time (``device_map``), others are moved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device(device or default_device())
    kwargs: dict = {}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        dt = getattr(torch, compute_dtype)
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dt, bnb_4bit_quant_storage=dt
        )
        kwargs["dtype"] = dt
        if dev.type == "cuda":  # bitsandbytes weights are quantized where they land: load them on the GPU
            kwargs["device_map"] = {"": dev.index if dev.index is not None else torch.cuda.current_device()}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    if not load_in_4bit and dev.type != "cpu":
        model.to(dev)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


class LocalGenerator:
    """Generate completions for many prompts with one loaded model."""

    def __init__(self, model, tokenizer, batch_size: int = 64):
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        self.context_length = getattr(model.config, "max_position_embeddings", None)

    @classmethod
    def from_path(cls, model_dir, adapter_dir=None, load_in_4bit=False, compute_dtype="bfloat16", batch_size=64,
                  device=None):
        model, tok = load_model(model_dir, adapter_dir, load_in_4bit, compute_dtype, device)
        return cls(model, tok, batch_size)

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (and so where its inputs must go)."""
        dev = getattr(self.model, "device", None)
        return dev if isinstance(dev, torch.device) else next(self.model.parameters()).device

    def _batch_inputs(self, seqs: Sequence[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input ids and attention mask for ``seqs``, on the model's device."""
        ids = torch.full((len(seqs), width), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, width - len(s):] = torch.tensor(s)
            mask[row, width - len(s):] = 1
        dev = self.device
        return ids.to(dev), mask.to(dev)  # built on the CPU, copied once

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
        logprobs: int | None = None,
        on_result: Callable[[int, Completion], None] | None = None,
    ) -> list[Completion]:
        """One completion per prompt, in input order. ``on_result(i, completion)`` is called
        as each batch finishes (``i`` indexes ``prompts``); ``progress(n)`` after each batch."""
        from transformers import LogitsProcessorList

        enc = [self.tok(p)["input_ids"] for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(enc[i]))
        out: list[Completion | None] = [None] * len(prompts)
        eos = self.tok.eos_token_id
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
            width = max(len(enc[i]) for i in idx)
            ids, mask = self._batch_inputs([enc[i] for i in idx], width)
            gen_kwargs: dict = {"max_new_tokens": max_new_tokens, "pad_token_id": self.tok.pad_token_id}
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
                if eos in toks:
                    toks, reason = toks[: toks.index(eos)], "stop"
                    n_out = len(toks) + 1
                    ids_out = toks + [eos]
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
