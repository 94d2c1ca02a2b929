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
* Mixture of experts (Qwen3-MoE layout: E routed experts of width I, top-k, in the sparse
  layers): memory follows the *total* parameters, FLOPs the *active* ones (k of E experts). The
  fused expert tensors are not ``nn.Linear``, so 4-bit quantization leaves them (and the routers)
  in the compute dtype. Expert LoRA has rank r per expert: L_moe·r·E·(2H + 3I) parameters
  (``lora_A`` (r·E, in), ``lora_B`` (out, r·E) per fused tensor). PEFT folds W + s·B·A into a
  full-size copy of each layer's expert stack at every forward and keeps it for backward:
  2·E·3HI bytes per MoE layer (one layer at a time with activation checkpointing, plus its
  gradient). Routed MLP activations per token: k·I instead of the dense I.
* Activations per token and layer in bf16 (after Korthikanti et al. 2022, adapted to a Llama
  block with SwiGLU and fused/flash attention, so no s² term): 2·(6h + 2·kv + 4i) bytes plus the
  LoRA intermediates; with activation checkpointing only each layer's input (2h bytes) is kept
  and one layer is recomputed at a time. The logits add b·s·V·10 bytes (bf16 logits, fp32 copy for
  the loss and its gradient). By activation policy (``training.activation_checkpointing``):
  ``none`` adds PEFT's fp32 copies of each LoRA layer's input (4 bytes per input feature of every
  target, with a 16-bit base); ``recompute`` (training/recompute.py) drops those, two of the four
  intermediate-wide SwiGLU tensors and the two norms' outputs (2i + 2h per token and layer);
  ``full`` is the checkpointed figure.
* FSDP2 ``reshard_after_forward: false`` keeps every layer's gathered parameters from its forward
  to its backward: at the peak the whole unsharded decoder (not two layers) is resident.

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
MLP_DIMS = ("gate_proj", "up_proj", "down_proj")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def moe_fields(cfg: dict) -> dict:
    """The mixture-of-experts fields of a config (none for a dense model). A layer is sparse as in
    transformers' Qwen3-MoE (not in ``mlp_only_layers``, ``(i + 1) % decoder_sparse_step == 0``) and
    DeepSeek (from ``first_k_dense_replace`` on)."""
    experts = next((int(cfg[k]) for k in EXPERT_COUNT_KEYS if cfg.get(k)), 0)
    out: dict = {"qk_norm": cfg.get("model_type") in ("qwen3", "qwen3_moe")}
    if not experts:
        return out
    layers, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or []) | set(range(int(cfg.get("first_k_dense_replace") or 0)))
    moe = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return out | {
        "experts": experts,
        "experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_layers": moe,
        "moe_intermediate": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
    }


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer in the Llama / Qwen / Mistral layout, dense or mixture-of-experts."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    experts_per_tok: int = 0  # top-k
    moe_intermediate: int = 0  # one expert's width
    moe_layers: int = 0  # decoder layers whose MLP is routed experts (the others are dense, width `intermediate`)
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (Qwen3)

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config.json") -> ModelShape:
        try:
            h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(
                hidden=h,
                intermediate=int(cfg["intermediate_size"]),
                layers=int(cfg["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or h // heads),
                vocab=int(cfg["vocab_size"]),
                tied=bool(cfg.get("tie_word_embeddings", False)),
                **moe_fields(cfg),
            )
        except KeyError as e:
            raise PlanError(
                f"{where}: missing {e.args[0]!r}; the planner reads Llama-style configs "
                "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size)"
            ) from None

    @classmethod
    def from_model_dir(cls, path: Path) -> ModelShape:
        cfg = Path(path) / "config.json"
        if not cfg.exists():
            raise PlanError(f"no config.json in {path}; the planner needs the model's config to size it")
        return cls.from_config(json.loads(cfg.read_text()), str(cfg))

    def module_dims(self) -> dict[str, tuple[int, int]]:
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder layers' linear projections (what 4-bit quantization packs): attention in
        every layer, the MLP in the dense layers (fused expert tensors are not nn.Linear)."""
        per = {n: a * b for n, (a, b) in self.module_dims().items()}
        return self.layers * sum(v for n, v in per.items() if n not in MLP_DIMS) + self.dense_layers * sum(
            per[n] for n in MLP_DIMS
        )

    @property
    def expert_params(self) -> int:
        """The routed experts' fused tensors (gate, up, down of every expert of every MoE layer)."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.moe_intermediate

    @property
    def router_params(self) -> int:
        return self.moe_layers * self.experts * self.hidden

    @property
    def other_params(self) -> int:
        """Everything kept in the compute dtype under 4-bit: embeddings, LM head (unless tied), norms and, in a
        mixture of experts, the fused expert tensors and the routers."""
        return (
            self.vocab * self.hidden * (1 if self.tied else 2)
            + self.layers * 2 * self.hidden
            + self.hidden
            + (self.layers * 2 * self.head_dim if self.qk_norm else 0)
            + self.expert_params
            + self.router_params
        )

    @property
    def params(self) -> int:
        """Total parameters: what memory is planned from."""
        return self.linear_params + self.other_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (k of E experts): what FLOPs and time are planned from."""
        return (
            self.params
            - self.moe_layers * (self.experts - self.experts_per_tok) * 3 * self.hidden * self.moe_intermediate
        )

    def layer_weight_params(self) -> int:
        return (self.linear_params + self.expert_params + self.router_params) // self.layers + 2 * self.hidden

    def lora_params(self, r: int, targets: list[str]) -> int:
        """LoRA on ``target_modules``: attention projections in every layer, MLP projections in dense layers."""
        dims = self.module_dims()
        unknown = [t for t in targets if t not in dims]
        if unknown:
            raise PlanError(f"student.lora.target_modules: the planner knows {list(dims)}, not {unknown}")
        return sum(
            (self.dense_layers if t in MLP_DIMS else self.layers) * r * (dims[t][0] + dims[t][1]) for t in targets
        )

    def expert_lora_params(self, rank_per_expert: int, targets: list[str]) -> int:
        """LoRA on the fused expert tensors (PEFT ``target_parameters``): rank r per expert, so
        ``lora_A`` (r·E, in) + ``lora_B`` (out, r·E) per tensor; both tensors: L_moe·r·E·(2H + 3I)."""
        h, i = self.hidden, self.moe_intermediate
        dims = {"gate_up_proj": h + 2 * i, "down_proj": i + h}  # in + out of each fused tensor
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in dims]
        if unknown:
            raise PlanError(
                f"student.lora.target_parameters: the planner knows the Qwen3-MoE expert tensors "
                f"{['mlp.experts.' + d for d in dims]}, not {unknown}"
            )
        return self.moe_layers * sum(rank_per_expert * self.experts * dims[t.rsplit(".", 1)[-1]] for t in targets)


# --------------------------------------------------------------------------- memory


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def training_memory(
    shape: ModelShape,
    spec: CampaignSpec,
    seq_len: int,
    compute_dtype: str = "bfloat16",
    runtime_gb: float = 0.0,
    attention: str = "sdpa",
    heap_retention: float = 0.0,
    micro_batch: int | None = None,
) -> dict:
    """Per-device memory of the student's LoRA/QLoRA training under the campaign's topology.

    ``compute_dtype`` is the resolved dtype (never ``auto``): it sets the bytes of the unquantized
    weights, the activations and the logits. ``runtime_gb`` is the process's own footprint before any
    model loads (Python, torch, transformers, peft: the CPU catalog entries' ``runtime_gb``; on a GPU the allocator
    peak the trainer reports excludes it, so GPU catalog entries leave it 0). ``attention`` ``eager``
    keeps the softmax probabilities of every layer (b·heads·s² per layer), ``sdpa`` does not.
    ``heap_retention`` (CPU hosts): the fraction of activations + logits the C heap keeps resident after a
    step's transients are freed, part of the peak RSS (catalog ``perf.heap_retention``). ``micro_batch``: rows
    per micro-step instead of ``training.micro_batch_size`` (the memory policy sizes candidates with it).
    ``total_by_policy_gb`` is the peak under each activation policy (none / recompute / full)."""
    s, tr = spec.student, spec.training
    n = shard_group(tr.sharding, tr.world_size, tr.processes_per_node)
    q = s.quantization
    w = DTYPE_BYTES[compute_dtype]
    if q.load_in_4bit:
        absmax = 1 / NF4_BLOCK + 4 / (NF4_BLOCK * 256) if q.double_quant else 4 / NF4_BLOCK
        base_bytes = shape.linear_params * (0.5 + absmax) + shape.other_params * w
        layer_bytes = (shape.linear_params / shape.layers) * (0.5 + absmax) + 2 * w * shape.hidden
        layer_bytes += w * (shape.expert_params + shape.router_params) / shape.layers  # MoE: not quantized
    else:
        base_bytes = shape.params * w
        layer_bytes = shape.layer_weight_params() * w
    lora = shape.lora_params(s.lora.r, s.lora.target_modules)
    lora += moe_trainable_params(shape, s)  # expert LoRA, a trained router
    lora_layer = lora / shape.layers
    b, h, i = micro_batch if micro_batch is not None else tr.micro_batch_size, shape.hidden, shape.intermediate
    if b == "auto":
        raise PlanError("training.micro_batch_size is 'auto': pass the micro-batch to size (memory_policy resolves it)")
    kv, qd = shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim
    # saved for backward per token and layer: norms' inputs, q/k/v/o inputs and outputs, the MLP's three
    # projections and SwiGLU, in the compute dtype; each LoRA module keeps its r-wide intermediate
    per_token_layer = w * (4 * h + qd + 2 * kv + qd + 4 * i) + w * s.lora.r * len(s.lora.target_modules)
    tokens = b * seq_len
    attn_probs = b * shape.heads * seq_len * seq_len * w if attention == "eager" else 0
    act_full = tokens * shape.layers * per_token_layer + shape.layers * attn_probs
    act_ckpt = tokens * shape.layers * w * h + tokens * per_token_layer + attn_probs
    moe_full, moe_ckpt = moe_activation_bytes(shape, s, tokens, dtype_bytes=w)
    act_full, act_ckpt = act_full + moe_full, act_ckpt + moe_ckpt
    dims = shape.module_dims()
    casts = 4 * sum(dims[t][0] for t in s.lora.target_modules if t in dims) if w < 4 else 0
    act_none = act_full + tokens * shape.layers * casts
    act_recompute = act_full - tokens * shape.dense_layers * w * (2 * i + 2 * h)
    logits = tokens * shape.vocab * (w + 4 + 4)  # logits, their fp32 log-softmax for the loss, its gradient
    parts = {
        "runtime": runtime_gb * GB,
        "base_weights": base_bytes / n,
        "lora_weights": 2 * lora / n,
        "lora_gradients": 2 * lora / n,
        "optimizer_states": ADAM_K * lora / n,
        "allgather_buffer": (shape.layers if not tr.resharding_after_forward else 2) * (layer_bytes + 2 * lora_layer)
        if n > 1
        else 0.0,
        "activations": act_full,
        "activations_checkpointed": act_ckpt,
        "logits": logits,
        "heap_retained": heap_retention * (act_full + logits),
        "heap_retained_checkpointed": heap_retention * (act_ckpt + logits),
    }
    states = sum(v for k, v in parts.items() if not k.startswith(("activations", "heap_retained")))
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
        "total_gb": (states + act_full + parts["heap_retained"]) / GB,
        "total_checkpointed_gb": (states + act_ckpt + parts["heap_retained_checkpointed"]) / GB,
        "total_by_policy_gb": {
            k: (states + a + heap_retention * (a + logits)) / GB
            for k, a in (("none", act_none), ("recompute", act_recompute), ("full", act_ckpt))
        },
        "reshard_after_forward": tr.resharding_after_forward,
        "zero_full_finetune_gb": zero_table(shape.params, tr.world_size, tr.processes_per_node),
    }


# --------------------------------------------------------------------------- mixture of experts


def expert_rank(shape: ModelShape, student) -> int:
    """Each expert's LoRA rank (``student.moe.expert_rank``); raises PlanError below 1."""
    r = student.lora.r
    if student.moe.expert_rank == "full" or not shape.experts:
        return r
    if r // shape.experts < 1:
        raise PlanError(
            f"student.moe.expert_rank 'divided': student.lora.r // num_experts = {r} // {shape.experts} = "
            f"{r // shape.experts}, and a LoRA rank must be at least 1; raise student.lora.r to at least "
            f"{shape.experts} or use expert_rank: full"
        )
    return r // shape.experts


def moe_trainable_params(shape: ModelShape, student) -> int:
    """Trainable parameters beyond target_modules' LoRA: expert LoRA and a trained router (modules_to_save)."""
    if not shape.experts:
        return 0
    n = (
        shape.expert_lora_params(expert_rank(shape, student), student.lora.target_parameters)
        if student.lora.target_parameters
        else 0
    )
    return n + (shape.router_params if student.moe.router == "trained" else 0)


def moe_activation_bytes(shape: ModelShape, student, tokens: int, dtype_bytes: float = 2) -> tuple[float, float]:
    """Extra activation bytes of a mixture of experts (without, with activation checkpointing): each MoE
    layer's routed MLP (k experts of width I instead of one dense MLP of width `intermediate`, plus fp32
    router probabilities) and, with expert LoRA, PEFT's folded expert stack W + s·B·A kept for backward
    (``dtype_bytes``: the compute dtype's)."""
    if not shape.experts:
        return 0.0, 0.0
    per_token = (
        dtype_bytes * 4 * (shape.experts_per_tok * shape.moe_intermediate - shape.intermediate) + 4 * shape.experts
    )
    folded = dtype_bytes * shape.expert_params / shape.moe_layers if student.lora.target_parameters else 0.0
    full = tokens * shape.moe_layers * per_token + shape.moe_layers * folded + folded  # + one layer's gradient of W'
    ckpt = tokens * per_token + 2 * folded  # one layer recomputed at a time: its W' and the gradient of W'
    return full, ckpt


def moe_facts(shape: ModelShape, student, dtype_bytes: float = 2) -> dict:
    """What the plan says about a mixture-of-experts student (empty for a dense one)."""
    if not shape.experts:
        return {}
    rank = expert_rank(shape, student)
    return {
        "moe": {
            "experts": shape.experts,
            "experts_per_tok": shape.experts_per_tok,
            "moe_layers": shape.moe_layers,
            "total_params": shape.params,
            "active_params": shape.active_params,
            "expert_params": shape.expert_params,
            "router_params": shape.router_params,
            # fused 3-D tensors are not nn.Linear: bitsandbytes leaves them in the compute dtype
            "experts_quantized": False,
            "expert_weights_gb": dtype_bytes * (shape.expert_params + shape.router_params) / GB,
            "expert_rank": rank if student.lora.target_parameters else None,
            "expert_lora_params": shape.expert_lora_params(rank, student.lora.target_parameters)
            if student.lora.target_parameters
            else 0,
            "router_trainable_params": shape.router_params if student.moe.router == "trained" else 0,
            "folded_expert_layer_gb": dtype_bytes * shape.expert_params / shape.moe_layers / GB
            if student.lora.target_parameters
            else 0.0,
        }
    }


def moe_problems(shape: ModelShape, student) -> list[str]:
    """What a campaign's ``student`` settings get wrong for this model, before anything runs (the trainer
    checks the same on the loaded model): routed experts that nothing trains, a per-expert rank below 1,
    targets that match nothing in a mixture of experts, expert targets on a dense model."""
    lora, moe = student.lora, student.moe
    if not shape.experts:
        return (
            [
                f"student.lora.target_parameters {list(lora.target_parameters)}: the model is dense (no routed "
                "experts); remove target_parameters"
            ]
            if lora.target_parameters
            else []
        )
    out = []
    if not lora.target_parameters and moe.experts == "trained":
        out.append(
            f"student.lora: the model has {shape.experts} routed experts in each of {shape.moe_layers} MoE layers "
            f"({shape.expert_params:,} parameters) and target_modules cannot reach them (fused tensors, not "
            "nn.Linear): set student.lora.target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj] to "
            "train them, or student.moe.experts: frozen to leave them frozen on purpose"
        )
    if lora.target_parameters and moe.expert_rank == "divided" and lora.r // shape.experts < 1:
        out.append(
            f"student.moe.expert_rank: 'divided' gives rank student.lora.r // num_experts = {lora.r} // "
            f"{shape.experts} = 0 per expert (PEFT needs at least 1); raise student.lora.r to at least "
            f"{shape.experts} or use expert_rank: full"
        )
    router = [t for t in lora.target_modules if t in ("gate", "mlp.gate", "router", "mlp.router")]
    if router:
        out.append(
            f"student.lora.target_modules {router}: the router is not an nn.Linear (PEFT would silently turn it "
            "into a parameter target); use student.moe.router: trained"
        )
    mlp = [t for t in lora.target_modules if t.rsplit(".", 1)[-1] in (*MLP_DIMS, "w1", "w2", "w3")]
    if mlp:
        why = (
            "every layer's MLP is routed experts, so they match no module"
            if not shape.dense_layers
            else (
                "PEFT (on transformers 5) rewrites these names of a mixture of experts into targets on the fused "
                "expert tensors, so the dense MLP layers would get no LoRA and gate_up_proj rank 2r"
            )
        )
        out.append(
            f"student.lora.target_modules {mlp}: {why}; target the routed experts with student.lora.target_parameters"
        )
    return out
