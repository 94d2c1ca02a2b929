"""The planner on mixture-of-experts students: parameter counts against real tensors and against the
published Qwen3-30B-A3B config, memory from the total parameters, FLOPs from the active ones, expert
tensors left in full precision by 4-bit, and the settings refused before anything runs."""

from __future__ import annotations

import pytest

from campaign_orchestrator.costs.memory import ModelShape, PlanError, moe_facts, moe_problems, training_memory
from campaigns.loader import parse_campaign_text
from tests.support.moe_support import ATTENTION, EXPERT_TENSORS, moe_student, peft_moe, tiny_moe

# Qwen3-30B-A3B's published config.json (the fields that size it).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def test_qwen3_30b_a3b_total_and_active_parameters_from_its_config():
    s = ModelShape.from_config(QWEN3_30B_A3B)
    assert (s.experts, s.experts_per_tok, s.moe_layers, s.dense_layers) == (128, 8, 48, 0)
    assert s.params == 30_532_122_624  # published: 30.5B
    assert s.active_params == 3_353_032_704  # published: 3.3B activated
    # expert LoRA rank 8 on both fused tensors: 48 · 8 · 128 · (2·2048 + 3·768)
    assert s.expert_lora_params(8, EXPERT_TENSORS) == 48 * 8 * 128 * 6400 == 314_572_800
    # attention LoRA r=8: 48 · 8 · (q 2048+4096, k 2048+512, v 2048+512, o 4096+2048)
    assert s.lora_params(8, ATTENTION) == 6_684_672
    # the dense MLP names match no layer of an all-sparse model
    assert s.lora_params(8, ["gate_proj"]) == 0


@pytest.mark.parametrize("config", [{}, {"mlp_only_layers": [0]}], ids=["all-sparse", "layer-0-dense"])
@pytest.mark.parametrize("expert_rank", ["full", "divided"])
def test_parameter_counts_match_the_real_tensors_of_the_tiny_moe(config, expert_rank):
    from training.moe import parameter_breakdown

    model = tiny_moe(**config)
    shape = ModelShape.from_config(model.config.to_dict())
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    k, e = model.config.num_experts_per_tok, model.config.num_experts
    assert shape.params == total
    assert shape.active_params == total - expert + expert * k // e
    assert shape.expert_params == expert and shape.moe_layers == (1 if config else 2)
    # (LoRA on a dense layer's MLP cannot be asked for on a MoE: tests/training/test_moe.py, the xfail reproducer)
    student = moe_student(lora={"r": 8}, moe={"expert_rank": expert_rank, "router": "trained"})
    b = parameter_breakdown(peft_moe(student, model))
    rank = 8 if expert_rank == "full" else 8 // e
    assert b["trainable"]["routed_experts"] == shape.expert_lora_params(rank, EXPERT_TENSORS)
    assert b["trainable"]["routed_experts"] == shape.moe_layers * rank * e * (2 * 64 + 3 * 48)
    assert b["trainable"]["attention"] == shape.lora_params(8, ATTENTION)
    assert b["trainable"]["dense_mlp"] == 0 and b["parameters"]["dense_mlp"] == (3 * 64 * 192 if config else 0)
    assert b["trainable"]["router"] == shape.router_params == shape.moe_layers * e * 64
    assert b["parameters"]["routed_experts"] == expert and sum(b["parameters"].values()) == total
    memory = training_memory(shape, _spec(student), seq_len=16)
    assert memory["lora_params"] == sum(b["trainable"].values())


def _spec(student, training: str = "") -> object:
    import yaml

    return parse_campaign_text(
        yaml.safe_dump(
            {
                "name": "m",
                "teacher": {"model": "@demo/teacher", "hardware": "cpu-2vcpu"},
                "student": student.model_dump(),
                "data": {"source": "campaigns/data/demo/*.jsonl"},
                "training": {
                    "max_steps": 10,
                    "micro_batch_size": 4,
                    "hardware": "cpu-2vcpu",
                    **yaml.safe_load("{" + training + "}"),
                },
                "evaluation": {"suites": [{"name": "s"}]},
            }
        )
    )


def test_memory_follows_total_parameters_and_4bit_leaves_the_experts_in_the_compute_dtype():
    shape = ModelShape.from_config(tiny_moe().config.to_dict())
    qlora = training_memory(shape, _spec(moe_student(quantization={"load_in_4bit": True})), seq_len=16)
    attn_linear = 2 * (4 * 64 * 64)  # q, k, v, o of both layers: the only nn.Linear weights of the decoder
    assert shape.linear_params == attn_linear == qlora["quantized_params"]
    kept = 32 * 64 + 2 * 2 * 64 + 64 + 2 * 2 * 16 + shape.expert_params + shape.router_params
    assert shape.other_params == kept and shape.params == attn_linear + kept
    assert qlora["per_device_gb"]["base_weights"] == pytest.approx((attn_linear * (0.5 + 4 / 64) + kept * 2) / 1e9)
    facts = moe_facts(shape, _spec(moe_student()).student)["moe"]
    assert facts["experts_quantized"] is False and facts["active_params"] == shape.active_params
    assert facts["expert_lora_params"] == 2 * 4 * 4 * (128 + 144)
    # the folded expert stack W + s·B·A of every MoE layer is kept for backward (one layer with checkpointing)
    with_lora = training_memory(shape, _spec(moe_student()), seq_len=16)["per_device_gb"]
    without = training_memory(
        shape, _spec(moe_student(lora={"target_parameters": []}, moe={"experts": "frozen"})), seq_len=16
    )["per_device_gb"]
    folded = 2 * shape.expert_params / 2  # bytes of one layer's stack in a 16-bit compute dtype
    assert with_lora["activations"] - without["activations"] == pytest.approx(3 * folded / 1e9)
    assert with_lora["activations_checkpointed"] - without["activations_checkpointed"] == pytest.approx(
        2 * folded / 1e9
    )


def test_training_flops_and_generation_time_follow_the_active_parameters(tmp_path):
    from campaign_orchestrator.costs.catalog import read_catalog
    from campaign_orchestrator.costs.plan.facts import DataFacts
    from campaign_orchestrator.costs.plan.roofline import generation_seconds
    from campaign_orchestrator.costs.plan.stages import plan_stages
    from campaigns.paths import shipped_campaigns_dir

    moe = ModelShape.from_config(QWEN3_30B_A3B)
    spec = _spec(moe_student(), training="hardware: h100-sxm, nodes: 1, processes_per_node: 8")
    catalog = read_catalog(shipped_campaigns_dir() / "pricing/catalog.yaml")
    facts = DataFacts(
        train_prompts=1000,
        heldout_items=100,
        prompt_tokens_teacher=10.0,
        prompt_tokens_student=10.0,
        heldout_prompt_tokens_student=10.0,
        heldout_prompt_tokens_teacher=10.0,
        suites={"s": (100, 10.0)},
    )
    st = plan_stages(spec, catalog, facts, moe, moe)["student_adapter"]
    head = moe.vocab * moe.hidden
    body = moe.active_params - head * (1 if moe.tied else 2)
    assert st.flops == pytest.approx(4 * body * st.tokens + 4 * head * st.labelled_tokens)
    assert 0 < st.labelled_tokens < st.tokens  # the head only where a label is (the prompt has none)
    entry = catalog.get("h100-sxm")
    a = generation_seconds(moe.active_params, moe.params * 2, 1000, 10, 16, 1000, entry, 1.0)
    b = generation_seconds(moe.params, moe.params * 2, 1000, 10, 16, 1000, entry, 1.0)
    assert a < b  # compute from the active parameters, weight reads from the total


def test_qwen3_30b_a3b_memory_on_eight_gpus_from_the_total():
    shape = ModelShape.from_config(QWEN3_30B_A3B)
    spec = _spec(
        moe_student(lora={"r": 8}, quantization={"load_in_4bit": True}),
        training="nodes: 1, processes_per_node: 8, sharding: full, micro_batch_size: 1",
    )
    m = training_memory(shape, spec, seq_len=2048)
    gb = m["per_device_gb"]
    # 4-bit packs only the attention (~0.9B); ~29B expert parameters stay in bf16, sharded over 8 ranks
    assert shape.linear_params == 48 * 18_874_368
    assert gb["base_weights"] == pytest.approx(
        (shape.linear_params * (0.5 + 4 / 64) + shape.other_params * 2) / 8 / 1e9
    )
    assert 7.0 < gb["base_weights"] < 8.0
    assert m["lora_params"] == 314_572_800 + 6_684_672
    assert gb["optimizer_states"] == pytest.approx(12 * m["lora_params"] / 8 / 1e9)
    folded = 2 * shape.expert_params / 48  # ~1.2 GB per layer, kept for backward in every layer without checkpointing
    assert folded / 1e9 == pytest.approx(1.2079, rel=1e-3)
    assert gb["activations"] > 48 * folded / 1e9 > gb["activations_checkpointed"]


def test_moe_settings_the_model_refuses_are_named_before_anything_runs():
    shape = ModelShape.from_config(tiny_moe().config.to_dict())
    dense = ModelShape.from_config(
        {
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 32,
        }
    )
    assert moe_problems(shape, moe_student()) == []
    [untrained] = moe_problems(shape, moe_student(lora={"target_parameters": []}))
    assert "4 routed experts" in untrained and "student.lora.target_parameters" in untrained
    assert "student.moe.experts: frozen" in untrained
    assert moe_problems(shape, moe_student(lora={"target_parameters": []}, moe={"experts": "frozen"})) == []
    [rank] = moe_problems(shape, moe_student(lora={"r": 2}, moe={"expert_rank": "divided"}))
    assert "2 // 4 = 0" in rank and "student.lora.r to at least 4" in rank
    assert moe_problems(shape, moe_student(lora={"r": 4}, moe={"expert_rank": "divided"})) == []
    [router] = moe_problems(shape, moe_student(lora={"target_modules": ["q_proj", "gate"]}))
    assert "student.moe.router: trained" in router
    [mlp] = moe_problems(shape, moe_student(lora={"target_modules": ["q_proj", "down_proj"]}))
    assert "every layer's MLP is routed experts" in mlp
    one_dense = ModelShape.from_config(tiny_moe(mlp_only_layers=[0]).config.to_dict())
    [mlp] = moe_problems(one_dense, moe_student(lora={"target_modules": ["q_proj", "gate_proj"]}))
    assert "PEFT (on transformers 5) rewrites" in mlp and "dense MLP layers would get no LoRA" in mlp
    [on_dense] = moe_problems(dense, moe_student())
    assert "the model is dense" in on_dense
    with pytest.raises(PlanError, match=r"4 // 4|2 // 4"):
        from campaign_orchestrator.costs.memory import expert_rank

        expert_rank(shape, moe_student(lora={"r": 2}, moe={"expert_rank": "divided"}))


def test_campaign_validate_refuses_what_the_moe_student_cannot_train(tmp_path, capsys):
    """`campaign validate` reads the student's config.json when it is on disk: routed experts that nothing
    trains and a per-expert rank below 1 are refused with the fields to set."""
    import yaml

    from campaign_app.cli import main
    from tests.support.moe_support import write_moe_config

    write_moe_config(tmp_path / "moe")  # the config is all validate reads
    assert ModelShape.from_model_dir(tmp_path / "moe") == ModelShape.from_config(tiny_moe().config.to_dict())
    spec = {
        "name": "bad_moe",
        "teacher": {"model": "@demo/teacher", "hardware": "cpu-2vcpu"},
        "student": {
            "base_model": str(tmp_path / "moe"),
            "lora": {"r": 2, "target_modules": ATTENTION},
            "quantization": {"load_in_4bit": False},
        },
        "data": {"source": "campaigns/data/demo/*.jsonl"},
        "training": {"max_steps": 1, "hardware": "cpu-2vcpu"},
        "evaluation": {"suites": [{"name": "s"}]},
    }
    bad = tmp_path / "bad_moe.yaml"
    bad.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(bad), "--artifacts", str(tmp_path / "artifacts")]) == 1
    out = capsys.readouterr().out
    assert "invalid" in out and "student.lora.target_parameters" in out and "student.moe.experts: frozen" in out
    spec["student"]["lora"]["target_parameters"] = EXPERT_TENSORS
    spec["student"]["moe"] = {"expert_rank": "divided"}
    bad.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(bad)]) == 1
    assert "2 // 4 = 0 per expert" in capsys.readouterr().out
    spec["student"]["lora"]["r"] = 8
    bad.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(bad)]) == 0
