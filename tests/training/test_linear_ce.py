"""The linear cross-entropy without logits (training.kernels.linear_ce): the same sum and gradients as the plain
cross-entropy on the logits, chunk boundaries anywhere, -100 rows skipped; through the trainer's hidden-state
forward (training.head.hidden_states) on a PEFT model, equal to the labelled-positions head + plain loss."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch

from training import head, losses
from training.kernels import linear_ce
from training.recipes import LABEL_ALIGNED

V, D = 53, 16


def _case(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(dtype)
    labels = torch.randint(0, V, (2, 7), generator=g)
    labels[0, :3] = -100  # a prompt
    labels[1, :] = -100  # a row without any label
    labels[1, 4] = 5
    return hidden, weight, labels


def _plain(hidden, weight, labels):
    return losses.cross_entropy_sum(hidden @ weight.t(), labels)


@pytest.mark.parametrize("chunk", [1, 5, 4096])  # 5: boundaries inside both rows (6 shifted positions a row)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_linear_ce_equals_plain_cross_entropy_loss_and_gradients(chunk, dtype):
    hidden, weight, labels = _case(dtype)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, n = linear_ce.linear_cross_entropy_sum(h1, w1, labels, "chunked", chunk)
    ref, n_ref = _plain(h2, w2, labels)
    assert n == n_ref == 5 and loss.dtype == torch.float32
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(loss, ref, **tol)
    (loss * 0.37).backward()  # a scale, as the trainer's 1 / global tokens
    (ref * 0.37).backward()
    assert h1.grad.dtype == dtype and w1.grad.dtype == dtype
    torch.testing.assert_close(h1.grad, h2.grad, **tol)
    torch.testing.assert_close(w1.grad, w2.grad, **tol)
    # -100 labels give nothing back: row 1 is scored at position 3 alone (its label at 4, shifted by one)
    assert h1.grad[1, :3].abs().sum() == 0 and h1.grad[1, 4:].abs().sum() == 0 and h1.grad[1, 3].abs().sum() > 0
    assert h1.grad[:, -1].abs().sum() == 0  # the last position has no next token


def test_frozen_weight_and_no_grad():
    hidden, weight, labels = _case(torch.float32)
    h = hidden.clone().requires_grad_()
    loss, _ = linear_ce.linear_cross_entropy_sum(h, weight, labels, "chunked", 3)  # the LM head frozen (LoRA)
    loss.backward()
    h2 = hidden.clone().requires_grad_()
    _plain(h2, weight, labels)[0].backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(
            linear_ce.linear_cross_entropy_sum(hidden, weight, labels, "chunked", 4)[0],
            _plain(hidden, weight, labels)[0],
            rtol=1e-5,
            atol=1e-5,
        )


def test_chunk_rows_bounds_the_logits_of_a_chunk():
    assert linear_ce.chunk_rows(32000) * 32000 <= linear_ce.CHUNK_ELEMENTS
    assert linear_ce.chunk_rows(10**9) == 1


@pytest.fixture(scope="module")
def models():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    out = {}
    for name, targets in (
        ("lora", ["q_proj", "v_proj", "gate_proj", "down_proj"]),
        ("lora_head", ["q_proj", "lm_head"]),
    ):
        base = LlamaForCausalLM(copy.deepcopy(cfg))
        torch.manual_seed(1)
        m = get_peft_model(
            base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets)
        )
        out[name] = m.eval()
    return out


def test_the_head_computing_the_linear_ce_equals_the_labelled_head_and_plain_loss(models):
    """The fused loss computed by the head inside the forward (``training.kernels.linear_ce.head_loss``) on a PEFT
    model: the labelled-positions head + plain loss's sum, token count and LoRA gradients."""
    model = models["lora"]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 97, (1, 15), generator=g)
    pos = torch.cat([torch.arange(6), torch.arange(4), torch.arange(5)]).unsqueeze(0)
    labels = torch.full_like(ids, -100)
    labels[0, 3:6], labels[0, 12:] = ids[0, 3:6], ids[0, 12:]
    keep, batch = head.compact({"input_ids": ids, "position_ids": pos, "labels": labels}, LABEL_ALIGNED)
    inputs = {"input_ids": ids, "position_ids": pos, "logits_to_keep": keep, "use_cache": False}
    fused = linear_ce.FusedHead("chunked")

    def grads(fuse):
        model.zero_grad(set_to_none=True)
        if fuse:
            sums = fused.loss_sums(model, inputs, batch["labels"])
        else:
            sums = losses.loss_sums(model(**inputs).logits, batch, False)
        sums["ce_sum"].backward()
        return sums, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    (s1, g1), (s2, g2) = grads(True), grads(False)
    assert s1["ce_tokens"] == s2["ce_tokens"] == 6 and fused.report() == {"kind": "chunked", "micro_batches": 1}
    torch.testing.assert_close(s1["ce_sum"], s2["ce_sum"], rtol=1e-5, atol=1e-5)
    assert g1.keys() == g2.keys() and len(g1) == 16
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-6, msg=n)
    # the head's input there is the decoder's output at the kept positions, and the head is itself again after
    lm_head = model.get_base_model().lm_head
    seen = linear_ce.head_loss(model, inputs, lambda hidden, weight: (hidden, weight))
    assert seen[1] is lm_head.weight and "forward" not in lm_head.__dict__
    torch.testing.assert_close(lm_head(seen[0]), model(**inputs).logits)


def test_the_plan_fuses_on_cuda_only_and_never_a_head_it_cannot_read(models, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    model = models["lora"]
    w = model.get_base_model().lm_head.weight
    assert linear_ce.plan(model, cpu, distill=False) is None  # auto: CPU keeps the plain path
    fused = linear_ce.plan(model, cpu, distill=False, policy=True)
    assert fused.kind == "chunked" and linear_ce.head_weight(model) is w
    assert linear_ce.plan(model, cuda, distill=True) is None  # logit distillation: plain path
    assert linear_ce.plan(model, cuda, distill=False, policy=False) is None
    assert linear_ce.head_weight(models["lora_head"]) is None  # a LoRA-wrapped head is not a plain Linear
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", types.ModuleType("liger_kernel.transformers"))
    assert linear_ce.plan(model, cuda, distill=False).kind == "liger"  # Liger importable, CUDA: Liger
    assert linear_ce.backend(cpu) == "chunked"
    monkeypatch.delitem(sys.modules, "liger_kernel.transformers")
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)  # not importable
    assert linear_ce.plan(model, cuda, distill=False).kind == "chunked"
