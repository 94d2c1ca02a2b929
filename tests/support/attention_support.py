"""A tiny GQA Llama twice, with the same weights: one on eager attention, one on a kernel under test."""

from __future__ import annotations

import copy

import torch


def llama_pair(kernel: str):
    """``(eager, same weights on ``kernel``)``: 4 heads on 2 kv heads, 2 layers (training.attention registered)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from training import attention

    attention.register()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    # each model its own config: transformers keeps the object it is given, and the kernel is a config field
    eager = LlamaForCausalLM(copy.deepcopy(cfg))
    eager.config._attn_implementation = "eager"
    other = LlamaForCausalLM(copy.deepcopy(cfg))
    other.load_state_dict(eager.state_dict())
    other.config._attn_implementation = kernel
    assert eager.config._attn_implementation == "eager"
    return eager, other


def logits_and_grads(model, **inputs):
    """The logits and every parameter's gradient of a fixed scalar of them."""
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits
    (logits.float() ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
