"""Next-token cross-entropy straight from the hidden states and the LM head weight: no ``[tokens × vocab]`` logits.

The plain path computes ``logits = hidden @ Wᵀ`` for every scored token, upcasts them to fp32 and keeps
them (and their softmax) for backward: at 4 × 1024 tokens and a 32,000-token vocabulary that is 0.5 GB in
fp32, more for a 150k vocabulary, for a matmul that is a small share of the step's FLOPs. Here the tokens
are taken in chunks; each chunk's logits live only inside the forward, where the loss *and* the gradients
with respect to the hidden states (and the weight, when it trains) are computed at once (the softmax minus
the one-hot label is the logits' gradient), so nothing of size ``vocab`` is kept for backward: the
technique of Liger Kernel's ``FusedLinearCrossEntropy``, which runs on CUDA when ``liger_kernel`` is
importable (:func:`backend`), this chunked pure-torch one otherwise. Same sum, same gradients as
``training.losses.cross_entropy_sum`` on the logits (``tests/training/test_linear_ce.py``), with the same
casts: logits in the weight's dtype, softmax in fp32.
"""

from __future__ import annotations

import torch

IGNORE = -100
CHUNK_ELEMENTS = 1 << 25  # fp32 logits of one chunk: 128 MiB whatever the vocabulary


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab``: ``CHUNK_ELEMENTS`` fp32 logits at most."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


class _ChunkedLinearCE(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weightᵀ`` against ``targets`` (``IGNORE`` skipped), gradients computed in
    forward chunk by chunk and only scaled in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.size(0), chunk):
            h, t = hidden[s : s + chunk], targets[s : s + chunk]
            valid = t != IGNORE
            safe = t.clamp(min=0)
            logits = (h @ weight.t()).float()  # what the head and the plain loss compute, chunk by chunk
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None])[:, 0]
            loss += torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
            if need_h or need_w:
                g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                g.scatter_add_(1, safe[:, None], -torch.ones_like(picked)[:, None])
                g.mul_(valid[:, None])
                g = g.to(hidden.dtype)
                if need_h:
                    grad_h[s : s + chunk] = g @ weight
                if need_w:
                    grad_w += (g.t() @ h).float()
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None))
        ctx.need = (need_h, need_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        (need_h, need_w), (h_dtype, w_dtype) = ctx.need, ctx.dtypes
        gh = (saved.pop(0) * grad_out).to(h_dtype) if need_h else None
        gw = (saved.pop(0) * grad_out).to(w_dtype) if need_w else None
        return gh, gw, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden [N, D] @ weight [V, D]ᵀ`` against ``targets [N]`` (-100: skipped),
    ``chunk`` tokens at a time (default :func:`chunk_rows`)."""
    chunk = chunk or chunk_rows(weight.size(0))
    if not torch.is_grad_enabled():
        with torch.no_grad():
            return _ChunkedLinearCE.forward(_NoCtx(), hidden, weight, targets, chunk)
    return _ChunkedLinearCE.apply(hidden, weight, targets, chunk)


class _NoCtx:
    needs_input_grad = (False, False, False, False)

    def save_for_backward(self, *tensors):
        pass


def liger_available(device: torch.device) -> bool:
    """Liger Kernel's fused linear cross-entropy runs here: a CUDA device and ``liger_kernel`` importable."""
    if device.type != "cuda":
        return False
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def backend(device: torch.device) -> str:
    """``liger`` on CUDA with Liger Kernel installed (``pip install '.[gpu]'``), else ``chunked``."""
    return "liger" if liger_available(device) else "chunked"


_liger_loss = None


def liger_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Liger Kernel's fused linear cross-entropy, summed (Triton: CUDA only)."""
    global _liger_loss
    if _liger_loss is None:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        _liger_loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")
    out = _liger_loss(weight, hidden, targets)
    if isinstance(out, tuple):  # (loss, z_loss, ...) in versions that can return extras
        out = out[0]
    return getattr(out, "loss", out).float()


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, kind: str = "chunked", chunk: int | None = None
) -> tuple[torch.Tensor, int]:
    """``training.losses.cross_entropy_sum`` from the hidden states ``[B, T, D]`` before the LM head ``weight``:
    the summed next-token cross-entropy over labels not -100 (shifted by one inside, as there) and their count."""
    h = hidden[:, :-1].reshape(-1, hidden.size(-1))
    t = labels[:, 1:].reshape(-1)
    n = int((t != IGNORE).sum())
    if kind == "liger":
        return liger_linear_cross_entropy(h, weight, t), n
    return chunked_linear_cross_entropy(h, weight, t, chunk), n


def head_weight(model) -> torch.Tensor | None:
    """The LM head's weight when the fused loss can stand in for the head + plain loss, else None: a plain
    ``nn.Linear`` without bias (not a LoRA-wrapped or quantized head, not a DTensor shard), and no logit
    soft-capping or scaling in the model's config."""
    from torch import nn

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(inner, "config", None)
    if cfg is not None and (
        getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0)
    ):
        return None
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    w = head.weight
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor shards nothing
        DTensor = ()  # noqa: N806
    if not w.is_floating_point() or isinstance(w, DTensor):
        return None
    return w


def plan(model, device: torch.device, distill: bool, policy: str | bool = "auto") -> tuple[str, torch.Tensor] | None:
    """``(kind, head weight)`` when the trainer's cross-entropy runs fused, else None (the head + plain loss).

    ``policy``: ``auto`` fuses on CUDA only (there the logits are the step's largest activation and Liger's
    kernel is at hand; on a CPU the labelled-positions head already keeps them small, and the plain path is
    what ``benchmarks/train_throughput.py`` measures), True wherever the head allows it (a CPU gets the chunked
    kernel), False never. Logit distillation keeps the plain path (``training.losses.loss_sums_hidden`` says
    why), as does a head :func:`head_weight` refuses."""
    if policy is False or distill or (policy == "auto" and device.type != "cuda"):
        return None
    w = head_weight(model)
    return None if w is None else (backend(device), w)
