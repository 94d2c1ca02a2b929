"""The plan as ``campaign plan`` prints it: data, memory per device and fit, each stage's time and dollars, the
total against the budget, and the teacher stage's replica table."""

from __future__ import annotations

from pathlib import Path

from campaign_orchestrator.costs.plan.campaign import MIXED, Plan
from campaign_orchestrator.costs.plan.scaleout import ScaleOut
from campaign_orchestrator.costs.plan.stages import (
    EvaluationEstimate,
    OnPolicyEstimate,
    StageEstimate,
    SweepEstimate,
    TeacherEstimate,
    TrainingEstimate,
)


def render_plan(plan: Plan) -> str:
    """Plain-text plan for `campaign plan`."""
    m, d = plan.memory, plan.data
    catalog = Path(plan.catalog)
    if catalog.is_absolute() and catalog.is_relative_to(Path.cwd()):
        catalog = catalog.relative_to(Path.cwd())
    lines = [
        f"plan for campaign {plan.campaign} (catalog {catalog} version {plan.catalog_version}, "
        f"{plan.pricing_tier.replace('_', '-')} prices)",
        "",
        f"data: {d.train_prompts} training prompts, {d.heldout_items} held-out items; mean prompt "
        f"{d.prompt_tokens_teacher:.1f} teacher / {d.prompt_tokens_student:.1f} student tokens ({d.tokenizer})",
        "",
        *_memory_lines(m),
        "",
        "estimated cost per stage:",
    ]
    for name, s in plan.stages.items():
        secs = "—" if s.seconds is None else f"{s.seconds:.0f} s"
        cost = "unknown" if s.usd is None else f"${s.usd:.6f}"
        qty = f"{s.quantity:.6f} {s.unit:14s}" if s.unit != MIXED else f"{MIXED:29s}"
        lines.append(f"  {name:20s} {secs:>9s}  {qty} {cost}   ({_stage_text(s)}, {s.price_key})")
    for name, t in (plan.teachers or {}).items():  # several teachers: each one's share and dollars
        lines.append(
            f"    teacher {name}: {t['train_share']:.0%} of the training prompts, "
            f"{_usd(t.get('teacher_generations_usd'))}"
            + (
                f"; {t['heldout_share']:.0%} of the held-out items, {_usd(t['scoring_usd'])}"
                if "scoring_usd" in t
                else ""
            )
        )
    total = "unknown" if plan.total_usd is None else f"${plan.total_usd:.6f}"
    lines.append(
        f"  {'total':20s} {'':>9s}  {'':21s} {total}" + (f"   ({'; '.join(plan.unknown)})" if plan.unknown else "")
    )
    if plan.budget_usd is not None:
        lines.append(
            f"budget ${plan.budget_usd:.2f}: "
            + ("within budget" if plan.within_budget else "the estimate EXCEEDS the budget")
        )
    if plan.scaleout:
        lines += render_scaleout(plan.scaleout)
    return "\n".join(lines)


def _memory_lines(m: dict) -> list[str]:
    """The student's memory per device, the device's verdict, and full fine-tuning's for comparison."""
    gb = m["per_device_gb"]
    lines = [
        f"student memory per device: {m['params']:,} parameters ({m['weights']}), LoRA {m['lora_params']:,} "
        f"trainable; world {m['world_size']}, sharding {m['sharding']} (states sharded over {m['shard_group']}); "
        f"micro-batch {m['micro_batch']} × {m['seq_len']} tokens"
    ]
    rows = [
        ("process runtime (Python, torch, ...)", gb.get("runtime", 0.0)),
        (f"base weights ({m.get('compute_dtype', 'bfloat16')} compute)", gb["base_weights"]),
        ("LoRA weights", gb["lora_weights"]),
        ("LoRA gradients", gb["lora_gradients"]),
        ("optimizer states (Adam, K=12)", gb["optimizer_states"]),
        ("FSDP all-gather buffer", gb["allgather_buffer"]),
        ("activations", gb["activations"]),
        ("activations, checkpointed", gb["activations_checkpointed"]),
        ("logits + loss", gb["logits"]),
        ("heap kept by the C allocator (CPU)", gb.get("heap_retained", 0.0)),
    ]
    lines += [f"  {name:34s} {_gb(v)}" for name, v in rows]
    if m.get("training_policy"):  # the trainer's own resolution on this device (costs.memory_policy)
        from campaign_orchestrator.costs.memory_policy import describe_policy

        lines.insert(1, f"  the trainer will run: {describe_policy(m['training_policy'])}")
    lines += _moe_lines(m)
    lines.append(f"  {'total (no checkpointing)':34s} {_gb(m['total_gb'])}")
    lines.append(f"  {'total (activation checkpointing)':34s} {_gb(m['total_checkpointed_gb'])}")
    if "device" in m:
        verdict = "fits" if m["fits"] else "does NOT fit"
        if not m["fits"] and m["fits_with_checkpointing"]:
            verdict += " (fits with activation checkpointing)"
        lines.append(
            f"  device {m['device']}: {m['device_memory_gb']:g} GB, {m['usable_gb']:.1f} GB usable → {verdict}"
        )
    z = m["zero_full_finetune_gb"]
    return lines + [
        "",
        f"full fine-tuning model states per device, for comparison (Ψ = {m['params']:,}, N = {m['world_size']}):",
        f"  ZeRO-0/DDP {_gb(z['zero0_ddp'])}  ZeRO-1 {_gb(z['zero1'])}  ZeRO-2 {_gb(z['zero2'])}  "
        f"ZeRO-3/FSDP {_gb(z['zero3_fsdp_full'])}  hybrid {_gb(z['fsdp_hybrid'])}",
    ]


def _stage_text(s: StageEstimate) -> str:
    """A stage row's detail: what the estimate counted."""
    if isinstance(s, TeacherEstimate):
        return f"{s.tokens:,.0f} teacher tokens"
    if isinstance(s, TrainingEstimate):
        return f"{s.steps} steps, {s.tokens:,.0f} tokens" + _on_policy_text(s.on_policy)
    if isinstance(s, SweepEstimate):
        return (
            f"{s.trials} trials, rungs "
            + " → ".join(f"{r['trials']}×{r['steps']}" for r in s.rungs)
            + f", {s.steps} steps"
            + (f", cap ${s.cap_usd:g}" if s.cap_usd else "")
        )
    assert isinstance(s, EvaluationEstimate), type(s)
    return f"{s.items} items × {len(s.models)} models" + (
        f"; {s.teacher_items_from_base} teacher answers are the base's" if s.teacher_items_from_base else ""
    )


def _on_policy_text(op: OnPolicyEstimate | None) -> str:
    """The student_adapter row's on-policy part: rounds, student sampling time, teacher prefills and their price."""
    if not op:
        return ""
    usd = "unknown" if op.teacher_usd is None else f"${op.teacher_usd:.6f}"
    where = (
        f"in process, {op.scoring_seconds_in_process:.0f} s on the training host"
        if op.scoring_seconds_in_process is not None
        else f"{usd} at {op.teacher_price_key}"
    )
    return (
        f"; on-policy: {op.rounds} rounds, {op.samples:,} student samples ({op.sampling_seconds:.0f} s "
        f"sampling), teacher prefill {op.teacher_prefill_tokens:,.0f} tokens ({where})"
    )


def _moe_lines(m: dict) -> list[str]:
    e = m.get("moe")
    if not e:
        return []
    lora = (
        f"expert LoRA {e['expert_lora_params']:,} (rank {e['expert_rank']} per expert)"
        if e["expert_rank"]
        else "no expert LoRA"
    )
    return [
        f"  mixture of experts: {e['experts']} experts, top-{e['experts_per_tok']}, {e['moe_layers']} MoE layers; "
        f"{e['total_params']:,} total / {e['active_params']:,} active parameters (memory from the total, FLOPs and "
        f"time from the active)",
        f"    expert tensors + routers {_gb(e['expert_weights_gb']).strip()} in the compute dtype (4-bit quantizes "
        f"nn.Linear only: the fused experts stay full precision); {lora}"
        + (f"; router trained ({e['router_trainable_params']:,})" if e["router_trainable_params"] else "")
        + (
            f"; folded expert copy {_gb(e['folded_expert_layer_gb']).strip()} per MoE layer (in the activations)"
            if e["folded_expert_layer_gb"]
            else ""
        ),
    ]


def _gb(x: float) -> str:
    return f"{x:10.6f} GB" if x < 0.01 else f"{x:10.3f} GB"


def render_scaleout(s: ScaleOut) -> list[str]:
    """The replica table of :func:`~campaign_orchestrator.costs.plan.scaleout.plan_scaleout` as text lines."""
    head = (
        f"{s.stage} on Ray replicas ({s.kind}; {s.requests:,} requests in {s.shards:,} shard(s) of "
        f"{s.shard_prompts}; execution.replicas is {s.configured_replicas}):"
    )
    lines = ["", head, f"  {'replicas':>8s} {'time':>12s} {'speed-up':>9s} {'efficiency':>10s} {'cost':>14s}  bound"]
    for r in s.rows:
        cost = "unknown" if r.usd is None else f"${r.usd:,.4f}"
        lines.append(
            f"  {r.replicas:>8d} {_duration(r.seconds):>12s} {r.speedup:>8.2f}× "
            f"{r.efficiency:>9.0%} {cost:>14s}  {r.bound}"
        )
    if s.ceiling:
        cl = s.ceiling
        lines.append(
            f"  rate-limit ceiling: {cl['requests_per_minute']:,.0f} requests/min = "
            f"{cl['tokens_per_minute']:,.0f} tokens/min as the limiter counts them (prompt + max_new_tokens), "
            f"bound by teacher.{cl['binding']}; the stage takes at least {_duration(cl['minimum_seconds'])}"
        )
    lines.append(f"  knee: {s.knee_replicas} replica(s): {s.why_more_stop_helping}")
    a = s.assumptions
    lines.append(
        "  assumptions: "
        + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in a.items() if v is not None)
        + (f"; price {s.price_key} as of {s.price_as_of}" if s.price_key else "")
    )
    return lines


def _duration(seconds: float) -> str:
    if seconds >= 3 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 180:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def _usd(x: float | None) -> str:
    return "unknown" if x is None else f"${x:.6f}"
