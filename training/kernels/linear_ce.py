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
    ``nn.Linear`` without bias (not a LoRA-wrapped or quantized head), and no logit soft-capping or scaling in the
    model's config. Under FSDP2 it is a ``DTensor`` shard between steps; the loss reads it whole, inside the
    forward (:class:`FusedHead`)."""
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
    return w if w.is_floating_point() else None


def head_loss(model, inputs: dict, loss) -> torch.Tensor:
    """One forward of ``model`` (PEFT-wrapped or not) on ``inputs`` in which the LM head, instead of scoring, returns
    ``loss(hidden, weight)``: its input (the decoder's output, after the last norm, at the positions
    ``inputs["logits_to_keep"]`` selects) and its own weight; returns what ``loss`` returned (the model's ``logits``).
    For a loss that takes the head's weight itself (:class:`FusedHead`).

    Inside the forward because of FSDP2 (``training.model.shard``): the head, the embeddings and the final norm are
    the root unit's parameters, whole only from the root's forward to its backward. Within the forward the head holds
    its whole weight (no copy, no extra all-gather), and the loss is the root's output, so FSDP2's pre-backward hook
    gathers the root's parameters again before backward runs through the final norm. A loss computed outside,
    from hidden states captured on the way, would leave that hook unfired: a root that reshards after its forward
    would be differentiated through freed parameters (``tests/training/test_fused_loss_fsdp2.py``)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    lm_head = inner.get_output_embeddings()
    own = lm_head.__dict__.get("forward")
    lm_head.forward = lambda hidden: loss(hidden, lm_head.weight)
    try:
        return model(**inputs).logits
    finally:
        if own is None:
            del lm_head.forward
        else:
            lm_head.forward = own


class FusedHead:
    """The trainer's fused cross-entropy: ``kind`` (``liger`` or ``chunked``) and how many micro-batches ran it.

    :meth:`loss_sums` computes the loss inside the model's forward, in place of the LM head
    (:func:`head_loss`), from the head's input and its weight as the head holds it there. Under FSDP2 that
    is the whole weight, gathered by the root unit for its forward like the embeddings and the final norm, whatever
    ``reshard_after_forward`` says (no copy, no all-gather of its own), and the loss is the root's output, so backward
    gathers the root again before it reaches the final norm. The base is frozen (LoRA): the gradient reaches the
    LoRA parameters through the head's input, as in a world of one (``tests/training/test_fused_loss_fsdp2.py``).
    ``micro_batches`` counts the losses that ran fused; the trainer reports it (``summary.json``'s
    ``fused_cross_entropy``)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.micro_batches = 0

    def loss_sums(self, model, inputs: dict, labels: torch.Tensor, chunk: int | None = None) -> dict:
        """``training.losses.loss_sums`` for cross-entropy alone (``ce_sum``, ``ce_tokens``) from one forward of
        ``model`` on ``inputs`` (whose ``logits_to_keep`` and ``labels`` are aligned as ``training.head.compact``
        makes them), the summed next-token cross-entropy computed by this kernel in place of the LM head."""
        counted = {}

        def loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            ce, counted["n"] = linear_cross_entropy_sum(hidden, weight, labels, self.kind, chunk)
            self.micro_batches += 1
            return ce

        ce = head_loss(model, inputs, loss)
        return {"ce_sum": ce, "ce_tokens": counted["n"]}

    def report(self) -> dict:
        return {"kind": self.kind, "micro_batches": self.micro_batches}


def plan(model, device: torch.device, distill: bool, policy: str | bool = "auto") -> FusedHead | None:
    """The trainer's fused cross-entropy (:class:`FusedHead`), or None for the head + plain loss.

    ``policy``: ``auto`` fuses on CUDA only (there the logits are the step's largest activation and Liger's
    kernel is at hand; on a CPU the labelled-positions head already keeps them small, and the plain path is
    what ``benchmarks/train_throughput.py`` measures), True wherever the head allows it (a CPU gets the chunked
    kernel), False never. A head :func:`head_weight` refuses keeps the plain path, and so does logit distillation:
    its KL needs the student's whole log-softmax at each scored position (the top-k gather and the tail bucket
    over every other token), which a chunked kernel would have to recompute per chunk with the teacher's top-k;
    those positions are the labelled ones (``training.head``), a small share of the row, so the logits it keeps
    are small too. A head sharded by FSDP2 is fused like any other (:class:`FusedHead`)."""
    if policy is False or distill or (policy == "auto" and device.type != "cuda"):
        return None
    return None if head_weight(model) is None else FusedHead(backend(device))
