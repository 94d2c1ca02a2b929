"""Load the student, add LoRA, and shard it with FSDP2.

* Base weights in 4-bit NF4 (bitsandbytes, ``bnb_4bit_quant_storage`` = compute dtype so FSDP
  can shard the packed weights like any tensor) or in the compute dtype for plain LoRA.
* PEFT LoRA on the spec's target modules. PEFT keeps adapter weights in fp32; FSDP2 needs one
  dtype per sharded unit, so every LoRA ``Linear`` is its own FSDP unit (fp32), then each decoder
  layer (frozen base weights), then the root.
* Topology from one field: ``full`` shards across all ranks (1-D mesh), ``hybrid`` shards
  inside a node and replicates across nodes (2-D mesh, HSDP), ``none`` replicates (DDP-like).
"""

from __future__ import annotations

import torch
from torch import nn

from campaigns.spec import StudentSpec, TrainingSpec


def device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def load_student(base_model_path: str, student: StudentSpec, device: torch.device):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    q = student.quantization
    dtype = getattr(torch, q.compute_dtype)
    kwargs: dict = {"dtype": dtype}
    if q.load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=q.quant_type,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=dtype,
            bnb_4bit_use_double_quant=q.double_quant,
        )
        if device.type == "cuda":
            kwargs["device_map"] = {"": device.index}
    model = AutoModelForCausalLM.from_pretrained(base_model_path, **kwargs)
    if not q.load_in_4bit:
        model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    lora = LoraConfig(
        r=student.lora.r,
        lora_alpha=student.lora.alpha,
        lora_dropout=student.lora.dropout,
        target_modules=list(student.lora.target_modules),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)  # adapters in fp32 (autocast_adapter_dtype=True)
    missing = [m for m in student.lora.target_modules if not any(n.endswith(m) for n, _ in model.named_modules())]
    if missing:
        raise ValueError(f"student.lora.target_modules {missing} match no module of {base_model_path}")
    if device.type == "cuda":
        model.to(device)
    return model


def build_mesh(training: TrainingSpec, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    kind = device.type
    if training.sharding == "hybrid":
        return init_device_mesh(kind, (training.nodes, training.processes_per_node), mesh_dim_names=("replicate", "shard"))
    if training.sharding == "none":
        return init_device_mesh(kind, (training.world_size, 1), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(kind, (training.world_size,), mesh_dim_names=("shard",))


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    for name, mod in model.named_modules():
        if name.endswith(".layers") and isinstance(mod, nn.ModuleList):
            return list(mod)
    raise ValueError("could not find the decoder layers (a ModuleList named 'layers') to shard")


def shard(model: nn.Module, mesh) -> nn.Module:
    """FSDP2: LoRA linears, then decoder layers, then the root."""
    from torch.distributed.fsdp import fully_shard

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and (".lora_A." in name + "." or ".lora_B." in name + "."):
            fully_shard(mod, mesh=mesh)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
