"""Liger's fused RMSNorm / SwiGLU / RoPE (training.kernels.liger): chosen by model type on CUDA, nothing patched on a
CPU. Their outputs against the plain modules are checked on a GPU by benchmarks/train_gpu_step.py
(training.kernel_checks)."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

from training.kernels import liger


@pytest.fixture
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(copy.deepcopy(cfg))


def _fake_liger(monkeypatch, table):
    mp = types.ModuleType("liger_kernel.transformers.monkey_patch")
    mp.MODEL_TYPE_TO_APPLY_LIGER_FN = table
    for name, mod in (
        ("liger_kernel", types.ModuleType("liger_kernel")),
        ("liger_kernel.transformers", types.ModuleType("liger_kernel.transformers")),
        ("liger_kernel.transformers.monkey_patch", mp),
    ):
        monkeypatch.setitem(sys.modules, name, mod)


def test_nothing_is_patched_on_a_cpu(model, monkeypatch):
    from transformers.models.llama import modeling_llama

    calls = []
    _fake_liger(monkeypatch, {"llama": lambda **kw: calls.append(kw)})  # importable, yet a CPU
    rope = modeling_llama.apply_rotary_pos_emb
    assert liger.apply(model, torch.device("cpu")) == [] and calls == []
    assert "Triton" in liger.why_not(torch.device("cpu"))
    assert modeling_llama.apply_rotary_pos_emb is rope
    assert not any("forward" in m.__dict__ for m in model.modules())  # no instance-level forward anywhere


def test_on_cuda_liger_is_applied_by_model_type_with_its_loss_patches_off(model, monkeypatch):
    calls = []

    from transformers.models.llama import modeling_llama

    mlp_class = modeling_llama.LlamaMLP

    def apply_llama(
        rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None
    ):
        modeling_llama.LlamaMLP = type("FusedMLP", (), {})  # as Liger does: the class swapped module-wide
        calls.append(
            {
                "rope": rope,
                "cross_entropy": cross_entropy,
                "flce": fused_linear_cross_entropy,
                "rms_norm": rms_norm,
                "swiglu": swiglu,
                "model": model,
            }
        )

    def apply_gemma(
        rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True, model=None
    ):
        calls.append({"gemma": True})

    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    assert liger.apply(model, cuda) == [] and "not importable" in liger.why_not(cuda)
    _fake_liger(monkeypatch, {"llama": apply_llama, "gemma": apply_gemma})
    assert liger.why_not(cuda) is None
    assert liger.apply(model, cuda) == ["rms_norm", "swiglu", "rope"]
    assert modeling_llama.LlamaMLP is mlp_class  # put back: models built later in the process are not patched
    assert calls == [
        {"rope": True, "cross_entropy": False, "flce": False, "rms_norm": True, "swiglu": True, "model": model}
    ]
    assert liger.apply(model, cuda, policy=False) == [] and len(calls) == 1
    model.config.model_type = "gemma"  # no swiglu argument there: only the kernels its function takes
    assert liger.apply(model, cuda) == ["rms_norm", "rope"]
    model.config.model_type = "gpt2"  # a type Liger does not know: nothing
    assert liger.apply(model, cuda) == [] and len(calls) == 2

    def broken(**kw):
        raise RuntimeError("this transformers is too new")

    model.config.model_type = "llama"
    _fake_liger(monkeypatch, {"llama": broken})
    with pytest.warns(UserWarning, match="too new"):
        assert liger.apply(model, cuda) == []  # a Liger that cannot patch: the plain modules, said in a warning
