"""Keep fewer activations for backward by recomputing the cheap ones, exactly (no change to any value).

With a frozen base and LoRA adapters, most of a step's memory is the tensors autograd keeps for
backward. Some of them are the outputs of elementwise work that costs nothing next to the matmuls
around it, and can be recomputed in backward from tensors that are kept anyway (Megatron's
"selective recomputation", Unsloth's fused LoRA MLP do the same):

- **The SwiGLU MLP.** ``down(silu(gate(x)) * up(x))`` keeps ``gate``, ``silu(gate)``, ``up`` and their
  product (the input of ``down``'s LoRA ``A``): four ``intermediate_size`` vectors per token and layer.
  :class:`SwiGLU` keeps ``gate`` and ``up`` only and recomputes ``silu(gate)`` in its backward; the
  product, which ``down`` keeps, is recomputed from them when backward needs it.
- **The RMSNorm outputs** that the attention's and the MLP's projections keep (the input of every
  LoRA ``A``) are recomputed from the norm's input, which the norm keeps anyway.
- **PEFT's input casts.** With a bf16 base and fp32 adapters, every LoRA layer copies its input to fp32
  and ``lora_A`` keeps the copy: five fp32 copies of the hidden state and one of the intermediate one
  per token and layer, more than the bf16 activations themselves. They are recomputed from their source.

The mechanism: each decoder layer's forward runs in a :func:`scope`, where those tensors are registered
as they are made (a recipe: the function and its inputs, which are kept for backward anyway). A tensor
autograd saves that is a registered one (or a view of it) is not kept; its recipe is, and the tensor is
recomputed, bit for bit, when backward unpacks it (``torch.autograd.graph.saved_tensors_hooks``).
:func:`apply` patches the decoder layers of a (PEFT-wrapped) Llama-family model in place; the trainer
calls it unless activation checkpointing is on (which keeps nothing of the layer anyway). The loss and
gradients are bitwise those of the unpatched model (``tests/training/test_recompute.py``).
"""

from __future__ import annotations

import contextlib
import types
import weakref
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
    """How to recompute a saved tensor: ``fn(*inputs)`` (inputs may be recipes themselves), then the view."""

    __slots__ = ("fn", "inputs", "size", "stride", "offset")

    def __init__(self, fn, inputs, size, stride, offset):
        self.fn, self.inputs, self.size, self.stride, self.offset = fn, inputs, size, stride, offset

    def value(self) -> torch.Tensor:
        with torch.no_grad():
            full = self.fn(*(a.value() if isinstance(a, _Recipe) else a for a in self.inputs))
        return full.as_strided(self.size, self.stride, self.offset)


def _whole(t: torch.Tensor) -> bool:
    """``t`` is the whole of its storage, laid out contiguously from its start."""
    return t.is_contiguous() and not t.storage_offset() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


class _Scope:
    """The tensors of one decoder layer's forward that may be recomputed, by storage address."""

    def __init__(self):
        self.entries: dict[int, tuple[weakref.ref, Callable, tuple]] = {}

    def register(self, tensor: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs) -> None:
        if _whole(tensor):
            self.entries[tensor.untyped_storage().data_ptr()] = (weakref.ref(tensor), fn, inputs)

    def recipe(self, t: torch.Tensor) -> _Recipe | None:
        e = self.entries.get(t.untyped_storage().data_ptr())
        if e is None:
            return None
        owner = e[0]()
        # A live storage's address is unique: while the registered tensor lives, the same address is its storage.
        if owner is None or owner.dtype != t.dtype or owner.device != t.device:
            return None
        return _Recipe(e[1], e[2], t.size(), t.stride(), t.storage_offset())

    def whole_recipe(self, t: torch.Tensor) -> _Recipe | torch.Tensor:
        """``t`` as an input of another recipe: its own recipe when it has one (so that holding it keeps nothing)."""
        r = self.recipe(t) if _whole(t) else None
        return r if r is not None else t


_scopes: list[_Scope] = []


def _current() -> _Scope | None:
    return _scopes[-1] if _scopes and torch.is_grad_enabled() else None


@contextlib.contextmanager
def scope():
    """Inside, tensors saved for backward that were registered (:meth:`_Scope.register`) are kept as recipes and
    recomputed when backward unpacks them; everything else is saved as autograd saves it."""
    s = _Scope()

    def pack(t: torch.Tensor):
        r = s.recipe(t)
        return t if r is None else r

    def unpack(p):
        return p.value() if isinstance(p, _Recipe) else p

    _scopes.append(s)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield s
    finally:
        _scopes.pop()


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype=dtype)


# --------------------------------------------------------------------------- patching a model


def _is_swiglu_mlp(mod: nn.Module) -> bool:
    return all(isinstance(getattr(mod, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")) and (
        isinstance(getattr(mod, "act_fn", None), nn.SiLU)
        or type(getattr(mod, "act_fn", None)).__name__ == "SiLUActivation"
    )  # transformers' F.silu


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    s = _current()
    if s is None or not (gate.requires_grad and up.requires_grad):
        return self.down_proj(self.act_fn(gate) * up)
    h = SwiGLU.apply(gate, up)
    s.register(h, swiglu_value, gate, up)  # gate and up are kept by SwiGLU: holding them costs nothing
    return self.down_proj(h)


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    out = self._campaign_forward(x)
    s = _current()
    if s is not None and x.requires_grad:  # then the norm keeps x for its own backward: holding it costs nothing
        s.register(out, self._campaign_forward, x)
    return out


def _layer_forward(self, *args, **kwargs):
    if not torch.is_grad_enabled():
        return self._campaign_forward(*args, **kwargs)
    with scope():
        return self._campaign_forward(*args, **kwargs)


def _lora_cast_input_dtype(self, x, dtype):
    """PEFT's input cast (a bf16 input to fp32 adapters is copied, and ``lora_A`` keeps the copy): the copy is
    recomputed from its source instead."""
    y = self._campaign_cast(x, dtype)
    s = _current()
    if s is not None and y is not x and isinstance(y, torch.Tensor):
        s.register(y, _cast, s.whole_recipe(x), dtype)
    return y


def _patch(mod: nn.Module, attr: str, fn) -> None:
    setattr(mod, "_campaign_" + ("forward" if attr == "forward" else "cast"), getattr(mod, attr))
    setattr(mod, attr, types.MethodType(fn, mod))


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "input_layernorm", None), nn.Module)
        and isinstance(getattr(m, "post_attention_layernorm", None), nn.Module)
    ]


def apply(model: nn.Module) -> dict[str, int]:
    """Patch ``model`` in place (idempotent): every decoder layer (one recomputation scope per forward), its
    RMSNorms, its SwiGLU MLP (``gate_proj``/``up_proj``/``down_proj`` and SiLU) and the input casts of its PEFT
    LoRA layers. Returns what was patched."""
    if getattr(model, _ATTR, None):
        return getattr(model, _ATTR)
    counts = {"layers": 0, "mlp": 0, "norm": 0, "lora_cast": 0}
    for layer in _decoder_layers(model):
        _patch(layer, "forward", _layer_forward)
        counts["layers"] += 1
        for mod in layer.modules():
            if mod is layer:
                continue
            if _is_swiglu_mlp(mod):
                _patch(mod, "forward", _mlp_forward)
                counts["mlp"] += 1
            elif "RMSNorm" in type(mod).__name__:
                _patch(mod, "forward", _norm_forward)
                counts["norm"] += 1
            elif hasattr(mod, "lora_A") and hasattr(mod, "_cast_input_dtype"):
                _patch(mod, "_cast_input_dtype", _lora_cast_input_dtype)
                counts["lora_cast"] += 1
    setattr(model, _ATTR, counts)
    return counts
