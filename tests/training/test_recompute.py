"""Recomputing the cheap activations (training/recompute.py): the same loss and gradients, bit for bit, with
less memory kept for backward."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.stage

HIDDEN, INTER, LAYERS, TOKENS = 64, 160, 3, 96


def _model(patched: bool, dropout: float = 0.0, attn: str = "eager", dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from training import recompute

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(cfg).to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=dropout,
            init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )  # fp32 adapters
    counts = recompute.apply(model) if patched else None
    return model.train(), counts


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (2, TOKENS // 2), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _grads(model):
    torch.manual_seed(2)  # the same dropout masks on both sides
    loss = model(**_batch()).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_loss_and_gradients_are_bitwise_those_of_autograd(dropout, dtype):
    plain, _ = _model(False, dropout, dtype=dtype)
    patched, counts = _model(True, dropout, dtype=dtype)
    assert counts == {"layers": LAYERS, "mlp": LAYERS, "norm": 2 * LAYERS, "lora_cast": 7 * LAYERS}
    loss_a, grads_a = _grads(plain)
    loss_b, grads_b = _grads(patched)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 2 * 7 * LAYERS
    for name in grads_a:
        assert grads_a[name].dtype == torch.float32
        assert torch.equal(grads_a[name], grads_b[name]), name


def _kept_bytes_after_forward(model) -> int:
    """Bytes allocated during a forward and still live at its end: what autograd keeps for backward."""
    from torch.profiler import ProfilerActivity, profile

    batch = _batch()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(**batch).loss
    kept = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    loss.backward()  # the graph is still whole: backward runs
    return kept


def test_less_is_kept_for_backward():
    plain, _ = _model(False)
    patched, _ = _model(True)
    saved = _kept_bytes_after_forward(plain) - _kept_bytes_after_forward(patched)
    # Per token and layer: silu(gate) and the product (2 x INTER) plus the two norms' outputs (2 x HIDDEN), but
    # the first layer's input norm (its input, the frozen embedding, needs no gradient: nothing keeps it, so
    # holding it for a recomputation would cost what it saves).
    assert saved >= TOKENS * (LAYERS * 2 * INTER + (2 * LAYERS - 1) * HIDDEN) * 4


def test_less_is_kept_for_backward_with_a_bf16_base_and_fp32_adapters():
    plain, _ = _model(False, dtype=torch.bfloat16)
    patched, _ = _model(True, dtype=torch.bfloat16)
    saved = _kept_bytes_after_forward(plain) - _kept_bytes_after_forward(patched)
    # At least PEFT's fp32 copies of the LoRA inputs, per token and layer: q, k, v, gate, up (5 x HIDDEN) and
    # down (INTER). (Without a bf16 base the casts are no-ops; the rest of the saving is then silu(gate).)
    casts = TOKENS * LAYERS * (5 * HIDDEN + INTER) * 4
    assert saved >= casts, (saved, casts)


def test_eval_and_no_grad_are_untouched_and_apply_is_idempotent():
    from training import recompute

    plain, _ = _model(False)
    patched, counts = _model(True)
    assert recompute.apply(patched) is counts
    with torch.no_grad():
        a = plain.eval()(**_batch()).logits
        b = patched.eval()(**_batch()).logits
    assert torch.equal(a, b)
    assert all(m._campaign_last is None for m in patched.modules() if hasattr(m, "_campaign_last"))


def test_a_tensor_that_is_a_slice_of_a_larger_storage_is_kept_as_is():
    from training.recompute import scope

    big = torch.randn(10, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    calls = []
    with scope() as s:
        part = (big * 2)[2:5]  # not a whole storage: nothing is recomputed
        s.register(part, lambda: calls.append(1) or part.detach())
        whole = big * 3
        s.register(whole, lambda b: calls.append(2) or b * 3, big)
        out = (part @ w).sum() + (whole @ w).sum()
    out.backward()
    assert calls == [2] and w.grad is not None
    expected = (big * 2)[2:5].sum(0)[:, None].expand(4, 4) + (big * 3).sum(0)[:, None].expand(4, 4)
    torch.testing.assert_close(w.grad, expected)
