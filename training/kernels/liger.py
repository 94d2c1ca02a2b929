"""Liger Kernel's fused RMSNorm, SwiGLU and RoPE in the student's modules, on CUDA, by model type.

Why Liger: its Triton kernels are the ones TRL, Axolotl and LLaMA-Factory patch in (``use_liger_kernel``),
cover the Llama / Qwen2 / Mistral / Gemma / Phi3 families the campaigns train, patch a loaded model in place
(``apply_liger_kernel_to_<type>(model=...)``: each decoder layer's norms and MLP get Liger's forward, so
PEFT's LoRA layers inside the MLP keep working), and recompute in backward instead of keeping activations
(the SwiGLU kernel keeps its two inputs only, the norm its input and 1/rms). The alternatives: Unsloth's
kernels are tied to its own model patching and LoRA; ``torch.compile`` fuses the same elementwise work and is
the recipes' ``training.compile`` lever; Apex / TransformerEngine need a CUDA build of their own.

Off on a CPU (Triton kernels: CUDA only) and when ``liger_kernel`` is not importable (``pip install '.[gpu]'``).
Each kernel's output is checked against the plain module it replaces by ``training.kernel_checks`` (run by
``benchmarks/train_gpu_step.py``).
"""

from __future__ import annotations

import inspect

import torch

KERNELS = ("rms_norm", "swiglu", "rope")


def why_not(device: torch.device) -> str | None:
    """None when Liger's kernels can run here, else why not."""
    if device.type != "cuda":
        return "Liger Kernel is Triton: CUDA only"
    try:
        import liger_kernel.transformers.monkey_patch  # noqa: F401
    except ImportError as e:
        return f"liger_kernel is not importable ({e}); pip install '.[gpu]'"
    return None


def apply_fn(model_type: str):
    """Liger's ``apply_liger_kernel_to_<type>`` for a transformers ``model_type``, or None."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)


def apply(model, device: torch.device, policy: str | bool = "auto") -> list[str]:
    """Patch Liger's fused RMSNorm / SwiGLU / RoPE into ``model`` (PEFT-wrapped or not) in place; returns the
    kernels applied (empty on a CPU, without Liger, for a model type it does not know, or with ``policy`` False).
    Its cross-entropy patches stay off: the trainer computes its own loss (``training.kernels.linear_ce``)."""
    if policy is False or why_not(device) is not None:
        return []
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    fn = apply_fn(getattr(inner.config, "model_type", ""))
    if fn is None:
        return []
    params = inspect.signature(fn).parameters
    kw = {k: True for k in KERNELS if k in params}
    kw |= {k: False for k in ("cross_entropy", "fused_linear_cross_entropy") if k in params}
    import sys

    modeling = sys.modules.get(type(inner).__module__)
    before = dict(vars(modeling)) if modeling is not None else {}
    try:
        fn(model=inner, **kw)
    except Exception as e:  # noqa: BLE001 - a Liger release that does not fit this transformers: plain modules
        import warnings

        warnings.warn(
            f"Liger Kernel could not patch this {inner.config.model_type} model ({type(e).__name__}: {e}); "
            "training with the plain modules",
            stacklevel=2,
        )
        return []
    # Liger also swaps the modeling module's norm and MLP classes, which would reach every model built later in
    # this process (a comparison's other trainer): this instance is patched, so the classes are put back. Its
    # RoPE is a module function, read at each call: that patch stays, process-wide.
    for name, value in before.items():
        if isinstance(value, type) and vars(modeling).get(name) is not value:
            setattr(modeling, name, value)
    return [k for k in KERNELS if kw.get(k)]
