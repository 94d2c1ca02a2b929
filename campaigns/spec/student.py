"""The ``student:`` section: the base model, its LoRA adapter and 4-bit quantization."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from campaigns.spec.common import _Strict

# What PEFT's ``lora.ParamWrapper`` (LoRA on ``target_parameters``) refuses, in its own words (peft 0.21).
PARAM_WRAPPER_REFUSES = {
    "dropout": "lora.ParamWrapper does not work with lora_dropout != 0",
    "use_dora": "lora.ParamWrapper does not work with use_dora=True",
}


class LoraSpec(_Strict):
    """The LoRA adapter trained on the frozen student base (PEFT LoraConfig fields)."""

    r: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the LoRA input. Must be 0 with "
        "`target_parameters` (PEFT has one dropout for the whole adapter and its ParamWrapper refuses it).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Module names that get LoRA adapters (`nn.Linear` layers; suffix match).",
    )
    target_parameters: list[str] = Field(
        default_factory=list,
        description="Parameters that get LoRA through PEFT's `target_parameters` (a `lora.ParamWrapper`): the fused "
        "3-D expert tensors of a mixture-of-experts that `target_modules` cannot reach, e.g. "
        "[mlp.experts.gate_up_proj, mlp.experts.down_proj] on Qwen3-MoE. Each expert gets its own rank-r LoRA "
        "(see student.moe.expert_rank). Refused by PEFT with dropout != 0 or use_dora.",
    )
    use_dora: bool = Field(
        False,
        description="DoRA (weight-decomposed LoRA) on the target modules. Refused with "
        "`target_parameters` (PEFT's ParamWrapper does not support it).",
    )

    @model_validator(mode="after")
    def _param_wrapper_limits(self) -> LoraSpec:
        if not self.target_parameters:
            return self
        bad = [f for f, on in (("dropout", self.dropout != 0), ("use_dora", self.use_dora)) if on]
        if bad:
            raise ValueError(
                "student.lora.target_parameters is set, and PEFT refuses LoRA on parameters with "
                + " and ".join(f"{f} ({PARAM_WRAPPER_REFUSES[f]})" for f in bad)
                + ": set "
                + " and ".join("dropout: 0" if f == "dropout" else "use_dora: false" for f in bad)
                + " (dropout is one setting for the whole adapter), or drop target_parameters"
            )
        return self


class MoeSpec(_Strict):
    """Mixture-of-experts students (ignored for a dense model): what gets trained, and the router's loss."""

    experts: Literal["trained", "frozen"] = Field(
        "trained",
        description="trained: a student with routed experts must get LoRA on them "
        "(student.lora.target_parameters), or the run is refused before training; frozen: train without them on "
        "purpose.",
    )
    expert_rank: Literal["full", "divided"] = Field(
        "full",
        description="full: every expert gets rank r (PEFT's default; expert LoRA then costs num_experts × a "
        "dense layer's); divided: r // num_experts per expert through PEFT's rank_pattern (the experts' LoRA then "
        "costs what one dense MLP's would); refused where r // num_experts < 1.",
    )
    router: Literal["frozen", "trained"] = Field(
        "frozen",
        description="trained: the router (`mlp.gate`) is trained in full, as a PEFT modules_to_save copy "
        "saved with the adapter.",
    )
    aux_loss_coef: float = Field(
        0.001,
        ge=0.0,
        le=1.0,
        description="Weight of the router's load-balancing loss (Switch Transformer: "
        "num_experts · sum_e tokens_e · mean_prob_e, Hugging Face's formula) added to the training loss; 0 turns it "
        "off. With a frozen router it still acts, through the hidden states the router sees.",
    )
    collapse_share: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Warn when, in one MoE layer, the num_experts_per_tok busiest experts take at "
        "least this share of the routed tokens (uniform routing gives num_experts_per_tok / num_experts).",
    )


class QuantizationSpec(_Strict):
    """How the frozen base is loaded: 4-bit NF4 (QLoRA) or not, and the compute dtype."""

    load_in_4bit: bool = Field(True, description="QLoRA: load the frozen base in 4-bit with bitsandbytes.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type (NF4 is the QLoRA default).")
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Dtype of matmuls (training and local evaluation) and of the packed 4-bit storage (so FSDP "
        "can shard it). auto: bf16 on a GPU that supports it, else fp16; on a CPU, bf16 only where a measured matmul "
        "says it is native (AMX, avx512_bf16), else fp32 (campaign_orchestrator/hardware.py).",
    )
    double_quant: bool = Field(False, description="Also quantize the quantization constants (saves ~0.4 bit/param).")


class StudentSpec(_Strict):
    """The model being fine-tuned."""

    base_model: str = Field(
        description="Base model: a checkpoint directory, a `.gguf` file, `@demo/<name>`, "
        "`@packaged/<name>`, `s3://bucket/prefix` or a hub id `org/name` with `revision` "
        "(campaign_orchestrator/models.py)."
    )
    revision: str | None = Field(None, description="Base model revision; part of the adapter's cache key.")
    lora: LoraSpec = LoraSpec()
    quantization: QuantizationSpec = QuantizationSpec()
    moe: MoeSpec = Field(
        default_factory=MoeSpec, description="Mixture-of-experts settings (ignored for a dense model)."
    )
    attn_implementation: Literal["auto", "eager", "sdpa", "segment_eager", "varlen", "flash_attention_2"] = Field(
        "auto",
        description="Attention kernel for training. auto: the fastest of eager, sdpa and segment_eager measured at "
        "the run's micro-batch shape on the host (training/attention.py; cached per host and shape). segment_eager: "
        "eager attention on each packed sequence alone (no work across the sequences of a padding-free row). varlen: "
        "one variable-length kernel call per row on CUDA (torch's flash varlen_attn, else FlexAttention; measured by "
        "auto there), segment_eager on a CPU.",
    )
