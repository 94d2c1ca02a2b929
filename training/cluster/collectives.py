"""Collective bandwidth sweep: all_reduce, all_gather, reduce_scatter over message sizes.

Run under torchrun (``python -m training.cluster.collectives --max-bytes 16M --out sweep.json``); NCCL on
GPUs, gloo on CPUs. Figures follow nccl-tests (``doc/PERFORMANCE.md``):

* ``size`` is the total buffer: the all_reduce buffer, the all_gather *output*, the
  reduce_scatter *input* (``n`` ranks × the per-rank part);
* ``algbw = size / time``;
* ``busbw = algbw × 2(n−1)/n`` for all_reduce and ``algbw × (n−1)/n`` for all_gather and
  reduce_scatter: the per-link bandwidth a ring achieves, comparable across rank counts and with
  the hardware's peak;
* ``time`` is the mean over ``iters`` back-to-back calls, the slowest rank's (max over ranks).

Every size is checked for correctness first (ranks contribute rank+1; the result is compared
with the exact sum), like nccl-tests' ``#wrong`` column.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

OPS = ("all_reduce", "all_gather", "reduce_scatter")
ELEMENT_BYTES = 4  # float32


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``n`` ranks."""
    if n < 1:
        raise ValueError(f"rank count must be >= 1, got {n}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")


def parse_bytes(text: str | int) -> int:
    """``8``, ``64K``, ``16M``, ``1G`` (binary multiples) to bytes."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"not a byte size: {text!r} (expected e.g. 8, 64K, 16M, 1G)") from None


def message_sizes(min_bytes: int = 8, max_bytes: int = 1 << 24, factor: int = 2) -> list[int]:
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, {factor}")
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def per_rank_elements(op: str, size: int, n: int) -> int:
    """Elements each rank contributes (all_reduce) or owns (all_gather input / reduce_scatter output)."""
    if op == "all_reduce":
        return max(1, size // ELEMENT_BYTES)
    return max(1, size // (ELEMENT_BYTES * n))


def row_for(op: str, size_bytes: int, seconds: float, n: int) -> dict[str, Any]:
    algbw = size_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return {
        "op": op,
        "bytes": size_bytes,
        "time_us": seconds * 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * bus_factor(op, n),
    }


def _setup(op: str, size: int, n: int, rank: int, device):
    import torch
    import torch.distributed as dist

    per = per_rank_elements(op, size, n)
    if op == "all_reduce":
        buf = torch.full((per,), float(rank + 1), device=device)
        return per * ELEMENT_BYTES, buf, (lambda: dist.all_reduce(buf)), (lambda: buf)
    if op == "all_gather":
        inp = torch.full((per,), float(rank + 1), device=device)
        out = torch.empty(per * n, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        return per * n * ELEMENT_BYTES, inp, (lambda: gather(out, inp)), (lambda: out)
    inp = torch.full((per * n,), float(rank + 1), device=device)
    out = torch.empty(per, device=device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return per * n * ELEMENT_BYTES, inp, (lambda: scatter(out, inp)), (lambda: out)


def _expected(op: str, n: int, per: int, device):
    import torch

    if op == "all_gather":
        return torch.arange(1, n + 1, dtype=torch.float32, device=device).repeat_interleave(per)
    return torch.full((per,), float(n * (n + 1) / 2), device=device)


def sweep(
    ops: tuple[str, ...] = OPS, max_bytes: int = 1 << 24, min_bytes: int = 8, iters: int = 10, warmup: int = 3
) -> dict[str, Any]:
    """Inside an initialized process group: every op × size; identical result on every rank."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for op in ops:
        for size in message_sizes(min_bytes, max_bytes):
            nbytes, _inp, fn, result = _setup(op, size, n, rank, device)
            fn()
            sync()
            per = per_rank_elements(op, size, n)
            ok = bool(torch.equal(result(), _expected(op, n, per, device)))
            for _ in range(warmup):
                fn()
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters, 0.0 if ok else 1.0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            row = row_for(op, nbytes, float(elapsed[0]), n)
            row["wrong"] = int(elapsed[1])
            rows.append(row)
    return {
        "world_size": n,
        "backend": dist.get_backend(),
        "device": device.type,
        "iters": iters,
        "warmup": warmup,
        "min_bytes": min_bytes,
        "max_bytes": max_bytes,
        "rows": rows,
        "summary": summarize(rows),
    }


def summarize(rows: list[dict[str, Any]], edge: int = 3) -> dict[str, dict[str, float]]:
    """Per op: ``plateau_busbw_gbps`` (median bus bandwidth of the ``edge`` largest sizes) and
    ``latency_floor_us`` (median time of the ``edge`` smallest sizes)."""
    out = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
        out[op] = {
            "plateau_busbw_gbps": statistics.median(r["busbw_gbps"] for r in mine[-edge:]),
            "latency_floor_us": statistics.median(r["time_us"] for r in mine[:edge]),
            "wrong": sum(r.get("wrong", 0) for r in mine),
        }
    return out


def _human(b: int) -> str:
    for unit, s in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= s:
            return f"{b / s:g}{unit}"
    return f"{b}B"


def render(result: dict[str, Any]) -> str:
    lines = [
        f"# {result['backend']} on {result['device']}, {result['world_size']} ranks, "
        f"{result['iters']} iterations (busbw: all_reduce x2(n-1)/n, all_gather/reduce_scatter x(n-1)/n)",
        f"{'op':>15} {'size':>8} {'time us':>11} {'algbw GB/s':>11} {'busbw GB/s':>11} {'wrong':>6}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['op']:>15} {_human(r['bytes']):>8} {r['time_us']:11.1f} {r['algbw_gbps']:11.4f} "
            f"{r['busbw_gbps']:11.4f} {r.get('wrong', 0):6d}"
        )
    for op, s in result["summary"].items():
        lines.append(
            f"# {op}: plateau busbw {s['plateau_busbw_gbps']:.4f} GB/s, latency floor {s['latency_floor_us']:.1f} us"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.cluster.collectives", description="Collective bandwidth sweep (torchrun)."
    )
    ap.add_argument("--max-bytes", default="16M", help="largest message (e.g. 64K, 16M, 8G); default 16M")
    ap.add_argument("--min-bytes", default="8")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of {OPS}")
    ap.add_argument("--out", help="write the result as JSON here (rank 0)")
    args = ap.parse_args(argv)
    ops = tuple(o for o in args.ops.split(",") if o)
    for o in ops:
        bus_factor(o, 1)
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        result = sweep(ops, parse_bytes(args.max_bytes), parse_bytes(args.min_bytes), args.iters, args.warmup)
        if dist.get_rank() == 0:
            print(render(result), flush=True)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=2))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
