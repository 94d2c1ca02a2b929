"""Helpers for the mixture-of-experts tests: the demo MoE student's architecture as a random-init model
(real tensors, no training) and the student settings that target its experts."""

from __future__ import annotations

from pathlib import Path

EXPERT_TENSORS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tiny_moe(seed: int = 0, **config):
    """A random-init ``Qwen3MoeForCausalLM`` with the demo MoE student's config (vocabulary 32), fp32, eager."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from campaign_orchestrator.demo.build import moe_config

    cfg = moe_config(vocab_size=32)
    for k, v in config.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg)


def write_moe_config(directory: Path) -> Path:
    """Only the demo MoE student's ``config.json`` (what the planner and the pre-launch checks read), without
    importing torch: the recipe's fields, as transformers writes them for Qwen3-MoE."""
    import json

    from campaign_orchestrator.demo.recipe import MOE_RECIPE

    directory.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 32,
        "tie_word_embeddings": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        **MOE_RECIPE["moe_student"]["config"],
    }
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def save_tiny_moe(directory: Path, **config) -> Path:
    """The random-init tiny MoE saved as a checkpoint directory (config.json + weights)."""
    tiny_moe(**config).save_pretrained(directory)
    return directory


def moe_student(lora: dict | None = None, moe: dict | None = None, quantization: dict | None = None, **kw):
    """A ``StudentSpec`` with LoRA on the attention and the expert tensors (fp32, no 4-bit) unless overridden."""
    from campaigns.spec import StudentSpec

    return StudentSpec.model_validate(
        {
            "base_model": "@demo/moe_student",
            "lora": {
                "r": 4,
                "alpha": 8,
                "dropout": 0.0,
                "target_modules": ATTENTION,
                "target_parameters": EXPERT_TENSORS,
                **(lora or {}),
            },
            "moe": moe or {},
            "quantization": {"load_in_4bit": False, "compute_dtype": "float32", **(quantization or {})},
            **kw,
        }
    )


def peft_moe(student, model=None):
    """The tiny MoE with the trainer's LoRA configuration for ``student`` (training.moe.lora_kwargs)."""
    from peft import LoraConfig, get_peft_model

    from training import moe

    model = model if model is not None else tiny_moe()
    moe.check_targets(model, student, "tiny-moe")
    return get_peft_model(model, LoraConfig(**moe.lora_kwargs(student, model.config)))
