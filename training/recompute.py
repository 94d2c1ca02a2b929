"""Keep fewer activations for backward by recomputing the cheap ones, exactly (no change to any value).

With a frozen base and LoRA adapters, most of a step's memory is the tensors autograd keeps for
backward. Some of them are the outputs of elementwise work that costs nothing next to the matmuls
around it, and can be recomputed in backward from tensors that are kept anyway (Megatron's
"selective recomputation", Unsloth's fused LoRA MLP do the same):

- **The SwiGLU MLP.** ``down(silu(gate(x)) * up(x))`` keeps ``gate``, ``silu(gate)``, ``up`` and their
  product (the input of ``down``'s LoRA ``A``): four ``intermediate_size`` vectors per token and layer.
  :class:`SwiGLU` keeps ``gate`` and ``up`` only and recomputes ``silu(gate)`` in its backward, and the
  product, which ``down`` keeps, is recomputed from them when backward needs it (:func:`recompute_saved`).
- **The RMSNorm outputs** that the attention's and the MLP's projections keep (the input of every
  LoRA ``A``) are recomputed from the norm's input, which the norm keeps anyway.

:func:`recompute_saved` is the mechanism: inside it, any tensor autograd saves that shares the storage
of ``tensor`` is not kept; a recipe is kept instead (the function and its inputs, which must be kept
alive for backward anyway) and the tensor is recomputed, bit for bit, when backward unpacks it.
:func:`apply` patches the MLPs and decoder layers of a (PEFT-wrapped) Llama-family model in place; the
trainer calls it unless activation checkpointing is on (which keeps nothing of the layer anyway).
The gradients are bitwise those of the unpatched model (``tests/training/test_recompute.py``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

_ATTR = "_campaign_recompute"


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up``, keeping ``gate`` and ``up`` for backward (not ``silu(gate)`` and the product).

    The backward runs the same kernels as autograd's (mul's and ``silu_backward``) on the same values, so
    the gradients are bitwise equal."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


def swiglu_value(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _Recipe:
    __slots__ = ("fn", "inputs", "size", "stride", "offset")

    def __init__(self, fn, inputs, size, stride, offset):
        self.fn, self.inputs, self.size, self.stride, self.offset = fn, inputs, size, stride, offset

    def value(self) -> torch.Tensor:
        with torch.no_grad():
            full = self.fn(*self.inputs)
        return full.as_strided(self.size, self.stride, self.offset)


@contextlib.contextmanager
def recompute_saved(tensor: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor):
    """Inside this block, tensors saved for backward that share ``tensor``'s storage are recomputed as
    ``fn(*inputs)`` when backward needs them instead of being kept. ``tensor`` must be contiguous and
    equal ``fn(*inputs)``, and ``inputs`` must be kept for backward by someone else (else holding them
    costs what it saves)."""
    nbytes = tensor.numel() * tensor.element_size()
    if (not tensor.requires_grad or not tensor.is_contiguous() or tensor.storage_offset()
            or tensor.untyped_storage().nbytes() != nbytes):
        yield  # not a whole storage of its own: keep everything as autograd would
        return
    storage = tensor.untyped_storage().data_ptr()
    dtype, device = tensor.dtype, tensor.device

    def pack(t: torch.Tensor):
        # A live storage's address is unique, so the same address is the same storage: ``tensor`` or a view.
        if t.dtype == dtype and t.device == device and t.untyped_storage().data_ptr() == storage:
            return _Recipe(fn, inputs, t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(p):
        return p.value() if isinstance(p, _Recipe) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


# --------------------------------------------------------------------------- patching a model


def _is_swiglu_mlp(mod: nn.Module) -> bool:
    return (all(isinstance(getattr(mod, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(getattr(mod, "act_fn", None), nn.SiLU)
                 or type(getattr(mod, "act_fn", None)).__name__ == "SiLUActivation"))  # transformers' F.silu


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if not (torch.is_grad_enabled() and gate.requires_grad and up.requires_grad):
        return self.down_proj(self.act_fn(gate) * up)
    h = SwiGLU.apply(gate, up)
    with recompute_saved(h, swiglu_value, gate, up):
        return self.down_proj(h)


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    out = self._campaign_forward(x)
    self._campaign_last = (x, out) if torch.is_grad_enabled() else None
    return out


def _consumer_forward(norm: nn.Module):
    """A forward for the module fed by ``norm``'s output: runs it with that output recomputed from the
    norm's input when backward needs it."""

    def forward(self, *args, **kwargs):
        last, norm._campaign_last = norm._campaign_last, None
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if last is None or hidden is not last[1]:
            return self._campaign_forward(*args, **kwargs)
        x, out = last
        with recompute_saved(out, norm._campaign_forward, x):
            return self._campaign_forward(*args, **kwargs)

    return forward


def _patch(mod: nn.Module, forward) -> None:
    mod._campaign_forward = mod.forward
    mod.forward = types.MethodType(forward, mod)


def apply(model: nn.Module) -> dict[str, int]:
    """Patch ``model`` in place (idempotent): every SwiGLU MLP (``gate_proj``/``up_proj``/``down_proj``
    and SiLU) and, in every decoder layer with ``input_layernorm``/``self_attn`` and
    ``post_attention_layernorm``/``mlp``, the norms' consumers. Returns what was patched."""
    if getattr(model, _ATTR, None):
        return getattr(model, _ATTR)
    counts = {"mlp": 0, "norm": 0}
    for mod in model.modules():
        if _is_swiglu_mlp(mod):
            _patch(mod, _mlp_forward)
            counts["mlp"] += 1
    for mod in model.modules():
        for norm_name, consumer_name in (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")):
            norm, consumer = getattr(mod, norm_name, None), getattr(mod, consumer_name, None)
            if not (isinstance(norm, nn.Module) and isinstance(consumer, nn.Module)) or "RMSNorm" not in type(norm).__name__:
                continue
            norm._campaign_last = None
            _patch(norm, _norm_forward)
            _patch(consumer, _consumer_forward(norm))
            counts["norm"] += 1
    setattr(model, _ATTR, counts)
    return counts
