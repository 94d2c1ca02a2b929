"""Each fused kernel's output against the plain path it replaces, on one device (``benchmarks/train_gpu_step.py``).

:func:`run` returns ``{check: {"ok": bool, "max_abs_diff": float, ...} | {"skipped": why}}`` for the varlen
attention backends (outputs and q/k/v gradients against transformers' eager attention on packed rows, GQA),
the linear cross-entropy (loss and gradients against the plain cross-entropy on logits) and Liger's RMSNorm,
SwiGLU and RoPE (outputs and input gradients against transformers' Llama modules). Tolerances are those of the
dtype (bf16 on a GPU: its 8-bit mantissa; fp32 elsewhere)."""

from __future__ import annotations

import torch
from torch import nn


def _tol(dtype: torch.dtype) -> float:
    return 3e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


def _compare(pairs: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> dict:
    worst, ok = 0.0, True
    for got, ref in pairs:
        got, ref = got.detach().float(), ref.detach().float()
        diff = float((got - ref).abs().max()) if got.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        worst = max(worst, diff)
        ok = ok and got.shape == ref.shape and diff <= _tol(dtype) * max(1.0, scale)
    return {"ok": ok, "max_abs_diff": round(worst, 6), "tolerance": _tol(dtype)}


def _leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def varlen(device: torch.device, dtype: torch.dtype) -> dict:
    from training import attention

    lengths = [[300, 200, 500, 24], [1024]] if device.type == "cuda" else [[6, 4, 5], [15]]
    heads, kv, d = 8, 2, 64
    g = torch.Generator().manual_seed(0)
    b, t = len(lengths), sum(lengths[0])
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(device, dtype) for h in (heads, kv, kv))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(device)
    from transformers.models.llama.modeling_llama import eager_attention_forward

    class _Layer(nn.Module):
        num_key_value_groups = heads // kv

    layer = _Layer().train()
    masks = torch.stack([attention._block_masks(row, device)[1][0] for row in lengths]).to(dtype)
    ref_leaves = _leaves(q, k, v)
    ref = eager_attention_forward(layer, *ref_leaves, masks, scaling=d**-0.5)[0]
    w = torch.randn(ref.shape, generator=g).to(device, dtype)
    (ref.float() * w.float()).sum().backward()
    out: dict = {}
    backends = ["flash_varlen", "flex"] if device.type == "cuda" else [attention.NAME]
    for name in backends:
        if name == "flash_varlen" and attention.flash_varlen() is None:
            out[name] = {"skipped": "torch has no torch.nn.attention.varlen.varlen_attn"}
            continue
        try:
            leaves = _leaves(q, k, v)
            got = attention.varlen_forward(layer, *leaves, None, scaling=d**-0.5, position_ids=pos, backend=name)[0]
            (got.float() * w.float()).sum().backward()
            grads = [(a.grad, r.grad) for a, r in zip(leaves, ref_leaves, strict=True)]
            out[name] = _compare([(got, ref), *grads], dtype)
        except Exception as e:  # noqa: BLE001 - reported: the benchmark fails on it
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    return out


def linear_cross_entropy(device: torch.device, dtype: torch.dtype) -> dict:
    from training import losses
    from training.kernels import linear_ce

    n, d, vocab = (4096, 2048, 32000) if device.type == "cuda" else (64, 32, 97)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, n, d, generator=g).to(device, dtype)
    weight = (torch.randn(vocab, d, generator=g) / d**0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (1, n), generator=g).to(device)
    labels[0, : n // 2] = -100
    h0, w0 = _leaves(hidden, weight)
    ref, _ = losses.cross_entropy_sum(h0 @ w0.t(), labels)
    ref.backward()
    out = {}
    kinds = ["chunked"] + (["liger"] if linear_ce.liger_available(device) else [])
    for kind in kinds:
        h, w = _leaves(hidden, weight)
        try:
            loss, _ = linear_ce.linear_cross_entropy_sum(h, w, labels, kind)
            loss.backward()
            r = _compare([(h.grad, h0.grad), (w.grad, w0.grad)], dtype)
            rel = abs(float(loss) - float(ref)) / max(1.0, abs(float(ref)))
            out[kind] = r | {"ok": r["ok"] and rel <= _tol(dtype), "loss_rel_diff": round(rel, 8)}
        except Exception as e:  # noqa: BLE001
            out[kind] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    if "liger" not in kinds:
        out["liger"] = {"skipped": "needs CUDA and liger_kernel (pip install '.[gpu]')"}
    return out


def liger_modules(device: torch.device, dtype: torch.dtype) -> dict:
    from training.kernels import liger

    why = liger.why_not(device)
    if why:
        return {k: {"skipped": why} for k in liger.KERNELS}
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as ml

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 1024, cfg.hidden_size, generator=g).to(device, dtype)
    out = {}

    def pair(plain, fused, *inputs):
        a, b = _leaves(*inputs), _leaves(*inputs)
        ya, yb = plain(*a), fused(*b)
        ya, yb = (ya if isinstance(ya, tuple) else (ya,)), (yb if isinstance(yb, tuple) else (yb,))
        sum(y.float().sum() for y in ya).backward()
        sum(y.float().sum() for y in yb).backward()
        return _compare(list(zip(yb, ya, strict=True)) + [(p.grad, q.grad) for p, q in zip(b, a, strict=True)], dtype)

    if ml.LlamaRMSNorm is LigerRMSNorm or ml.LlamaMLP is LigerSwiGLUMLP:
        return {"error": "transformers' Llama classes are Liger's here (patched module-wide): nothing to compare to"}
    try:
        plain = ml.LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps).to(device, dtype)
        nn.init.normal_(plain.weight, 1.0, 0.1)
        fused = LigerRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps).to(device, dtype)
        fused.load_state_dict(plain.state_dict())
        out["rms_norm"] = pair(plain, fused, x)
        plain = ml.LlamaMLP(cfg).to(device, dtype)
        fused = LigerSwiGLUMLP(cfg).to(device, dtype)
        fused.load_state_dict(plain.state_dict())
        out["swiglu"] = pair(plain, fused, x[:, :256])
        heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        q = torch.randn(4, heads, 1024, d, generator=g).to(device, dtype)
        k = torch.randn(4, cfg.num_key_value_heads, 1024, d, generator=g).to(device, dtype)
        rot = ml.LlamaRotaryEmbedding(cfg).to(device)
        pos = torch.arange(1024, device=device)[None].expand(4, -1)
        cos, sin = rot(q, pos)

        def plain_rope(a, b):  # transformers' apply_rotary_pos_emb, spelled out: Liger may have patched the module's
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            return a * c + ml.rotate_half(a) * s, b * c + ml.rotate_half(b) * s

        out["rope"] = pair(plain_rope, lambda a, b: liger_rotary_pos_emb(a, b, cos, sin), q, k)
    except Exception as e:  # noqa: BLE001
        out.setdefault("error", f"{type(e).__name__}: {e}"[:500])
    return out


def run(device: torch.device, dtype: torch.dtype) -> dict:
    """Every check on ``device`` in ``dtype``; ``failed``: the names of those that ran and differ."""
    res = {
        "varlen_attention": varlen(device, dtype),
        "linear_cross_entropy": linear_cross_entropy(device, dtype),
        "liger": liger_modules(device, dtype),
    }
    res["failed"] = [
        f"{group}.{name}"
        for group, r in res.items()
        if isinstance(r, dict)
        for name, v in r.items()
        if isinstance(v, dict) and v.get("ok") is False
    ] + [f"{group}.error" for group, r in res.items() if isinstance(r, dict) and "error" in r]
    return res
