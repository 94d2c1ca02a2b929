"""The LM head at labelled positions only (training.head): loss and LoRA gradients equal the full computation's.

A tiny random Llama (2 layers, vocabulary 97) with PEFT LoRA on every linear layer and on the LM head,
so the head's own adapter gradients are compared too; padded batches of two rows whose labelled
positions differ, one packed padding-free row, logit distillation's KL, and a batch without labels.
"""

from __future__ import annotations

import pytest
import torch

from training import head, losses
from training.recipes import LABEL_ALIGNED

V = 97


@pytest.fixture(scope="module")
def model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    base = LlamaForCausalLM(cfg)
    base.config._attn_implementation = "eager"
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
    )
    m = get_peft_model(base, lora)
    m.eval()
    return m


def _sums(model, batch, compact: bool, distill: bool):
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
    if compact:
        inputs["logits_to_keep"], batch = head.compact(batch, LABEL_ALIGNED)
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits
    sums = losses.loss_sums(logits, batch, distill)
    loss = sums["ce_sum"] + (sums["kl_sum"] if distill else 0.0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return sums, grads, logits.shape


def _teacher(labels: torch.Tensor, k: int = 5):
    g = torch.Generator().manual_seed(3)
    lp = torch.log_softmax(torch.randn(*labels.shape, V, generator=g), -1)
    vals, ids = lp.topk(k, -1)
    ids = torch.where((labels != -100)[..., None], ids, torch.full_like(ids, -1))
    return ids, vals


def _padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, 12), generator=g)
    labels = torch.full((2, 12), -100)
    labels[0, 5:9] = ids[0, 5:9]  # row 0: a completion in the middle
    labels[1, 9:12] = ids[1, 9:12]  # row 1: a completion at the end
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 9:] = 0  # row 0 is padded after its completion
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": torch.arange(12).repeat(2, 1)}


def _packed_batch():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, V, (1, 20), generator=g)
    labels = torch.full((1, 20), -100)
    labels[0, 4:7] = ids[0, 4:7]
    labels[0, 15:20] = ids[0, 15:20]
    pos = torch.cat([torch.arange(7), torch.arange(13)]).unsqueeze(0)  # two sequences laid end to end
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


@pytest.mark.parametrize("make", [_padded_batch, _packed_batch], ids=["padded", "packed"])
@pytest.mark.parametrize("distill", [False, True], ids=["ce", "ce+kl"])
def test_labelled_head_loss_and_gradients_equal_the_full_computation(model, make, distill):
    batch = make()
    if distill:
        batch[losses.TEACHER_IDS], batch[losses.TEACHER_LOGPROBS] = _teacher(batch["labels"])
    full, g_full, full_shape = _sums(model, batch, compact=False, distill=distill)
    part, g_part, part_shape = _sums(model, batch, compact=True, distill=distill)
    labelled = int(head.label_positions(batch["labels"]).numel())
    assert part_shape[1] == labelled + 1 < full_shape[1]  # the head really ran on fewer positions
    assert part["ce_tokens"] == full["ce_tokens"] > 0
    torch.testing.assert_close(part["ce_sum"], full["ce_sum"], rtol=1e-5, atol=1e-5)
    if distill:
        assert part["kl_tokens"] == full["kl_tokens"] > 0
        torch.testing.assert_close(part["kl_sum"], full["kl_sum"], rtol=1e-5, atol=1e-5)
    assert g_part.keys() == g_full.keys() and any("lm_head" in n for n in g_full)
    for n in g_full:
        assert float(g_full[n].abs().max()) > 0, n
        torch.testing.assert_close(g_part[n], g_full[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_batch_without_labels_scores_one_position_and_still_backpropagates(model):
    batch = _packed_batch()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    sums, grads, shape = _sums(model, batch, compact=True, distill=False)
    assert shape[1] == 1 and sums["ce_tokens"] == 0 and float(sums["ce_sum"]) == 0.0
    assert all(float(g.abs().max()) == 0 for g in grads.values())


def test_label_positions_are_the_union_over_rows():
    labels = torch.tensor([[-100, -100, 5, 6, -100], [-100, 1, -100, -100, 2]])
    assert head.label_positions(labels).tolist() == [0, 1, 2, 3]
    keep, out = head.compact({"labels": labels, "other": torch.zeros(2, 5)}, {"labels"})
    assert keep.tolist() == [0, 1, 2, 3, 4]
    assert out["labels"].tolist() == [[-100, -100, 5, 6, -100], [-100, 1, -100, -100, 2]]
    assert out["other"].shape == (2, 5)
