"""Per-device memory of LoRA / QLoRA training, before anything runs (the planner's memory half).

Memory (per device, decimal GB) for LoRA/QLoRA training under the campaign's topology:

* ZeRO / FSDP model states with Adam (K = 12 bytes of optimizer state per parameter: fp32
  master weights, momentum and variance), Ψ parameters, N ranks sharing the states
  (Rajbhandari et al. 2020, "ZeRO", §5)::

      stage 0 (DDP, sharding: none)      (2 + 2 + K) Ψ
      stage 1 (optimizer states)         4Ψ + KΨ/N
      stage 2 (+ gradients)              2Ψ + (2 + K)Ψ/N
      stage 3 (+ parameters; FSDP full)  (2 + 2 + K)Ψ/N
      hybrid (HSDP)                      stage 3 with N = ranks per node (the shard group)

  7.5B parameters on 64 GPUs: 120.0, 31.40625, 16.640625 and 1.875 GB.
* LoRA: the frozen base holds weights only (NF4: 0.5 byte per quantized parameter plus one fp32
  absmax per 64-value block, or ~0.016 byte/param with double quantization; embeddings, norms and
  the LM head stay in the compute dtype), sharded over the shard group. Only the adapters
  (r·(d_in + d_out) per target module) carry gradients and optimizer states: (2 + 2 + K)·Ψ_lora,
  sharded the same way. FSDP all-gathers one decoder layer at a time (plus one prefetched): a
  buffer of two unsharded layers.
* Activations per token and layer in bf16 (after Korthikanti et al. 2022, adapted to a Llama
  block with SwiGLU and fused/flash attention, so no s² term): 2·(6h + 2·kv + 4i) bytes plus the
  LoRA intermediates; with activation checkpointing only each layer's input (2h bytes) is kept
  and one layer is recomputed at a time. The logits add b·s·V·10 bytes (bf16 logits, fp32 copy for
  the loss and its gradient).

Pure Python; reads model ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from campaigns.spec import CampaignSpec

GB = 1e9
ADAM_K = 12
NF4_BLOCK = 64


class PlanError(ValueError):
    """The campaign cannot be planned (a model config, a catalog entry or a field the planner cannot read)."""


# --------------------------------------------------------------------------- ZeRO / FSDP


def zero_model_state_bytes(psi: float, n: int, stage: int, k: int = ADAM_K) -> float:
    """Per-rank bytes of weights + gradients + optimizer states (mixed precision, Adam: K=12)."""
    if n < 1:
        raise PlanError(f"ranks must be >= 1, got {n}")
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (2 + 2 + k) * psi / n
    raise PlanError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")


def shard_group(sharding: str, world: int, processes_per_node: int) -> int:
    """Ranks that share one copy of the sharded states: all (full), a node (hybrid), one (none)."""
    return {"full": world, "hybrid": processes_per_node, "none": 1}[sharding]


def zero_table(psi: float, world: int, processes_per_node: int, k: int = ADAM_K) -> dict[str, float]:
    """Full fine-tuning model states per rank (GB) under every scheme, for comparison."""
    return {
        "zero0_ddp": zero_model_state_bytes(psi, world, 0, k) / GB,
        "zero1": zero_model_state_bytes(psi, world, 1, k) / GB,
        "zero2": zero_model_state_bytes(psi, world, 2, k) / GB,
        "zero3_fsdp_full": zero_model_state_bytes(psi, world, 3, k) / GB,
        "fsdp_hybrid": zero_model_state_bytes(psi, processes_per_node, 3, k) / GB,
    }


# --------------------------------------------------------------------------- model shape

LINEAR_DIMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer in the Llama / Qwen / Mistral layout."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config.json") -> ModelShape:
        try:
            h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(hidden=h, intermediate=int(cfg["intermediate_size"]), layers=int(cfg["num_hidden_layers"]),
                       heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                       head_dim=int(cfg.get("head_dim") or h // heads), vocab=int(cfg["vocab_size"]),
                       tied=bool(cfg.get("tie_word_embeddings", False)))
        except KeyError as e:
            raise PlanError(f"{where}: missing {e.args[0]!r}; the planner reads Llama-style configs "
                            "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size)") from None

    @classmethod
    def from_model_dir(cls, path: Path) -> ModelShape:
        cfg = Path(path) / "config.json"
        if not cfg.exists():
            raise PlanError(f"no config.json in {path}; the planner needs the model's config to size it")
        return cls.from_config(json.loads(cfg.read_text()), str(cfg))

    def module_dims(self) -> dict[str, tuple[int, int]]:
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder layers' linear projections (what 4-bit quantization packs)."""
        return self.layers * sum(a * b for a, b in self.module_dims().values())

    @property
    def other_params(self) -> int:
        """Embeddings, LM head (unless tied) and norms, kept in the compute dtype."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * 2 * self.hidden + self.hidden

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params

    def layer_weight_params(self) -> int:
        return self.linear_params // self.layers + 2 * self.hidden

    def lora_params(self, r: int, targets: list[str]) -> int:
        dims = self.module_dims()
        unknown = [t for t in targets if t not in dims]
        if unknown:
            raise PlanError(f"student.lora.target_modules: the planner knows {list(dims)}, not {unknown}")
        return self.layers * sum(r * (dims[t][0] + dims[t][1]) for t in targets)


# --------------------------------------------------------------------------- memory


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def training_memory(shape: ModelShape, spec: CampaignSpec, seq_len: int, compute_dtype: str = "bfloat16",
                    runtime_gb: float = 0.0, attention: str = "sdpa") -> dict:
    """Per-device memory of the student's LoRA/QLoRA training under the campaign's topology.

    ``compute_dtype`` is the resolved dtype (never ``auto``): it sets the bytes of the unquantized
    weights, the activations and the logits. ``runtime_gb`` is the process's own footprint before any
    model loads (Python, torch, transformers, peft: measured 0.47 GB on CPU; on a GPU the allocator
    peak the trainer reports excludes it, so GPU catalog entries leave it 0). ``attention`` ``eager``
    keeps the softmax probabilities of every layer (b·heads·s² per layer), ``sdpa`` does not."""
    s, tr = spec.student, spec.training
    n = shard_group(tr.sharding, tr.world_size, tr.processes_per_node)
    q = s.quantization
    w = DTYPE_BYTES[compute_dtype]
    if q.load_in_4bit:
        absmax = 1 / NF4_BLOCK + 4 / (NF4_BLOCK * 256) if q.double_quant else 4 / NF4_BLOCK
        base_bytes = shape.linear_params * (0.5 + absmax) + shape.other_params * w
        layer_bytes = (shape.linear_params / shape.layers) * (0.5 + absmax) + 2 * w * shape.hidden
    else:
        base_bytes = shape.params * w
        layer_bytes = shape.layer_weight_params() * w
    lora = shape.lora_params(s.lora.r, s.lora.target_modules)
    lora_layer = lora / shape.layers
    b, h, i = tr.micro_batch_size, shape.hidden, shape.intermediate
    kv, qd = shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim
    # saved for backward per token and layer: norms' inputs, q/k/v/o inputs and outputs, the MLP's three
    # projections and SwiGLU, in the compute dtype; each LoRA module keeps its r-wide intermediate
    per_token_layer = w * (4 * h + qd + 2 * kv + qd + 4 * i) + w * s.lora.r * len(s.lora.target_modules)
    tokens = b * seq_len
    attn_probs = b * shape.heads * seq_len * seq_len * w if attention == "eager" else 0
    act_full = tokens * shape.layers * per_token_layer + shape.layers * attn_probs
    act_ckpt = tokens * shape.layers * w * h + tokens * per_token_layer + attn_probs
    logits = tokens * shape.vocab * (w + 4 + 4)  # logits, their fp32 log-softmax for the loss, its gradient
    parts = {
        "runtime": runtime_gb * GB,
        "base_weights": base_bytes / n,
        "lora_weights": 2 * lora / n,
        "lora_gradients": 2 * lora / n,
        "optimizer_states": ADAM_K * lora / n,
        "allgather_buffer": 2 * (layer_bytes + 2 * lora_layer) if n > 1 else 0.0,
        "activations": act_full,
        "activations_checkpointed": act_ckpt,
        "logits": logits,
    }
    states = sum(v for k, v in parts.items() if not k.startswith("activations"))
    return {
        "shard_group": n,
        "world_size": tr.world_size,
        "sharding": tr.sharding,
        "weights": "nf4 4-bit" if q.load_in_4bit else compute_dtype,
        "compute_dtype": compute_dtype,
        "params": shape.params,
        "quantized_params": shape.linear_params if q.load_in_4bit else 0,
        "lora_params": lora,
        "seq_len": seq_len,
        "micro_batch": b,
        "per_device_gb": {k: v / GB for k, v in parts.items()},
        "total_gb": (states + act_full) / GB,
        "total_checkpointed_gb": (states + act_ckpt) / GB,
        "zero_full_finetune_gb": zero_table(shape.params, tr.world_size, tr.processes_per_node),
    }
