"""Memory by policy (campaign_orchestrator/costs/memory_policy.py): the micro-batch and activation policy follow the
device's memory; FSDP2's reshard_after_forward follows the topology and the estimate follows it."""

from __future__ import annotations

import pytest

from campaign_orchestrator.costs.memory import ModelShape, training_memory
from campaign_orchestrator.costs.memory_policy import (
    DeviceFacts,
    choose_memory_policy,
    plan_memory_policy,
    resolve_training_policy,
    resolved_training,
)
from campaigns.spec import StudentSpec, TrainingSpec

# TinyLlama-1.1B's shape (benchmarks/train_gpu_step.py's model), LoRA r16 on all seven projections
TINYLLAMA = ModelShape(
    hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, head_dim=64, vocab=32000, tied=False
)
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def student(load_in_4bit: bool = False) -> StudentSpec:
    return StudentSpec.model_validate(
        {
            "base_model": "tinyllama",
            "lora": {"r": 16, "target_modules": ALL7},
            "quantization": {"load_in_4bit": load_in_4bit, "compute_dtype": "bfloat16"},
        }
    )


def training(**kw) -> TrainingSpec:
    return TrainingSpec.model_validate(
        {"max_steps": 10, "micro_batch_size": "auto", "activation_checkpointing": "auto"} | kw
    )


def test_an_80gb_and_a_24gb_device_pick_differently():
    big = choose_memory_policy(TINYLLAMA, student(), training(), device_memory_gb=80, seq_len=1024)
    small = choose_memory_policy(TINYLLAMA, student(), training(), device_memory_gb=24, seq_len=1024)
    assert big.fits and small.fits
    assert (big.micro_batch_size, big.activation_policy) != (small.micro_batch_size, small.activation_policy)
    assert big.activation_policy == "none"  # room to keep every activation
    assert big.micro_batch_size * 1024 > 4 * 1024  # many more tokens per step than 4 x 1024 on a large GPU
    assert small.activation_policy in ("recompute", "full")  # the same step does not fit without recomputing
    for p in (big, small):
        assert p.estimated_peak_gb <= p.usable_gb == pytest.approx(p.device_memory_gb * 0.9)
        assert p.chosen == ("micro_batch_size", "activation_checkpointing")
    # what was chosen is what the estimate says fits, and keeping everything at the 24 GB choice would not
    mem = training_memory(TINYLLAMA, _spec(student(), training()), 1024, micro_batch=small.micro_batch_size)
    assert mem["total_by_policy_gb"]["none"] > small.usable_gb >= mem["total_by_policy_gb"][small.activation_policy]


def test_qlora_needs_less_than_lora_and_a_set_field_is_kept():
    lora = choose_memory_policy(TINYLLAMA, student(), training(micro_batch_size=8), device_memory_gb=12.5, seq_len=1024)
    qlora = choose_memory_policy(
        TINYLLAMA, student(True), training(micro_batch_size=8), device_memory_gb=12.5, seq_len=1024
    )
    assert lora.micro_batch_size == qlora.micro_batch_size == 8 and lora.chosen == ("activation_checkpointing",)
    # the 4-bit base leaves room to keep more: LoRA must checkpoint where QLoRA only recomputes the cheap part
    assert (lora.activation_policy, qlora.activation_policy) == ("full", "recompute")
    fixed = choose_memory_policy(
        TINYLLAMA, student(), training(activation_checkpointing=True), device_memory_gb=24, seq_len=1024
    )
    assert fixed.activation_policy == "full" and fixed.chosen == ("micro_batch_size",)
    resolved = resolved_training(training(activation_checkpointing=True), fixed)
    assert resolved.micro_batch_size == fixed.micro_batch_size and resolved.activation_checkpointing is True


def test_nothing_fits_gives_the_leanest_choice_flagged():
    p = choose_memory_policy(TINYLLAMA, student(), training(), device_memory_gb=1, seq_len=1024)
    assert not p.fits and p.micro_batch_size == 1 and p.activation_policy == "full"


def test_without_the_exact_recompute_auto_chooses_between_none_and_full():
    p = choose_memory_policy(TINYLLAMA, student(), training(), device_memory_gb=24, seq_len=1024, recompute_cheap=False)
    assert p.activation_policy in ("none", "full")


def _spec(st, tr):
    from types import SimpleNamespace

    return SimpleNamespace(student=st, training=tr)


def test_reshard_after_forward_follows_the_topology_and_the_estimate_follows_it():
    one_node = training(micro_batch_size=4, activation_checkpointing=False, nodes=1, processes_per_node=8)
    two_nodes = training(micro_batch_size=4, activation_checkpointing=False, nodes=2, processes_per_node=4)
    forced = training(
        micro_batch_size=4, activation_checkpointing=False, nodes=1, processes_per_node=8, reshard_after_forward=True
    )
    assert one_node.resharding_after_forward is False and two_nodes.resharding_after_forward is True
    assert forced.resharding_after_forward is True
    gathered = training_memory(TINYLLAMA, _spec(student(), one_node), 1024)
    resharded = training_memory(TINYLLAMA, _spec(student(), forced), 1024)
    across = training_memory(TINYLLAMA, _spec(student(), two_nodes), 1024)
    assert gathered["reshard_after_forward"] is False and resharded["reshard_after_forward"] is True
    # parameters kept gathered from forward to backward: every layer's, not two layers' buffer
    g, r = gathered["per_device_gb"]["allgather_buffer"], resharded["per_device_gb"]["allgather_buffer"]
    assert g == pytest.approx(r * TINYLLAMA.layers / 2)
    assert gathered["total_gb"] - resharded["total_gb"] == pytest.approx(g - r)
    assert across["per_device_gb"]["allgather_buffer"] == pytest.approx(r)


def test_the_planner_resolves_auto_for_its_device():
    from campaigns.spec import CampaignSpec
    from tests.support.train_support import demo_spec

    base = demo_spec().model_dump(mode="json", by_alias=True, exclude_unset=True)
    base["training"] |= {"micro_batch_size": "auto", "activation_checkpointing": "auto", "max_seq_len": 1024}
    spec = CampaignSpec.model_validate(base)
    kw = dict(compute_dtype="bfloat16", headroom=0.9)
    out80, p80 = plan_memory_policy(spec, TINYLLAMA, DeviceFacts("cuda", 80), **kw)
    out24, p24 = plan_memory_policy(spec, TINYLLAMA, DeviceFacts("cuda", 24), **kw)
    assert out80.training.micro_batch_size == p80.micro_batch_size and isinstance(out80.training.micro_batch_size, int)
    assert out24.training.activation_checkpointing == p24.memory.activation_policy
    assert (p80.micro_batch_size, p80.activation_policy) != (p24.micro_batch_size, p24.activation_policy)
    assert p80.seq_len == p24.seq_len == 1024  # the longest row the trainer may get, as the trainer sizes it
    with pytest.raises(ValueError, match="has no memory_gb"):
        plan_memory_policy(spec, TINYLLAMA, DeviceFacts("cuda", None), **kw)
    fixed = demo_spec()  # nothing auto: the campaign as it is, and what it runs
    same, p = plan_memory_policy(fixed, TINYLLAMA, DeviceFacts("cuda", 80), **kw)
    assert same == fixed and p.memory is None and p.micro_batch_size == fixed.training.micro_batch_size


def test_under_compile_the_cheap_recompute_is_the_compiler_s():
    """compile (auto: on CUDA) leaves the exact recompute to the compiler's partitioner: `auto` chooses between none
    and full, and a set `recompute` (or false) runs as none, on the planner's side as on the trainer's."""
    st = student()
    on_cuda = resolve_training_policy(TINYLLAMA, st, training(), DeviceFacts("cuda", 24), compute_dtype="bfloat16")
    on_cpu = resolve_training_policy(
        TINYLLAMA, st, training(compile=False), DeviceFacts("cuda", 24), compute_dtype="bfloat16"
    )
    assert on_cuda.compile and on_cuda.activation_policy in ("none", "full")
    assert not on_cpu.compile and on_cpu.activation_policy == "recompute"  # what the memory allows without compile
    fixed = training(micro_batch_size=2, activation_checkpointing=False)
    ran = resolve_training_policy(TINYLLAMA, st, fixed, DeviceFacts("cuda", 80), compute_dtype="bfloat16")
    assert (ran.micro_batch_size, ran.activation_policy, ran.memory) == (2, "none", None)


def test_auto_micro_batch_is_refused_for_on_policy():
    with pytest.raises(ValueError, match="micro_batch_size: auto.*on_policy"):
        training(distillation={"loss": "on_policy"})


def test_speed_only_fields_stay_out_of_the_adapter_key():
    """reshard_after_forward and compile change how fast, not what is trained: no cached adapter is retrained
    because the spec grew them. Resolved for the key, an `auto` attention kernel and activation policy stay out too
    (chosen per device at run time), and the micro-batch is a number."""
    from campaign_orchestrator.keys import training_key_fields
    from tests.support.train_support import demo_spec

    key = training_key_fields(demo_spec())["training"]
    assert {"reshard_after_forward", "compile"}.isdisjoint(key) and "micro_batch_size" in key
    auto = demo_spec()
    auto = auto.model_copy(update={"training": auto.training.model_copy(update={"activation_checkpointing": "auto"})})
    resolved = training_key_fields(auto, "cuda:bfloat16", micro_batch=None)
    assert "activation_checkpointing" not in resolved["training"] and "attn_implementation" not in resolved["student"]
    assert resolved["training"]["micro_batch_size"] == auto.training.micro_batch_size
