"""Attention per packed sequence: ``attn_implementation="segment_eager"`` (no padding anywhere, no cross-sequence work).

A padding-free micro-batch is one row of ``T`` tokens holding many sequences (``position_ids`` restart
at 0 at each). transformers' eager and sdpa kernels compute that row's full ``T × T`` scores and then
mask everything outside the block diagonal: at 4 packed rows of 128 tokens, ``T`` ≈ 430 and the
sequences are ~40 tokens, so ~90% of the score matrix (its matmuls, softmax and the activations kept
for backward) is thrown away. ``segment_eager`` runs eager attention on each sequence alone (what
flash-attention's varlen kernel does on a GPU), so the cost is Σ len² instead of T².

``attn_implementation="varlen"`` is the same idea on a GPU: the row's sequences go to one
variable-length kernel call, PyTorch's flash-backed ``torch.nn.attention.varlen.varlen_attn`` (cumulative
sequence lengths, no ``T × T`` mask) where the installed torch has it, else FlexAttention with a
document mask (compiled; it skips the masked blocks). On a CPU neither trains (``varlen_attn`` is
CUDA-only and FlexAttention has no backward there), so ``varlen`` runs ``segment_eager`` there; it is a
candidate of the measurement only where its fast path exists (:func:`candidates`).

Both are registered with transformers' ``AttentionInterface`` (and, for the mask, the flash-attention
mask function, which builds no ``T × T`` mask) by :func:`register`; ``training.model.load_student``
calls it before loading a model with one of them. Padded rows (``longest`` / ``max_length``) work
too: the collator gives pads a position segment of their own.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

NAME = "segment_eager"
VARLEN = "varlen"
CUSTOM = (NAME, VARLEN)  # the kernels this module registers with transformers
_registered = False


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the sequences packed in one row of ``position_ids`` (a restart at 0 opens one)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0, as_tuple=True)[0].tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    bounds = [*starts, pos.numel()]
    return [(s, e) for s, e in zip(bounds, bounds[1:], strict=False) if e > s]


# Outside any compiled graph (``training.compile``): the sequences are read on the host (``segments``), so a compiled
# layer would be specialized, and compiled again, for every count of sequences a row holds (recompiles until dynamo's
# limit, then eager frames); disabled, the layer's graph stops before it and resumes after it.
@torch.compiler.disable
def segment_eager_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    **kwargs,
):
    """Causal eager attention on each sequence of each row of a ``[B, H, T, D]`` query; ``([B, T, H, D], None)``.

    Sequences are read from ``position_ids`` (the model always passes them); ``attention_mask`` is not
    needed: the trainer's padded rows give their pads a position segment of their own, so a pad is never
    in a real token's sequence."""
    b, heads, t, d = query.shape
    if position_ids is None:
        position_ids = torch.arange(t, device=query.device).expand(b, t)
    kv = key.size(1)
    groups = heads // kv
    # Grouped-query attention without repeating k and v per query head (transformers' repeat_kv copies them
    # to every head, and backward keeps those copies): the ``groups`` query heads that share a kv head are
    # stacked along the rows of one matmul against that kv head.
    rows = []
    for r in range(b):
        outs = []
        for s, e in segments(position_ids[r if position_ids.size(0) > 1 else 0]):
            n = e - s
            q = query[r : r + 1, :, s:e].reshape(1, kv, groups * n, d)
            k, v = key[r : r + 1, :, s:e], value[r : r + 1, :, s:e]
            w = torch.matmul(q, k.transpose(2, 3)) * scaling  # [1, kv, groups * n, n]
            if n > 1:
                future = torch.ones(n, n, dtype=torch.bool, device=w.device).triu_(1).repeat(groups, 1)
                w = w.masked_fill(future, torch.finfo(w.dtype).min)
            w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            if dropout and module.training:
                w = nn.functional.dropout(w, p=dropout, training=True)
            outs.append(torch.matmul(w, v).view(1, heads, n, d))
        rows.append(torch.cat(outs, dim=2) if len(outs) > 1 else outs[0])
    out = torch.cat(rows, dim=0) if b > 1 else rows[0]
    return out.transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------- varlen: one kernel call per row


def flash_varlen():
    """``torch.nn.attention.varlen.varlen_attn`` where the installed torch has it (2.10+), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return flex_attention, create_block_mask


def varlen_backend(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """What ``varlen`` runs on ``device`` (for tensors of ``dtype``, when given): ``flash_varlen`` (torch's
    varlen_attn: half precision only), ``flex`` (FlexAttention with a document mask) or ``segment_eager`` (CPU:
    varlen_attn is CUDA-only and FlexAttention has no backward there)."""
    if device.type != "cuda":
        return NAME
    if flash_varlen() is not None and dtype in (None, torch.float16, torch.bfloat16):
        return "flash_varlen"
    return "flex" if _flex() is not None else NAME


class PackedLayout:
    """The sequences of a ``[B, T]`` batch of position ids laid end to end: ``cu_seqlens`` (int32, ``[N + 1]``),
    ``max_len`` and each token's sequence index ``doc`` (``[B * T]``); a row boundary always opens a sequence."""

    def __init__(self, position_ids: torch.Tensor):
        starts = position_ids == 0
        starts[:, 0] = True
        flat = starts.reshape(-1)
        idx = torch.nonzero(flat, as_tuple=True)[0]
        end = torch.tensor([flat.numel()], dtype=idx.dtype, device=idx.device)
        self.cu_seqlens = torch.cat([idx, end]).to(torch.int32)
        self.max_len = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())  # one host sync per forward
        self.doc = torch.cumsum(flat.to(torch.int32), 0) - 1
        self.tokens = flat.numel()
        self._block_mask = None

    def block_mask(self):
        """FlexAttention's block mask for causal attention within each sequence (built once per layout)."""
        if self._block_mask is None:
            _, create_block_mask = _flex()
            doc = self.doc

            def document_causal(b, h, q, k):
                return (doc[q] == doc[k]) & (q >= k)

            self._block_mask = create_block_mask(
                document_causal, None, None, self.tokens, self.tokens, device=doc.device
            )
        return self._block_mask


_layout_cache: tuple | None = None  # (weakref to the position ids, their version, layout): one per forward


@torch.compiler.disable  # host-side bookkeeping (a weak reference, one sync): outside any compiled graph
def packed_layout(position_ids: torch.Tensor, batch: int) -> PackedLayout:
    """The layout of ``position_ids`` (``[1 or B, T]``), computed once per forward: every decoder layer gets the
    same position-ids tensor, so the layout (and its host sync) is reused while that tensor is alive and unchanged."""
    global _layout_cache
    if position_ids.size(0) != batch:
        position_ids = position_ids.expand(batch, -1)
    c = _layout_cache
    if c is not None and c[0]() is position_ids and c[1] == position_ids._version:
        return c[2]
    layout = PackedLayout(position_ids.detach().clone())
    try:
        _layout_cache = (weakref.ref(position_ids), position_ids._version, layout)
    except TypeError:  # a tensor subclass without weak references: no reuse
        _layout_cache = None
    return layout


_varlen_kwargs: dict | None = None


def _call_flash_varlen(q, k, v, layout: PackedLayout, scaling: float, groups: int):
    """``varlen_attn`` on ``[tokens, heads, D]`` tensors, causal, across its signatures: ``window_size=(-1, 0)``
    (torch 2.11+) or ``is_causal=True`` (2.10); kv heads repeated where it has no ``enable_gqa``."""
    global _varlen_kwargs
    fn = flash_varlen()
    if _varlen_kwargs is None:
        params = inspect.signature(fn).parameters
        kw: dict = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        kw["gqa"] = "enable_gqa" in params
        _varlen_kwargs = kw
    kw = dict(_varlen_kwargs)
    gqa = kw.pop("gqa")
    if groups > 1:
        if gqa:
            kw["enable_gqa"] = True
        else:  # the layout of transformers' repeat_kv: query head h reads kv head h // groups
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu = layout.cu_seqlens
    return fn(q, k, v, cu, cu, layout.max_len, layout.max_len, scale=scaling, **kw)


_compiled_flex = None


def _flex_attention(q, k, v, block_mask, scaling: float, groups: int):
    global _compiled_flex
    flex_attention, _ = _flex()
    if q.device.type == "cuda":  # uncompiled FlexAttention is a reference implementation (it builds T × T scores)
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=True)
        flex_attention = _compiled_flex
    return flex_attention(q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=groups > 1)


def varlen_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    backend: str | None = None,
    **kwargs,
):
    """Causal attention within each packed sequence of a ``[B, H, T, D]`` query in one variable-length kernel
    call (:func:`varlen_backend` says which; ``backend`` forces one); ``([B, T, H, D], None)``."""
    b, heads, t, d = query.shape
    backend = backend or varlen_backend(query.device, query.dtype)
    if backend == NAME or (dropout and module.training):  # neither fused kernel takes attention dropout
        return segment_eager_forward(
            module, query, key, value, attention_mask, scaling, dropout, position_ids=position_ids, **kwargs
        )
    if position_ids is None:
        position_ids = torch.arange(t, device=query.device).expand(b, t)
    layout = packed_layout(position_ids, b)
    kv = key.size(1)
    if backend == "flash_varlen":
        q = query.transpose(1, 2).reshape(b * t, heads, d)
        k = key.transpose(1, 2).reshape(b * t, kv, d)
        v = value.transpose(1, 2).reshape(b * t, kv, d)
        out = _call_flash_varlen(q, k, v, layout, scaling, heads // kv)
        return out.view(b, t, heads, d), None
    if backend != "flex":
        raise ValueError(f"unknown varlen backend {backend!r} (flash_varlen, flex or {NAME})")
    q, k, v = (x.transpose(0, 1).reshape(1, x.size(1), b * t, d) for x in (query, key, value))
    out = _flex_attention(q, k, v, layout.block_mask(), scaling, heads // kv)  # [1, H, B*T, D]
    return out.view(heads, b, t, d).permute(1, 2, 0, 3).contiguous(), None


def register() -> str:
    """Make ``attn_implementation="segment_eager"`` and ``"varlen"`` known to transformers (idempotent); returns
    the first."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

        AttentionInterface.register(NAME, segment_eager_forward)
        AttentionMaskInterface.register(NAME, flash_attention_mask)
        AttentionInterface.register(VARLEN, varlen_forward)
        AttentionMaskInterface.register(VARLEN, flash_attention_mask)
        _registered = True
    return NAME


# --------------------------------------------------------------------------- the kernel, chosen by measurement

CANDIDATES = ("eager", "sdpa", NAME)
CACHE_FILE = "attention_kernels.json"


def candidates(device: torch.device) -> tuple[str, ...]:
    """The kernels measured on ``device``: eager, sdpa, segment_eager, and ``varlen`` where it has a kernel of its
    own there (CUDA; on a CPU it would only be segment_eager again)."""
    return CANDIDATES + ((VARLEN,) if varlen_backend(device) != NAME else ())


def _block_masks(lengths: list[int], device):
    """The masks transformers builds for a padding-free row: boolean (sdpa) and additive (eager)."""
    seg = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])
    t = seg.numel()
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool, device=device).tril()
    additive = torch.zeros(t, t, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return allowed[None, None], additive[None, None]


class _Probe(nn.Module):
    """The attention module a kernel sees in the measurement: training mode, grouped-query groups."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def _eager_step(layer, q, k, v, *, allowed, additive, position_ids, scaling):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward(layer, q, k, v, additive, scaling=scaling)[0]


def _sdpa_step(layer, q, k, v, *, allowed, additive, position_ids, scaling):
    g = layer.num_key_value_groups
    return nn.functional.scaled_dot_product_attention(
        q, _repeat_kv(k, g), _repeat_kv(v, g), attn_mask=allowed, scale=scaling
    )


def _segment_step(layer, q, k, v, *, allowed, additive, position_ids, scaling):
    return segment_eager_forward(layer, q, k, v, None, scaling=scaling, position_ids=position_ids)[0]


def _varlen_step(layer, q, k, v, *, allowed, additive, position_ids, scaling):
    return varlen_forward(layer, q, k, v, None, scaling=scaling, position_ids=position_ids)[0]


# One attention forward of each kernel as the measurement runs it: (layer, q, k, v, *, allowed, additive,
# position_ids, scaling) -> the output (the masks transformers would build for eager and sdpa are given).
KERNEL_STEPS = {"eager": _eager_step, "sdpa": _sdpa_step, NAME: _segment_step, VARLEN: _varlen_step}


def kernel_steps(device: torch.device) -> dict:
    """``{name: step}`` of the kernels measured on ``device`` (:func:`candidates`)."""
    return {k: KERNEL_STEPS[k] for k in candidates(device)}


def time_kernels(
    heads: int,
    kv_heads: int,
    head_dim: int,
    lengths: list[int],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    rounds: int = 5,
    kernels: dict | None = None,
) -> dict[str, float]:
    """Seconds of one attention forward + backward per candidate kernel on a padding-free row of sequences
    of ``lengths``: the best of ``rounds`` after a warm-up, the kernels taking turns round by round (other processes
    only ever slow a round down, and a busy spell then falls on every kernel alike). ``kernels``:
    ``{name: step}`` as :data:`KERNEL_STEPS` (default: :func:`kernel_steps` of ``device``)."""
    import time

    kernels = kernels if kernels is not None else kernel_steps(device)
    layer = _Probe(heads // kv_heads).train()
    t = sum(lengths)
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    allowed, additive = _block_masks(lengths, device)
    additive = additive.to(dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    q0 = torch.randn(1, heads, t, head_dim, generator=g).to(device, dtype)
    k0 = torch.randn(1, kv_heads, t, head_dim, generator=g).to(device, dtype)
    v0 = torch.randn(1, kv_heads, t, head_dim, generator=g).to(device, dtype)
    scale = head_dim**-0.5

    def step(fn) -> None:
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = fn(layer, q, k, v, allowed=allowed, additive=additive, position_ids=pos, scaling=scale)
        out.float().sum().backward()

    runnable = {}
    for kind, fn in kernels.items():
        try:
            step(fn)  # warm-up
        except Exception as e:  # noqa: BLE001 - a fused kernel this device or dtype cannot run is no candidate
            if kind in CANDIDATES:
                raise
            import warnings

            warnings.warn(
                f"attention kernel {kind!r} left out of the measurement: {type(e).__name__}: {e}", stacklevel=2
            )
            continue
        runnable[kind] = fn
    times: dict[str, list[float]] = {k: [] for k in runnable}
    for _ in range(rounds):  # round by round (A, B, C, A, B, C, ...): a busy spell falls on every kernel alike
        for kind, fn in runnable.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            step(fn)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[kind].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def choose_kernel(
    config,
    device: torch.device,
    row_tokens: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | None = None,
    kernels: dict | None = None,
) -> tuple[str, dict]:
    """The fastest attention kernel for a padding-free micro-batch of ``row_tokens`` tokens holding sequences of
    ``seq_len`` tokens, measured here once per host, torch version, threads, device, dtype and shape, then reused
    from the cache (``$CAMPAIGN_CACHE_DIR``, as ``campaign_orchestrator.hardware``), so every later run and every
    rank of one machine computes with the same kernel; processes that ask together wait for the one that measures
    (``hardware.measured_once``). ``kernels``: the candidates (``{name: step}``, default :func:`kernel_steps`).
    Returns the kernel and the record (``measured_now``: whether this call measured)."""
    import socket
    from pathlib import Path

    from campaign_orchestrator.hardware import cache_dir as host_cache_dir
    from campaign_orchestrator.hardware import measured_once

    kernels = kernels if kernels is not None else kernel_steps(device)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    seq_len = max(1, min(seq_len, row_tokens))
    n, rest = divmod(row_tokens, seq_len)
    lengths = [seq_len] * n + ([rest] if rest else [])
    key = "|".join(
        map(
            str,
            (
                socket.gethostname(),
                torch.__version__,
                torch.get_num_threads(),
                device.type,
                str(dtype).removeprefix("torch."),
                heads,
                kv,
                head_dim,
                row_tokens,
                seq_len,
                "+".join(kernels),
            ),
        )
    )

    def measure() -> dict:
        seconds = time_kernels(heads, kv, head_dim, lengths, device, dtype, kernels=kernels)
        return {
            "kernel": min(seconds, key=seconds.get),
            "seconds": {k: round(v, 6) for k, v in seconds.items()},
            "row_tokens": row_tokens,
            "seq_len": seq_len,
            "varlen_backend": varlen_backend(device),
        }

    record, measured = measured_once(Path(cache_dir or host_cache_dir()) / CACHE_FILE, key, measure)
    return record["kernel"], record | {"measured_now": measured}


def batch_shape(rows, micro_batch: int) -> tuple[int, int]:
    """``(tokens of one padding-free micro-batch, mean sequence length)`` of a tokenized dataset
    (``training.data.TokenizedDataset``), from its token counts and the position-id restarts."""
    import numpy as np

    shards = getattr(rows, "_shards", None)
    if shards:
        tokens = sum(int(s.num_tokens.sum()) for s in shards)
        seqs = sum(int((s.values["position_ids"] == 0).sum()) for s in shards)
        n = sum(s.rows for s in shards)
    else:  # a plain dict of lists
        pos = [np.asarray(p) for p in rows["position_ids"]]
        tokens, seqs, n = sum(p.size for p in pos), sum(int((p == 0).sum()) for p in pos), len(pos)
    n, seqs = max(1, n), max(1, seqs)
    return max(1, round(tokens / n * min(micro_batch, n))), max(1, round(tokens / seqs))
