"""The planner: before anything runs, does the student fit its GPUs, and what will each stage cost?

Memory (per device, decimal GB) for LoRA/QLoRA training under the campaign's topology:

* ZeRO / FSDP model states with Adam (K = 12 bytes of optimizer state per parameter: fp32
  master weights, momentum and variance), Ψ parameters, N ranks sharing the states
  (Rajbhandari et al. 2020, "ZeRO", §5)::

      stage 0 (DDP, sharding: none)      (2 + 2 + K) Ψ
      stage 1 (optimizer states)         4Ψ + KΨ/N
      stage 2 (+ gradients)              2Ψ + (2 + K)Ψ/N
      stage 3 (+ parameters; FSDP full)  (2 + 2 + K)Ψ/N
      hybrid (HSDP)                      stage 3 with N = ranks per node (the shard group)

  7.5B parameters on 64 GPUs: 120.0, 31.40625, 16.640625 and 1.875 GB.
* LoRA: the frozen base holds weights only (NF4: 0.5 byte per quantized parameter plus one fp32
  absmax per 64-value block, or ~0.016 byte/param with double quantization; embeddings, norms and
  the LM head stay in the compute dtype), sharded over the shard group. Only the adapters
  (r·(d_in + d_out) per target module) carry gradients and optimizer states: (2 + 2 + K)·Ψ_lora,
  sharded the same way. FSDP all-gathers one decoder layer at a time (plus one prefetched): a
  buffer of two unsharded layers.
* Activations per token and layer in bf16 (after Korthikanti et al. 2022, adapted to a Llama
  block with SwiGLU and fused/flash attention, so no s² term): 2·(6h + 2·kv + 4i) bytes plus the
  LoRA intermediates; with activation checkpointing only each layer's input (2h bytes) is kept
  and one layer is recomputed at a time. The logits add b·s·V·10 bytes (bf16 logits, fp32 copy for
  the loss and its gradient).

Time: a roofline with fixed overheads, from the catalog's ``perf`` block of the hardware:
training FLOPs = 4·Ψ per token (forward 2Ψ, backward through a frozen base 2Ψ; +2Ψ when
activations are recomputed) over ``world × peak × mfu``, plus ``step_overhead_s`` per optimizer
step and ``train_startup_s``. Generation = max(compute, weight reads per decode step over the
memory bandwidth) plus ``decode_step_overhead_s`` per decode step and ``generate_startup_s``.
An API teacher is priced per token and has no time estimate.

Pure Python; reads model ``config.json`` and ``tokenizer.json`` with the ``tokenizers`` library.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from campaigns.spec import CampaignSpec
from campaign_orchestrator.costs.catalog import Catalog, PriceEntry, PricingError

GB = 1e9
ADAM_K = 12
NF4_BLOCK = 64
TOKEN_SAMPLE = 2000  # prompts tokenized to estimate the mean prompt length


class PlanError(ValueError):
    pass


# --------------------------------------------------------------------------- ZeRO / FSDP


def zero_model_state_bytes(psi: float, n: int, stage: int, k: int = ADAM_K) -> float:
    """Per-rank bytes of weights + gradients + optimizer states (mixed precision, Adam: K=12)."""
    if n < 1:
        raise PlanError(f"ranks must be >= 1, got {n}")
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (2 + 2 + k) * psi / n
    raise PlanError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")


def shard_group(sharding: str, world: int, processes_per_node: int) -> int:
    """Ranks that share one copy of the sharded states: all (full), a node (hybrid), one (none)."""
    return {"full": world, "hybrid": processes_per_node, "none": 1}[sharding]


def zero_table(psi: float, world: int, processes_per_node: int, k: int = ADAM_K) -> dict[str, float]:
    """Full fine-tuning model states per rank (GB) under every scheme, for comparison."""
    return {
        "zero0_ddp": zero_model_state_bytes(psi, world, 0, k) / GB,
        "zero1": zero_model_state_bytes(psi, world, 1, k) / GB,
        "zero2": zero_model_state_bytes(psi, world, 2, k) / GB,
        "zero3_fsdp_full": zero_model_state_bytes(psi, world, 3, k) / GB,
        "fsdp_hybrid": zero_model_state_bytes(psi, processes_per_node, 3, k) / GB,
    }


# --------------------------------------------------------------------------- model shape

LINEAR_DIMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer in the Llama / Qwen / Mistral layout."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config.json") -> ModelShape:
        try:
            h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(hidden=h, intermediate=int(cfg["intermediate_size"]), layers=int(cfg["num_hidden_layers"]),
                       heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                       head_dim=int(cfg.get("head_dim") or h // heads), vocab=int(cfg["vocab_size"]),
                       tied=bool(cfg.get("tie_word_embeddings", False)))
        except KeyError as e:
            raise PlanError(f"{where}: missing {e.args[0]!r}; the planner reads Llama-style configs "
                            "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size)") from None

    @classmethod
    def from_model_dir(cls, path: Path) -> ModelShape:
        cfg = Path(path) / "config.json"
        if not cfg.exists():
            raise PlanError(f"no config.json in {path}; the planner needs the model's config to size it")
        return cls.from_config(json.loads(cfg.read_text()), str(cfg))

    def module_dims(self) -> dict[str, tuple[int, int]]:
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder layers' linear projections (what 4-bit quantization packs)."""
        return self.layers * sum(a * b for a, b in self.module_dims().values())

    @property
    def other_params(self) -> int:
        """Embeddings, LM head (unless tied) and norms, kept in the compute dtype."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * 2 * self.hidden + self.hidden

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params

    def layer_weight_params(self) -> int:
        return self.linear_params // self.layers + 2 * self.hidden

    def lora_params(self, r: int, targets: list[str]) -> int:
        dims = self.module_dims()
        unknown = [t for t in targets if t not in dims]
        if unknown:
            raise PlanError(f"student.lora.target_modules: the planner knows {list(dims)}, not {unknown}")
        return self.layers * sum(r * (dims[t][0] + dims[t][1]) for t in targets)


# --------------------------------------------------------------------------- memory


def training_memory(shape: ModelShape, spec: CampaignSpec, seq_len: int) -> dict:
    """Per-device memory of the student's LoRA/QLoRA training under the campaign's topology."""
    s, tr = spec.student, spec.training
    n = shard_group(tr.sharding, tr.world_size, tr.processes_per_node)
    q = s.quantization
    if q.load_in_4bit:
        absmax = 1 / NF4_BLOCK + 4 / (NF4_BLOCK * 256) if q.double_quant else 4 / NF4_BLOCK
        base_bytes = shape.linear_params * (0.5 + absmax) + shape.other_params * 2
        layer_bytes = (shape.linear_params / shape.layers) * (0.5 + absmax) + 4 * shape.hidden
    else:
        base_bytes = shape.params * 2
        layer_bytes = shape.layer_weight_params() * 2
    lora = shape.lora_params(s.lora.r, s.lora.target_modules)
    lora_layer = lora / shape.layers
    b, h, i = tr.micro_batch_size, shape.hidden, shape.intermediate
    kv, qd = shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim
    per_token_layer = 2 * (4 * h + qd + 2 * kv + qd + 4 * i) + 2 * s.lora.r * len(s.lora.target_modules)
    tokens = b * seq_len
    act_full = tokens * shape.layers * per_token_layer
    act_ckpt = tokens * shape.layers * 2 * h + tokens * per_token_layer
    logits = tokens * shape.vocab * 10
    parts = {
        "base_weights": base_bytes / n,
        "lora_weights": 2 * lora / n,
        "lora_gradients": 2 * lora / n,
        "optimizer_states": ADAM_K * lora / n,
        "allgather_buffer": 2 * (layer_bytes + 2 * lora_layer) if n > 1 else 0.0,
        "activations": act_full,
        "activations_checkpointed": act_ckpt,
        "logits": logits,
    }
    states = sum(v for k, v in parts.items() if not k.startswith("activations"))
    return {
        "shard_group": n,
        "world_size": tr.world_size,
        "sharding": tr.sharding,
        "weights": "nf4 4-bit" if q.load_in_4bit else "bf16",
        "params": shape.params,
        "quantized_params": shape.linear_params if q.load_in_4bit else 0,
        "lora_params": lora,
        "seq_len": seq_len,
        "micro_batch": b,
        "per_device_gb": {k: v / GB for k, v in parts.items()},
        "total_gb": (states + act_full) / GB,
        "total_checkpointed_gb": (states + act_ckpt) / GB,
        "zero_full_finetune_gb": zero_table(shape.params, tr.world_size, tr.processes_per_node),
    }


# --------------------------------------------------------------------------- data


def _tokenizer(model_dir: Path | None):
    if model_dir is None or not (Path(model_dir) / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tok.no_padding()  # a saved tokenizer may pad batches to a common length; we want true lengths
    tok.no_truncation()
    return tok


def _mean_tokens(tok, texts: list[str]) -> float:
    if not texts:
        return 0.0
    if tok is None:  # no tokenizer at hand (an API teacher): ~4 characters per token
        return sum(len(t) for t in texts) / len(texts) / 4
    return sum(len(e.ids) for e in tok.encode_batch(texts)) / len(texts)


def data_facts(spec: CampaignSpec, repo_root: Path, teacher_dir: Path | None, student_dir: Path | None) -> dict:
    """Prompt counts after the held-out split and mean prompt lengths in each model's tokens."""
    from campaign_orchestrator.dataset import prompts as P

    d = spec.data
    rows = P.read_prompts(P.source_files(d.source, repo_root),
                          P.SourceFields(d.id_field, d.prompt_field, d.reference_field, d.category_field))
    train, held = P.split(rows, d.heldout.fraction, d.heldout.seed, d.heldout.max_items)
    sample = [r["prompt"] for r in train[:TOKEN_SAMPLE]]
    held_sample = [r["prompt"] for r in held[:TOKEN_SAMPLE]]
    t_tok, s_tok = _tokenizer(teacher_dir), _tokenizer(student_dir)
    return {"train_prompts": len(train), "heldout_items": len(held),
            "prompt_tokens_teacher": _mean_tokens(t_tok, sample),
            "prompt_tokens_student": _mean_tokens(s_tok, sample),
            "heldout_prompt_tokens_student": _mean_tokens(s_tok, held_sample),
            "heldout_prompt_tokens_teacher": _mean_tokens(t_tok, held_sample),
            "tokenizer": "model tokenizer" if t_tok is not None else "~4 characters per token"}


# --------------------------------------------------------------------------- time and money


def _perf(entry: PriceEntry, key: str) -> float:
    try:
        return float(entry.perf[key])
    except KeyError:
        raise PlanError(f"pricing catalog entry {entry.key!r} has no perf.{key}; add it to plan stages on this "
                        "hardware") from None


def generation_seconds(params: int, weight_bytes: float, prompts: int, prompt_tokens: float, new_tokens: float,
                       batch_size: int, entry: PriceEntry, mfu: float) -> float:
    """Roofline time to answer ``prompts`` prompts on one device (see the module docstring)."""
    batches = math.ceil(prompts / batch_size) if prompts else 0
    flops = 2 * params * prompts * (prompt_tokens + new_tokens)
    compute = flops / (_perf(entry, "peak_tflops") * 1e12 * mfu)
    decode_steps = batches * new_tokens
    memory = decode_steps * weight_bytes / (_perf(entry, "memory_bandwidth_gbps") * 1e9)
    return max(compute, memory) + decode_steps * _perf(entry, "decode_step_overhead_s") + _perf(entry, "generate_startup_s")


def _hours_usd(entry: PriceEntry, seconds: float, hosts: int, devices: int, tier: str) -> tuple[float, float]:
    qty = seconds / 3600 * (hosts if entry.unit == "host-hour" else devices)
    return qty, qty * entry.hourly_usd(tier)


def plan_stages(spec: CampaignSpec, catalog: Catalog, facts: dict, teacher: ModelShape | None,
                student: ModelShape) -> dict[str, dict]:
    c, t, tr, pl = spec.cost, spec.teacher, spec.training, spec.cost.planner
    out: dict[str, dict] = {}

    # teacher_generations
    n_req = facts["train_prompts"] * t.sampling.n
    new_tok = t.sampling.max_new_tokens * pl.completion_fill
    p_tok, c_tok = n_req * facts["prompt_tokens_teacher"], n_req * new_tok
    entry = catalog.get(t.hardware)
    st: dict = {"requests": n_req, "prompt_tokens": p_tok, "completion_tokens": c_tok, "tokens": p_tok + c_tok,
                "price_key": entry.key, "unit": entry.unit}
    if entry.hourly:
        if teacher is None:
            raise PlanError(f"teacher {t.model!r} runs on {t.hardware} (hourly) but its config is not available to size it")
        seconds = generation_seconds(teacher.params, teacher.params * 2, n_req, facts["prompt_tokens_teacher"], new_tok,
                                     t.batch_size, entry, pl.generation_mfu)
        qty, usd = _hours_usd(entry, seconds, 1, 1, c.pricing_tier)
        st |= {"seconds": seconds, "quantity": qty, "usd": usd}
    else:
        in_usd, out_usd = entry.token_usd(c.teacher_batch_api)
        st |= {"seconds": None, "quantity": (p_tok + c_tok) / 1e6, "usd": p_tok / 1e6 * in_usd + c_tok / 1e6 * out_usd}
    out["teacher_generations"] = st

    # student_adapter
    rows = n_req  # every generation accepted: an upper bound before the filters run
    seq = min(tr.max_seq_len, facts["prompt_tokens_student"] + new_tok + 1)
    rows_per_step = tr.micro_batch_size * tr.world_size * tr.gradient_accumulation_steps
    steps = tr.max_steps if tr.max_steps is not None else max(1, math.ceil(tr.epochs * rows / rows_per_step))
    tokens = steps * rows_per_step * seq
    ckpt = bool(getattr(tr, "activation_checkpointing", False))
    flops = (6 if ckpt else 4) * student.params * tokens
    entry = catalog.get(tr.hardware)
    if not entry.hourly:
        raise PlanError(f"training.hardware {tr.hardware!r} is priced per {entry.unit}; training needs hourly hardware")
    seconds = (flops / (tr.world_size * _perf(entry, "peak_tflops") * 1e12 * pl.mfu)
               + steps * _perf(entry, "step_overhead_s") + _perf(entry, "train_startup_s"))
    qty, usd = _hours_usd(entry, seconds, tr.nodes, tr.world_size, c.pricing_tier)
    out["student_adapter"] = {"steps": steps, "sequences": steps * rows_per_step, "tokens": tokens, "flops": flops,
                              "seconds": seconds, "price_key": entry.key, "unit": entry.unit, "quantity": qty, "usd": usd}

    # evaluation: candidate and base (and a local teacher) answer every held-out item once per suite
    ev = spec.evaluation
    roles = [("candidate", student), ("base", student)]
    if ev.evaluate_teacher and t.backend == "transformers" and teacher is not None:
        roles.append(("teacher", teacher))
    seconds = 0.0
    for _role, shape in roles:
        for suite in ev.suites:
            seconds += generation_seconds(shape.params, shape.params * 2, facts["heldout_items"],
                                          facts["heldout_prompt_tokens_student"], suite.max_new_tokens * pl.completion_fill,
                                          suite.batch_size, entry, pl.generation_mfu)
    qty, usd = _hours_usd(entry, seconds, 1, 1, c.pricing_tier)
    out["evaluation"] = {"items": facts["heldout_items"], "models": [r for r, _ in roles], "seconds": seconds,
                         "price_key": entry.key, "unit": entry.unit, "quantity": qty, "usd": usd}
    return out


def plan_campaign(spec: CampaignSpec, catalog: Catalog, repo_root: Path, teacher_dir: Path | None,
                  student_dir: Path) -> dict:
    """The whole plan: data facts, per-device memory and fit, and per-stage estimates."""
    student = ModelShape.from_model_dir(student_dir)
    teacher = ModelShape.from_model_dir(teacher_dir) if teacher_dir is not None and (Path(teacher_dir) / "config.json").exists() else None
    facts = data_facts(spec, repo_root, teacher_dir, student_dir)
    pl = spec.cost.planner
    seq = int(min(spec.training.max_seq_len,
                  math.ceil(facts["prompt_tokens_student"] + spec.teacher.sampling.max_new_tokens * pl.completion_fill + 1)))
    mem = training_memory(student, spec, seq)
    device = catalog.get(spec.training.hardware)
    ckpt = bool(getattr(spec.training, "activation_checkpointing", False))
    if device.memory_gb is not None:
        usable = device.memory_gb * pl.memory_headroom
        mem |= {"device": device.key, "device_memory_gb": device.memory_gb, "usable_gb": usable,
                "activation_checkpointing": ckpt,
                "fits": (mem["total_checkpointed_gb"] if ckpt else mem["total_gb"]) <= usable,
                "fits_with_checkpointing": mem["total_checkpointed_gb"] <= usable}
    stages = plan_stages(spec, catalog, facts, teacher, student)
    total = sum(s["usd"] for s in stages.values())
    budget = spec.cost.budget_usd
    return {"campaign": spec.name, "catalog": catalog.path, "catalog_version": catalog.version,
            "pricing_tier": spec.cost.pricing_tier, "data": facts,
            "student": asdict(student), "teacher": asdict(teacher) if teacher else None,
            "memory": mem, "stages": stages, "total_usd": total, "budget_usd": budget,
            "within_budget": None if budget is None else total <= budget}


def render_plan(plan: dict) -> str:
    """Plain-text plan for `campaign plan`."""
    m, d = plan["memory"], plan["data"]
    gb = m["per_device_gb"]
    catalog = Path(plan["catalog"])
    if catalog.is_absolute() and catalog.is_relative_to(Path.cwd()):
        catalog = catalog.relative_to(Path.cwd())
    lines = [f"plan for campaign {plan['campaign']} (catalog {catalog} version {plan['catalog_version']}, "
             f"{plan['pricing_tier'].replace('_', '-')} prices)", "",
             f"data: {d['train_prompts']} training prompts, {d['heldout_items']} held-out items; mean prompt "
             f"{d['prompt_tokens_teacher']:.1f} teacher / {d['prompt_tokens_student']:.1f} student tokens ({d['tokenizer']})", "",
             f"student memory per device: {m['params']:,} parameters ({m['weights']}), LoRA {m['lora_params']:,} trainable; "
             f"world {m['world_size']}, sharding {m['sharding']} (states sharded over {m['shard_group']}); "
             f"micro-batch {m['micro_batch']} × {m['seq_len']} tokens"]
    rows = [("base weights", gb["base_weights"]), ("LoRA weights", gb["lora_weights"]),
            ("LoRA gradients", gb["lora_gradients"]), ("optimizer states (Adam, K=12)", gb["optimizer_states"]),
            ("FSDP all-gather buffer", gb["allgather_buffer"]), ("activations", gb["activations"]),
            ("activations, checkpointed", gb["activations_checkpointed"]), ("logits + loss", gb["logits"])]
    lines += [f"  {name:34s} {_gb(v)}" for name, v in rows]
    lines.append(f"  {'total (no checkpointing)':34s} {_gb(m['total_gb'])}")
    lines.append(f"  {'total (activation checkpointing)':34s} {_gb(m['total_checkpointed_gb'])}")
    if "device" in m:
        verdict = "fits" if m["fits"] else "does NOT fit"
        lines.append(f"  device {m['device']}: {m['device_memory_gb']:g} GB, {m['usable_gb']:.1f} GB usable → {verdict}"
                     + ("" if m["fits"] or not m["fits_with_checkpointing"] else " (fits with activation checkpointing)"))
    z = m["zero_full_finetune_gb"]
    lines += ["", f"full fine-tuning model states per device, for comparison (Ψ = {m['params']:,}, N = {m['world_size']}):",
              f"  ZeRO-0/DDP {_gb(z['zero0_ddp'])}  ZeRO-1 {_gb(z['zero1'])}  ZeRO-2 {_gb(z['zero2'])}  "
              f"ZeRO-3/FSDP {_gb(z['zero3_fsdp_full'])}  hybrid {_gb(z['fsdp_hybrid'])}", "",
              "estimated cost per stage:"]
    for name, s in plan["stages"].items():
        secs = "—" if s.get("seconds") is None else f"{s['seconds']:.0f} s"
        extra = (f"{s['tokens']:,.0f} teacher tokens" if name == "teacher_generations"
                 else f"{s['steps']} steps, {s['tokens']:,.0f} tokens" if name == "student_adapter"
                 else f"{s['items']} items × {len(s['models'])} models")
        lines.append(f"  {name:20s} {secs:>9s}  {s['quantity']:.6f} {s['unit']:14s} ${s['usd']:.6f}   ({extra}, {s['price_key']})")
    lines.append(f"  {'total':20s} {'':>9s}  {'':21s} ${plan['total_usd']:.6f}")
    if plan["budget_usd"] is not None:
        lines.append(f"budget ${plan['budget_usd']:.2f}: "
                     + ("within budget" if plan["within_budget"] else "the estimate EXCEEDS the budget"))
    return "\n".join(lines)


def _gb(x: float) -> str:
    return f"{x:10.6f} GB" if x < 0.01 else f"{x:10.3f} GB"


def stage_estimate(plan: dict, stage: str) -> float:
    try:
        return float(plan["stages"][stage]["usd"])
    except KeyError:
        raise PricingError(f"the plan has no stage {stage!r}") from None
