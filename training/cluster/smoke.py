"""The two lowest rungs of the cluster validation ladder.

``python -m training.cluster.smoke env --out env.json``
    Environment smoke (one process): Python and library versions, devices visible, CUDA / NCCL /
    driver versions, which distributed backends are built in. Proves the software stack loads and
    sees its devices; proves nothing about talking to other ranks.

``torchrun ... -m training.cluster.smoke allreduce --out grads.json``
    Distributed smoke: every rank computes gradients of the same small model on its shard of one
    global batch; the gradients are summed (``ReduceOp.SUM``, scaled by the global sample count)
    and averaged (``ReduceOp.AVG``) across ranks with gloo or NCCL, and compared with the gradient
    of a single process on the whole batch. Proves the collectives are *correct* (a reduction bug,
    a wrong world size, a rank on another model would break equality); says nothing about speed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "safetensors", "dagster", "dagster-pipes")


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    nccl = None
    if cuda and dist.is_nccl_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "versions": {p: _version(p) for p in PACKAGES},
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "driver_version": _driver_version(),
        "nccl_version": nccl,
        "device_count": len(devices),
        "devices": devices,
        "gloo_available": dist.is_gloo_available(),
        "nccl_available": dist.is_nccl_available(),
        "backend": "nccl" if cuda else "gloo",
    }


def fingerprint(env: dict[str, Any]) -> dict[str, str]:
    """What, when it changes between two runs, explains their numbers moving (flat, comparable strings)."""
    flat = {f"version:{k}": str(v) for k, v in env["versions"].items()}
    for k in (
        "python",
        "cuda_version",
        "driver_version",
        "nccl_version",
        "backend",
        "device_count",
        "cpu_count",
        "usable_cpus",
    ):
        flat[k] = str(env.get(k))
    flat["devices"] = ",".join(env.get("devices") or []) or "none"
    return flat


# --------------------------------------------------------------------------- all-reduce smoke


def _model_and_batch(world: int, per_rank: int = 4, dim: int = 16, seed: int = 1234):
    import torch

    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(world * per_rank, dim, generator=g)
    y = torch.randn(world * per_rank, 1, generator=g)
    return model, x, y


def _grads(model, x, y, total: int):
    import torch

    model.zero_grad(set_to_none=True)
    loss = ((model(x) - y) ** 2).sum() / total
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()


def gradient_equality(per_rank: int = 4) -> dict[str, Any]:
    """Inside an initialized process group; identical result on every rank."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    model, x, y = _model_and_batch(world, per_rank)
    model = model.to(device)
    x, y = x.to(device), y.to(device)
    total = x.shape[0]
    reference = _grads(model, x, y, total)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    local = _grads(model, x[mine], y[mine], total)
    summed = local.clone().float()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    sum_diff = float((summed.double() - reference).abs().max())
    avg_diff, avg_error = float("inf"), None
    try:
        averaged = (local * world).float()
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
        avg_diff = float((averaged.double() - reference).abs().max())
    except (RuntimeError, ValueError) as e:  # a backend without AVG is a finding, not a crash
        avg_error = f"{type(e).__name__}: {e}"
    # The worst rank decides, and every rank must hold the same reduced gradient.
    stats = torch.tensor(
        [sum_diff, avg_diff, float(summed.double().sum()), -float(summed.double().sum())],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {
        "world_size": world,
        "backend": dist.get_backend(),
        "parameters": int(reference.numel()),
        "sum_max_abs_diff": float(stats[0]),
        "avg_max_abs_diff": None if avg_error else float(stats[1]),
        "avg_error": avg_error,
        "ranks_agree": bool(float(stats[2]) == -float(stats[3])),
    }


def gradients_equal(result: dict[str, Any], tolerance: float = 1e-5) -> tuple[bool, str]:
    problems = []
    if result["sum_max_abs_diff"] > tolerance:
        problems.append(f"SUM all-reduce differs from the single-process gradient by {result['sum_max_abs_diff']:.3g}")
    avg = result.get("avg_max_abs_diff")
    if avg is None:
        problems.append(f"AVG all-reduce failed: {result.get('avg_error')}")
    elif avg > tolerance:
        problems.append(f"AVG all-reduce differs from the single-process gradient by {avg:.3g}")
    if not result["ranks_agree"]:
        problems.append("ranks hold different reduced gradients")
    if problems:
        return False, "; ".join(problems)
    return True, (
        f"{result['world_size']} ranks ({result['backend']}): SUM and AVG all-reduce match the single-process "
        f"gradient within {tolerance:g} (max diff {max(result['sum_max_abs_diff'], avg):.2g})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.cluster.smoke", description="Cluster validation smoke tests.")
    ap.add_argument("what", choices=["env", "allreduce"])
    ap.add_argument("--out", help="write the result as JSON here (rank 0)")
    args = ap.parse_args(argv)
    if args.what == "env":
        result = environment()
    else:
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            result = gradient_equality()
            rank = dist.get_rank()
            dist.barrier()
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return 0
    print(json.dumps(result, indent=2), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
