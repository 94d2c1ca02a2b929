"""Load the student, add LoRA, and shard it with FSDP2.

* Base weights in 4-bit NF4 (bitsandbytes, ``bnb_4bit_quant_storage`` = compute dtype so FSDP
  can shard the packed weights like any tensor) or in the compute dtype for plain LoRA.
* PEFT LoRA on the spec's target modules. PEFT keeps adapter weights in fp32; FSDP2 needs one
  dtype per sharded unit, so every LoRA ``Linear`` is its own FSDP unit (fp32), then each decoder
  layer (frozen base weights), then the root.
* Topology from one field: ``full`` shards across all ranks (1-D mesh), ``hybrid`` shards
  inside a node and replicates across nodes (2-D mesh, HSDP), ``none`` replicates (DDP-like).
* Mixed precision (``MixedPrecisionPolicy``): base units compute in the compute dtype (equal to
  the 4-bit quant storage, so FSDP never casts packed weights); LoRA units keep their fp32
  parameters for compute, as PEFT intends; gradients are reduced in fp32.
* Optional activation checkpointing (non-reentrant, per decoder layer) before sharding; optional
  ``torch.compile`` of each decoder layer's forward (:func:`compile_layers`).
* ``reshard_after_forward`` (``training.reshard_after_forward``): whether FSDP2 frees each unit's gathered
  parameters after its forward (and gathers them again in backward) or keeps them until its backward.
* A world of one is never sharded (the trainer trains the plain module: nothing to shard, FSDP2 would only
  add per-unit hooks and copies); ``tests/training/test_world_of_one.py`` checks both give the same loss and
  LoRA gradients.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from campaign_orchestrator.hardware import device_memory_gb  # noqa: F401 - the trainer's and the benchmarks' name
from campaigns.spec import StudentSpec, TrainingSpec


def device_for(
    local_rank: int, gpu_required: bool = False, allow_cpu_fallback: bool = False, hardware: str | None = None
) -> torch.device:
    """This rank's device: its GPU when torch sees one, else the CPU. ``gpu_required`` (the campaign is
    priced for a GPU): no GPU is an error, before anything is loaded, unless ``allow_cpu_fallback``."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if gpu_required and not allow_cpu_fallback:
        from training.errors import TrainingError

        raise TrainingError(
            f"training.hardware {hardware!r} is priced per GPU-hour but this process sees no GPU "
            f"(torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
            f"torch {torch.__version__}, CUDA build {torch.version.cuda}): refusing to train on the CPU and bill it as "
            "GPU time. Run where the GPU is visible, set training.hardware to the CPU entry you train on, or set "
            "training.allow_cpu_fallback: true with training.cpu_hardware to train on the CPU billed as CPU time"
        )
    return torch.device("cpu")


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """``torch.compile`` each decoder layer's ``forward`` in place; returns the layers compiled. The module tree,
    parameter names, FSDP units and adapter files stay as they are, and the module's hooks (FSDP2's all-gather
    and reshard, activation checkpointing's wrapper) run around the compiled forward, not inside it, as in
    torchtitan's per-block compile. Compiled layers see varying sequence lengths: the first steps compile (a
    static graph, then a dynamic one), later ones reuse them."""
    layers = _decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend)
    return len(layers)


def compile_count() -> int:
    """Graphs torch.compile has compiled in this process so far (a step that raised it was compiling)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def attention_kernel(student: StudentSpec, device: torch.device, max_seq_len: int, shape: dict | None = None) -> str:
    """The attention implementation ``auto`` resolves to (see ``StudentSpec.attn_implementation``).

    With ``shape`` (``config``, ``row_tokens``, ``seq_len``, ``dtype``: the micro-batch the trainer will
    run), the fastest of eager, sdpa and segment_eager measured at that shape on this host
    (``training.attention.choose_kernel``, cached); without it, eager on a CPU up to 512 tokens, else sdpa."""
    if student.attn_implementation != "auto":
        return student.attn_implementation
    if shape is not None:
        from training.attention import choose_kernel

        return choose_kernel(device=device, **shape)[0]
    return "eager" if device.type == "cpu" and max_seq_len <= 512 else "sdpa"


def load_student(
    base_model_path: str,
    student: StudentSpec,
    device: torch.device,
    activation_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    compute_dtype: str | None = None,
    recompute_cheap: bool = True,
):
    """The frozen base (4-bit or in ``compute_dtype``, the resolved dtype: never ``auto``) with LoRA adapters.

    ``recompute_cheap``: keep fewer activations for backward by recomputing the SwiGLU products, the
    norms' outputs and PEFT's input casts in backward, exactly (training/recompute.py); off under
    activation checkpointing."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    q = student.quantization
    if attn_implementation in ("segment_eager", "varlen"):
        from training.attention import register

        register()  # attention per packed sequence (training/attention.py)
    name = compute_dtype or q.compute_dtype
    if name == "auto":
        raise ValueError(
            "load_student needs a resolved compute dtype (campaign_orchestrator.hardware.resolve_compute_dtype)"
        )
    dtype = getattr(torch, name)
    kwargs: dict = {"dtype": dtype, "attn_implementation": attn_implementation}
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
    if q.load_in_4bit:
        keep_4bit_layout(model)
    else:
        model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    if activation_checkpointing:
        # Non-reentrant checkpointing needs no input that requires grad (the embeddings are frozen).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    from training import moe

    # LoRA on target_modules (nn.Linear) and, for a mixture of experts, target_parameters (the fused expert
    # tensors, through PEFT's ParamWrapper), the per-expert rank rule and the router (training/moe.py).
    moe.check_targets(model, student, base_model_path)
    lora = LoraConfig(**moe.lora_kwargs(student, model.config))
    model = get_peft_model(model, lora)  # adapters in fp32 (autocast_adapter_dtype=True)
    moe.check_peft_kept_targets(model, student, base_model_path)
    if recompute_cheap and not activation_checkpointing:
        from training import recompute

        recompute.apply(model)
    if device.type == "cuda":
        model.to(device)
    return model


def keep_4bit_layout(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference; returns the layers changed.

    On a CPU with AVX512-BF16, ``Linear4bit.forward`` in eval mode without grad rewrites
    ``weight.data`` into a CPU-specific packed layout and flags the *shared* ``quant_state``. Under
    FSDP2 the rewritten data is the all-gathered copy, dropped at reshard, while the flag stays: every
    later forward decodes the original bytes as the packed layout and computes nonsense (silently).
    The trainer evaluates in eval mode, so it keeps the standard layout everywhere.
    """
    import bitsandbytes as bnb

    n = 0
    for mod in model.modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            mod.support_avx512bf16_for_cpu = False
            n += 1
    return n


def build_mesh(training: TrainingSpec, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    kind = device.type
    if training.sharding == "hybrid":
        return init_device_mesh(
            kind, (training.nodes, training.processes_per_node), mesh_dim_names=("replicate", "shard")
        )
    if training.sharding == "none":
        return init_device_mesh(kind, (training.world_size, 1), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(kind, (training.world_size,), mesh_dim_names=("shard",))


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    for name, mod in model.named_modules():
        if name.endswith(".layers") and isinstance(mod, nn.ModuleList):
            return list(mod)
    raise ValueError("could not find the decoder layers (a ModuleList named 'layers') to shard")


def _is_lora_linear(name: str, mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) and (".lora_A." in name + "." or ".lora_B." in name + ".")


def shard(model: nn.Module, mesh, compute_dtype: torch.dtype, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2, innermost first: each layer's LoRA linears as one fp32 unit, the layer, then the root.

    Grouping a layer's LoRA linears into one unit (``fully_shard([...])``) keeps their fp32 dtype
    apart from the compute-dtype base weights while costing one all-gather per layer, not one per
    adapter matrix. ``reshard_after_forward`` goes to every unit (``TrainingSpec.resharding_after_forward``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    lora_mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    base_mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = _decoder_layers(model)
    for layer in layers:
        loras = [m for n, m in layer.named_modules() if _is_lora_linear("." + n, m)]
        if loras:
            fully_shard(loras, mesh=mesh, mp_policy=lora_mp, reshard_after_forward=reshard_after_forward)
        fully_shard(layer, mesh=mesh, mp_policy=base_mp, reshard_after_forward=reshard_after_forward)
    outside = [
        m
        for n, m in model.named_modules()
        if _is_lora_linear("." + n, m) and not any(m is x for layer in layers for x in layer.modules())
    ]
    if outside:  # LoRA on modules outside the decoder layers (e.g. lm_head)
        fully_shard(outside, mesh=mesh, mp_policy=lora_mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=base_mp, reshard_after_forward=reshard_after_forward)
    return model


def check_4bit_storage(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Every 4-bit packed weight is stored in ``compute_dtype`` words (``bnb_4bit_quant_storage``) and computes in
    it; returns how many were checked. FSDP2 casts a unit's parameters to its ``param_dtype`` (the compute dtype):
    packed bytes stored as uint8 (a checkpoint quantized with another storage) would be converted as numbers and
    decode to garbage (loss 0 / NaN, accelerate#3983). Raises ``ValueError`` naming the first mismatch."""
    import bitsandbytes as bnb

    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            stored = mod.weight.dtype
            compute = getattr(mod, "compute_dtype", None) or compute_dtype
            if stored != compute_dtype or compute != compute_dtype:
                raise ValueError(
                    f"4-bit weight {name}.weight is stored as {stored} and computes in {compute}, but FSDP2 shards "
                    f"it as {compute_dtype}: quantize the base on load (a bf16/fp32 checkpoint, not a pre-quantized "
                    f"one) so bnb_4bit_quant_storage is the compute dtype, or set student.quantization.compute_dtype "
                    f"to {stored}"
                )
            n += 1
    return n


def _bits_checksum(t: torch.Tensor) -> int:
    """A position-weighted checksum of a tensor's raw 16-bit words (any bit change shows)."""
    w = t.detach().contiguous().view(torch.int16).reshape(-1).to(torch.int64)
    pos = torch.arange(w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
    return int((w * pos).sum())


def packed_4bit_checksums(model: nn.Module) -> dict[str, int]:
    """Checksums of every 4-bit packed weight, by parameter name (call before sharding)."""
    import bitsandbytes as bnb

    return {n: _bits_checksum(p) for n, p in model.named_parameters() if isinstance(p, bnb.nn.Params4bit)}


def verify_sharded_4bit(model: nn.Module, before: dict[str, int]) -> int:
    """Unshard each decoder layer once and check its packed 4-bit weights are bit-identical.

    FSDP2 moves 4-bit weights as compute-dtype words; any path that treats those words as numbers
    (NaN canonicalization, bitsandbytes#1945) silently changes the decoded weights. Collective: one
    all-gather per layer, as in one forward. Raises ``ValueError`` naming the first corrupted weight.
    """
    if not before:
        return 0
    checked = 0
    for layer in _decoder_layers(model):
        layer.unshard()
        try:
            prefix = next(n for n, m in model.named_modules() if m is layer)
            for n, p in layer.named_parameters():
                full = f"{prefix}.{n}"
                if full in before and not hasattr(p, "device_mesh"):
                    if _bits_checksum(p) != before[full]:
                        raise ValueError(
                            f"4-bit weight {full} changed bits in FSDP2's all-gather: the sharded model would "
                            f"compute with corrupted base weights (see bitsandbytes#1945). Use sharding 'none' or "
                            f"a bf16 base (quantization.load_in_4bit: false) on this stack"
                        )
                    checked += 1
        finally:
            layer.reshard()
    return checked


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
