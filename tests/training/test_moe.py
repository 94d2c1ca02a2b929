"""Mixture-of-experts students in the trainer: what PEFT does and refuses on fused expert tensors, the
per-expert layout our checks read, the parameter breakdown and the refusal of frozen experts, the
load-balancing loss against Hugging Face's, 4-bit leaving the experts alone, and the trainer end to end
on the demo MoE student (single process here; two gloo ranks in test_moe_distributed.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from campaigns.spec import PARAM_WRAPPER_REFUSES
from tests.support.moe_support import ATTENTION, EXPERT_TENSORS, moe_student, peft_moe, save_tiny_moe, tiny_moe
from training import moe
from training.errors import TrainingError


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(
        **{
            "r": 4,
            "lora_alpha": 8,
            "target_modules": ATTENTION,
            "target_parameters": EXPERT_TENSORS,
            "lora_dropout": 0.0,
            "task_type": "CAUSAL_LM",
            **kw,
        }
    )


def _one_step_expert_b_grads(model) -> list[torch.Tensor]:
    """Forward and backward of one real batch; the expert lora_B gradients."""
    ids = torch.randint(4, 32, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad for n, p in model.named_parameters() if ".experts." in n and ".lora_B." in n]


# --------------------------------------------------------------------------- what PEFT refuses


@pytest.mark.parametrize("field,kwargs", [("dropout", {"lora_dropout": 0.05}), ("use_dora", {"use_dora": True})])
def test_peft_refuses_dropout_and_dora_on_expert_parameters_in_the_words_the_spec_quotes(field, kwargs):
    from peft import get_peft_model

    with pytest.raises(ValueError, match=re.escape(PARAM_WRAPPER_REFUSES[field])):
        get_peft_model(tiny_moe(), _lora(**kwargs))


@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="PEFT 0.21: lora.ParamWrapper does not work with lora_dropout != 0 (student.lora.dropout is "
    "refused with target_parameters at validation; lift that when this passes)",
)
def test_reproducer_expert_lora_with_dropout_trains():
    from peft import get_peft_model

    grads = _one_step_expert_b_grads(get_peft_model(tiny_moe(), _lora(lora_dropout=0.05)))
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="PEFT 0.21: lora.ParamWrapper does not work with use_dora=True (student.lora.use_dora is "
    "refused with target_parameters at validation; lift that when this passes)",
)
def test_reproducer_expert_dora_trains():
    from peft import get_peft_model

    grads = _one_step_expert_b_grads(get_peft_model(tiny_moe(), _lora(use_dora=True)))
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="PEFT 0.21 on transformers 5 rewrites gate_proj/up_proj/down_proj of a Qwen3-MoE into expert "
    "targets (a transformers-4 compatibility mapping): a dense MLP layer gets no LoRA. Refused by "
    "training.moe.check_targets and costs.memory.moe_problems; lift that when this passes",
)
def test_reproducer_lora_on_the_dense_mlp_of_a_moe_with_a_dense_layer():
    from peft import get_peft_model

    model = get_peft_model(
        tiny_moe(mlp_only_layers=[0]), _lora(target_modules=["gate_proj", "up_proj", "down_proj"], target_parameters=[])
    )
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".layers.0.mlp.gate_proj.lora_A." in n for n in names), names
    assert not any(".experts." in n for n in names), names


def test_what_peft_would_rewrite_is_refused_before_and_after_it_runs():
    from peft import get_peft_model

    base = tiny_moe(mlp_only_layers=[0])
    for targets, needle in (
        (["q_proj", "gate_proj"], "PEFT (on transformers 5) rewrites"),
        (["q_proj", "gate"], "student.moe.router: trained"),
    ):
        with pytest.raises(ValueError, match=re.escape(needle)):
            moe.check_targets(base, moe_student(lora={"target_modules": targets}), "tiny")
    with pytest.raises(
        ValueError,
        match=r"target_parameters \['mlp.experts.gate_proj'\] match no parameter .* "
        r"\['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'\]",
    ):
        moe.check_targets(base, moe_student(lora={"target_parameters": ["mlp.experts.gate_proj"]}), "tiny")
    student = moe_student(lora={"target_modules": ["q_proj", "gate_proj", "up_proj"], "target_parameters": []})
    rewritten = get_peft_model(base, _lora(target_modules=["q_proj", "gate_proj", "up_proj"], target_parameters=[]))
    with pytest.raises(ValueError, match=r"PEFT rewrote the LoRA targets .* target_parameters \['gate_up_proj'\]"):
        moe.check_peft_kept_targets(rewritten, student, "tiny")


# --------------------------------------------------------------------------- layout, ranks, breakdown


def test_per_expert_slices_read_the_layout_peft_folds():
    """Our per-expert sums pick, for expert e, exactly the lora_A rows and lora_B columns PEFT's own
    get_delta_weight uses for that expert."""
    model = peft_moe(moe_student())
    wrappers = [
        m
        for n, m in model.named_modules()
        if n.endswith("layers.0.mlp.experts") or n.endswith("layers.0.mlp.experts.base_layer")
    ]
    assert len(wrappers) == 2 and {w.parameter_name for w in wrappers} == {"gate_up_proj", "down_proj"}
    e_n = 4
    for w in wrappers:
        a, b = w.lora_A["default"].weight, w.lora_B["default"].weight
        for e in range(e_n):
            with torch.no_grad():
                a.copy_(torch.randn_like(a))
                b.zero_()
                b[:, e::e_n] = torch.randn_like(b[:, e::e_n])  # the candidate layout of expert e's columns
            delta = w.get_delta_weight("default")
            assert [bool(delta[x].abs().sum() > 0) for x in range(e_n)] == [x == e for x in range(e_n)]
            assert [bool(v > 0) for v in moe._per_expert_abs(b.detach(), e_n, "B")] == [x == e for x in range(e_n)]
            with torch.no_grad():
                b.copy_(torch.randn_like(b))
                a.zero_()
                a[e * 4 : (e + 1) * 4] = torch.randn_like(a[e * 4 : (e + 1) * 4])  # expert e's rows
            delta = w.get_delta_weight("default")
            assert [bool(delta[x].abs().sum() > 0) for x in range(e_n)] == [x == e for x in range(e_n)]
            assert [bool(v > 0) for v in moe._per_expert_abs(a.detach(), e_n, "A")] == [x == e for x in range(e_n)]


def test_divided_expert_rank_goes_through_rank_pattern_and_keeps_the_scaling():
    model = peft_moe(moe_student(lora={"r": 8, "alpha": 16}, moe={"expert_rank": "divided"}))
    w = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.experts"))  # down_proj (E, H, I)
    assert tuple(w.lora_A["default"].weight.shape) == (2 * 4, 48) and tuple(w.lora_B["default"].weight.shape) == (64, 8)
    assert w.scaling["default"] == pytest.approx(16 / 8)
    q = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    assert q.r["default"] == 8
    with pytest.raises(ValueError, match=r"8 // 16 = 0, and a LoRA rank must be at least 1"):
        moe.lora_kwargs(moe_student(lora={"r": 8}, moe={"expert_rank": "divided"}), tiny_moe(num_experts=16).config)


def test_breakdown_by_kind_and_the_refusal_of_frozen_routed_experts():
    from transformers import LlamaConfig, LlamaForCausalLM

    attn_only = moe_student(lora={"target_parameters": []})
    b = moe.parameter_breakdown(peft_moe(attn_only))
    assert b["trainable"] == {
        "attention": 2 * 4 * 4 * 128,
        "dense_mlp": 0,
        "routed_experts": 0,
        "router": 0,
        "other": 0,
    }
    assert b["parameters"]["routed_experts"] == 2 * 4 * 3 * 64 * 48 and b["parameters"]["router"] == 2 * 4 * 64
    with pytest.raises(TrainingError) as e:
        moe.refuse_frozen_experts(b, attn_only, "tiny-moe")
    for needle in (
        "4 routed experts",
        "73,728 parameters",
        "student.lora.target_parameters",
        "student.moe.experts: frozen",
    ):
        assert needle in str(e.value)
    moe.refuse_frozen_experts(b, moe_student(lora={"target_parameters": []}, moe={"experts": "frozen"}), "tiny-moe")
    full = moe.parameter_breakdown(peft_moe(moe_student(moe={"router": "trained"})))
    assert full["trainable"]["routed_experts"] == 2 * 4 * 4 * (128 + 144) and full["trainable"]["router"] == 512
    assert full["parameters"] == b["parameters"]  # a modules_to_save copy is not counted as a base parameter
    moe.refuse_frozen_experts(full, moe_student(), "tiny-moe")
    dense = LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    )
    d = moe.parameter_breakdown(dense)
    assert (
        d["num_experts"] == 0 and d["parameters"]["routed_experts"] == 0 and d["parameters"]["dense_mlp"] == 3 * 32 * 64
    )
    moe.refuse_frozen_experts(d, moe_student(lora={"target_parameters": []}), "dense")


def test_load_balancing_loss_and_routed_counts_match_hugging_face_with_padding():
    """The monitor's per-micro-batch auxiliary loss is Hugging Face's (masked by the same padding) and its
    routed-token counts are the real tokens' top-k choices; the term it adds is coef · aux · n / N."""
    model = peft_moe(moe_student(moe={"router": "trained", "aux_loss_coef": 0.01}))
    student = moe_student(moe={"router": "trained", "aux_loss_coef": 0.01})
    mon = moe.MoeMonitor.attach(model, student, moe.parameter_breakdown(model), lambda _m: None, 1, torch.float32)
    ids = torch.randint(4, 32, (3, 10), generator=torch.Generator().manual_seed(1))
    lengths = [10, 6, 3]
    batch = {"input_ids": ids}
    mask = moe.token_mask(batch, lengths)
    assert mask.sum() == 19 and mask[2].tolist() == [1, 1, 1] + [0] * 7
    assert moe.token_mask({"input_ids": ids[:1]}, [4, 6]).tolist() == [[1] * 10]  # rows laid end to end
    mon.begin()
    ref = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    term, aux_n = mon.end(mask, 38)  # as if the step's real tokens across ranks were twice this micro-batch's
    assert float(ref.aux_loss) == pytest.approx(aux_n / 19, rel=1e-6)
    assert float(term) == pytest.approx(0.01 * float(ref.aux_loss) * 19 / 38, rel=1e-6)
    for layer, logits in enumerate(ref.router_logits):
        top = logits.softmax(-1).topk(2, dim=-1).indices
        real = torch.zeros(4).scatter_add_(0, top.reshape(-1), mask.reshape(-1).float().repeat_interleave(2))
        assert mon.counts[layer].tolist() == real.tolist()
    assert mon.counts.sum() == 2 * 19 * 2  # layers × real tokens × top-k
    term.backward()
    gate = next(p for n, p in model.named_parameters() if ".layers.1.mlp.gate.modules_to_save." in n)
    assert gate.grad is not None and gate.grad.abs().sum() > 0  # the aux loss trains the router
    model(input_ids=ids)  # an eval-like forward outside begin()/end() is not counted
    assert mon.counts.sum() == 2 * 19 * 2


@pytest.mark.stage
def test_4bit_quantizes_the_attention_and_leaves_the_fused_experts_in_the_compute_dtype(tmp_path):
    """bitsandbytes packs nn.Linear only: the planner's assumption, and the metadata's experts_quantized."""
    import bitsandbytes as bnb

    from training.model import load_student

    base = save_tiny_moe(tmp_path / "moe")
    student = moe_student(quantization={"load_in_4bit": True, "compute_dtype": "float32"})
    model = load_student(str(base), student, torch.device("cpu"), attn_implementation="eager")
    b = moe.parameter_breakdown(model)
    assert b["experts_quantized"] is False and set(b["quantized_parameters"]) == {"attention"}
    assert b["quantized_parameters"]["attention"] == 2 * 4 * 64 * 64 == b["parameters"]["attention"] - 2 * 2 * 16
    experts = [
        p
        for n, p in model.named_parameters()
        if n.endswith(("experts.base_layer.base_layer.gate_up_proj", "experts.base_layer.base_layer.down_proj"))
    ]
    assert len(experts) == 4 and all(not isinstance(p, bnb.nn.Params4bit) and p.dtype == torch.float32 for p in experts)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert all(g is not None and g.abs().sum() > 0 for g in _one_step_expert_b_grads(model))


# --------------------------------------------------------------------------- the trainer, one process


@pytest.mark.stage
def test_trainer_on_the_demo_moe_student(run_job, tmp_path, moe_student):
    """Attention + expert LoRA + trained router, aux loss on: the breakdown, the expert-gradient checks, the
    routed-token counts (every real token × top-k × MoE layer), every expert's lora_B trained, the aux loss in
    the metrics, a PEFT reload of the adapter (router included), and counts that survive a resume."""
    import pyarrow.parquet as pq
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.support.moe_support import moe_student as student_spec
    from tests.support.train_support import make_job, write_cipher_dataset

    ds = write_cipher_dataset(tmp_path / "ds", moe_student, 64, seed=5)
    st = student_spec(moe={"router": "trained"}).model_dump(exclude={"base_model"})
    job = make_job(
        tmp_path / "out",
        moe_student,
        ds,
        student=st,
        max_steps=6,
        micro_batch_size=8,
        eval_rows=16,
        learning_rate=5e-3,
        warmup_steps=1,
        log_every=3,
    )
    s = run_job(job)
    m = s["moe"]
    assert m["trainable_by_kind"] == {
        "attention": 2 * 4 * 4 * 128,
        "dense_mlp": 0,
        "routed_experts": 8704,
        "router": 512,
        "other": 0,
    }
    assert s["trainable_parameters"] == sum(m["trainable_by_kind"].values())
    assert m["routed_experts_trained"] and not m["experts_quantized"] and m["expert_rank"] == 4
    assert [
        (c["step"], c["lora"], c["expert_slices_nonzero"], c["expert_slices"]) for c in m["expert_grad_checks"]
    ] == [(1, "B", 16, 16), (2, "A", 16, 16)]
    assert (m["expert_lora_b_nonzero"], m["expert_lora_b_slices"], m["experts_untrained"]) == (16, 16, [])
    metrics = pq.read_table(tmp_path / "out" / "metrics.parquet").to_pylist()
    real = sum(r["tokens"] for r in metrics)
    assert [sum(v) for v in m["routed_tokens_per_expert"].values()] == [2 * real, 2 * real]
    assert all(1.0 <= r["aux_loss"] <= 4.0 for r in metrics)  # E · Σ f·P: 2 when balanced, 4 when collapsed
    assert all(r["loss"] == pytest.approx(r["ce_loss"] + 0.001 * r["aux_loss"]) for r in metrics)
    assert s["eval_loss"] < s["eval_loss_before"]

    base = AutoModelForCausalLM.from_pretrained(str(moe_student), dtype=torch.float32)
    before = base.model.layers[0].mlp.gate.weight.detach().clone()
    model = PeftModel.from_pretrained(base, str(tmp_path / "out" / "adapter")).eval()
    router = model.base_model.model.model.layers[0].mlp.gate.modules_to_save["default"].weight
    assert not torch.equal(router, before)  # the trained router came back from the adapter
    from training import data as tdata

    rows = tdata.load_rows(ds)
    batch = tdata.collate(rows, list(range(16)), 0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    from training.losses import cross_entropy_sum

    ce, n = cross_entropy_sum(logits, batch["labels"])
    assert float(ce) / n == pytest.approx(s["eval_loss"], rel=1e-4)

    again = run_job(job)  # resumes at the final checkpoint: nothing left to train
    assert again["resumed_from_step"] == 6 and again["moe"]["routed_tokens_per_expert"] == m["routed_tokens_per_expert"]
    json.dumps(again)  # the summary is plain JSON


@pytest.mark.stage
def test_activation_checkpointing_neither_double_counts_routing_nor_drops_the_aux_loss(run_job, tmp_path, moe_student):
    """Checkpointed layers run their routers again in backward: those recomputations are not counted, and the
    auxiliary term still reaches the router."""
    import pyarrow.parquet as pq

    from tests.support.moe_support import moe_student as student_spec
    from tests.support.train_support import make_job, write_cipher_dataset

    ds = write_cipher_dataset(tmp_path / "ds", moe_student, 24, seed=3)
    st = student_spec(moe={"router": "trained", "aux_loss_coef": 0.01}).model_dump(exclude={"base_model"})
    s = run_job(
        make_job(
            tmp_path / "out",
            moe_student,
            ds,
            student=st,
            max_steps=3,
            micro_batch_size=8,
            eval_rows=8,
            activation_checkpointing=True,
        )
    )
    metrics = pq.read_table(tmp_path / "out" / "metrics.parquet").to_pylist()
    real = sum(r["tokens"] for r in metrics)
    assert [sum(v) for v in s["moe"]["routed_tokens_per_expert"].values()] == [2 * real, 2 * real]
    assert all(r["aux_loss"] > 0 for r in metrics) and s["moe"]["expert_lora_b_nonzero"] == 16


@pytest.mark.stage
def test_trainer_refuses_routed_experts_left_frozen_unless_on_purpose(tmp_path, moe_student):
    from tests.support.moe_support import moe_student as student_spec
    from tests.support.train_support import make_job, write_cipher_dataset
    from training.recipes import LoraFinetuneRecipe

    ds = write_cipher_dataset(tmp_path / "ds", moe_student, 16, seed=1)
    frozen = student_spec(lora={"target_parameters": []}).model_dump(exclude={"base_model"})
    t = LoraFinetuneRecipe(make_job(tmp_path / "a", moe_student, ds, student=frozen, max_steps=1, micro_batch_size=4))
    with pytest.raises(
        TrainingError,
        match=r"has 4 routed experts .* none of them would be trained: .* Set "
        r"student.lora.target_parameters .* or student.moe.experts: frozen",
    ):
        t.setup()
    t.cleanup(False)
    on_purpose = student_spec(lora={"target_parameters": []}, moe={"experts": "frozen"}).model_dump(
        exclude={"base_model"}
    )
    t = LoraFinetuneRecipe(
        make_job(tmp_path / "b", moe_student, ds, student=on_purpose, max_steps=1, micro_batch_size=4)
    )
    try:
        t.setup()
        assert t.param_breakdown["trainable"]["routed_experts"] == 0 and t.moe is not None
        assert t.moe.expert_loras == []
    finally:
        t.cleanup()
