"""Whole tensors behind sharded ones (FSDP2's DTensors), and back: below the model, MoE and checkpoint modules, which
all need them (``tests/test_layers.py`` fails on an import circle)."""

from __future__ import annotations

import torch


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) parameter or state; collective for a DTensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def load_full_into(dest: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (significant on global rank 0 only) into ``dest``, sharded like ``dest``; collective."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(dest, DTensor):
            part = distribute_tensor(
                full.to(dest.device, dest.dtype), dest.device_mesh, dest.placements, src_data_rank=0
            )
            dest.to_local().copy_(part.to_local())
        else:
            import torch.distributed as dist

            full = full.to(dest.device, dest.dtype).contiguous()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(full, src=0)
            dest.copy_(full)
