"""The ``student:`` section: the base model, its LoRA adapter and 4-bit quantization."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from campaigns.spec.common import _Strict

class LoraSpec(_Strict):
    r: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Module names that get LoRA adapters.",
    )


class QuantizationSpec(_Strict):
    load_in_4bit: bool = Field(True, description="QLoRA: load the frozen base in 4-bit with bitsandbytes.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type (NF4 is the QLoRA default).")
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Dtype of matmuls (training and local evaluation) and of the packed 4-bit storage (so FSDP "
        "can shard it). auto: bf16 on a GPU that supports it, else fp16; on a CPU, bf16 only where a measured matmul "
        "says it is native (AMX, avx512_bf16), else fp32 (campaign_orchestrator/hardware.py).",
    )
    double_quant: bool = Field(False, description="Also quantize the quantization constants (saves ~0.4 bit/param).")


class StudentSpec(_Strict):
    """The model being fine-tuned."""

    base_model: str = Field(description="Base model: a checkpoint directory, a `.gguf` file, `@demo/<name>`, "
                                        "`@packaged/<name>`, `s3://bucket/prefix` or a hub id `org/name` with `revision` "
                                        "(campaign_orchestrator/models.py).")
    revision: str | None = Field(None, description="Base model revision; part of the adapter's cache key.")
    lora: LoraSpec = LoraSpec()
    quantization: QuantizationSpec = QuantizationSpec()
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = Field(
        "auto",
        description="Attention kernel for training. auto: sdpa on GPU; on CPU eager for sequences up to 512 "
        "tokens (PyTorch's CPU flash-attention backward is several times slower there), sdpa beyond.",
    )
