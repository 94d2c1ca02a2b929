"""Per-device memory of the student's training and whether it fits the device (the bytes are counted by
:mod:`campaign_orchestrator.costs.memory`; this module picks the sequence length, attention kernel, compute dtype
and heap retention the run will have, and compares the total with the device)."""

from __future__ import annotations

import math

from campaign_orchestrator.costs.catalog import Catalog, PriceEntry
from campaign_orchestrator.costs.memory import DTYPE_BYTES, ModelShape, moe_facts, training_memory
from campaign_orchestrator.costs.memory_policy import device_facts, device_type_of, plan_memory_policy, policy_terms
from campaign_orchestrator.costs.plan.facts import DataFacts
from campaign_orchestrator.costs.plan.roofline import compute_dtype_on, packed_rows
from campaigns.spec import CampaignSpec


def heap_retention(entry: PriceEntry, spec: CampaignSpec) -> tuple[float, str]:
    """(share of activations + logits the C heap keeps resident, allocator): the local launcher starts
    training on jemalloc when this host has it (``campaign_orchestrator.allocator``), which keeps far less
    than glibc (catalog ``perf.heap_retention_jemalloc`` against ``perf.heap_retention``)."""
    if spec.training.launcher == "local" and "heap_retention_jemalloc" in entry.perf:
        from campaign_orchestrator import allocator

        try:
            if allocator.preload_env():
                return float(entry.perf["heap_retention_jemalloc"]), "jemalloc"
        except allocator.AllocatorError:
            pass
    return float(entry.perf.get("heap_retention", 0.0)), "glibc"


def memory_fit(
    spec: CampaignSpec, catalog: Catalog, facts: DataFacts, student: ModelShape
) -> tuple[CampaignSpec, dict]:
    """The campaign with its ``auto`` micro-batch and activation policy resolved for the device's memory (by the
    trainer's own call: ``costs.memory_policy.resolve_training_policy``), and the student's training memory per device
    (``costs.memory.training_memory``'s table at the rows' estimated length, with the allocator, the MoE facts, what
    the trainer will run (``training_policy``) and, where the device's memory is known, whether it fits under
    ``planner.memory_headroom``)."""
    pl = spec.cost.planner
    seq = int(
        math.ceil(
            packed_rows(
                spec, facts.prompt_tokens_student, spec.teacher.sampling.max_new_tokens * pl.completion_fill, 1
            )[0]
        )
    )
    if spec.dataset.packing:
        seq = spec.training.max_seq_len  # the longest packed row sets the peak
    device = catalog.get(spec.training.hardware)
    sdt = compute_dtype_on(spec.student.quantization.compute_dtype, device)
    retention, alloc = heap_retention(device, spec)
    # what the trainer will run there: its own call, with the inputs the trainer has (costs.memory_policy)
    on = device_facts(policy_terms(spec, catalog), device_type_of(device), device.memory_gb, alloc)
    spec, policy = plan_memory_policy(spec, student, on, compute_dtype=sdt, headroom=pl.memory_headroom)
    mem = training_memory(student, spec, seq, sdt, on.runtime_gb, policy.attention, retention)
    mem["allocator"] = alloc
    mem |= moe_facts(student, spec.student, DTYPE_BYTES[sdt])  # MoE: total vs active parameters, expert tensors
    ckpt = spec.training.activation_checkpointing in (True, "full")
    mem["training_policy"] = policy.as_dict()
    if policy.memory is not None:
        mem["memory_policy"] = policy.memory.as_dict()
    if device.memory_gb is not None:
        usable = device.memory_gb * pl.memory_headroom
        mem |= {
            "device": device.key,
            "device_memory_gb": device.memory_gb,
            "usable_gb": usable,
            "activation_checkpointing": ckpt,
            "fits": (mem["total_checkpointed_gb"] if ckpt else mem["total_gb"]) <= usable,
            "fits_with_checkpointing": mem["total_checkpointed_gb"] <= usable,
        }
    return spec, mem
