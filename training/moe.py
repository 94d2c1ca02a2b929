"""Mixture-of-experts students in the trainer: LoRA on the routed experts, never silently frozen.

A MoE checkpoint (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS in transformers 5) stores each layer's routed
experts as *fused 3-D parameters* (``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` and
``mlp.experts.down_proj`` ``(E, H, I)`` on Qwen3-MoE), which ``target_modules`` cannot reach: LoRA on
them goes through PEFT's ``target_parameters`` (a ``lora.ParamWrapper``; ``lora_A`` ``(r·E, in)``,
``lora_B`` ``(out, r·E)``: every expert has its own rank-r pair). The router is ``mlp.gate``.

* :func:`lora_kwargs` turns ``student.lora`` / ``student.moe`` into ``LoraConfig`` arguments: the
  expert tensors, the per-expert rank rule (``rank_pattern``), the router as a ``modules_to_save``.
* :func:`check_targets` refuses, before PEFT runs, a target that matches nothing (PEFT would skip it
  or, for ``gate``, turn it into a parameter target silently).
* :func:`parameter_breakdown` counts parameters and trainable parameters by kind (attention, dense
  MLP, routed experts, router, other) and :func:`refuse_frozen_experts` stops a run whose routed
  experts get no trainable parameter unless ``student.moe.experts: frozen`` says so.
* :class:`MoeMonitor` hooks every router. During each training forward it records the router logits
  and the chosen experts; the trainer adds the load-balancing loss of each micro-batch (Hugging
  Face's Switch formula over its real tokens) weighted by the micro-batch's share of the step's real
  tokens across ranks and accumulation, so the step's auxiliary term is the token-weighted mean of
  the micro-batch losses and does not depend on how micro-batches are spread over ranks. It counts
  the tokens routed to each expert (padding excluded), warns when routing collapses, checks the
  expert LoRA gradients after the first steps (``lora_B`` at the first: ``lora_A``'s is exactly 0
  while B is 0; ``lora_A`` at the second) and every expert's ``lora_B`` after training.

Raises ``TrainingError`` with the fields to set.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
from torch import nn

from campaigns.spec import StudentSpec
from training.errors import TrainingError

MASK = "router_token_mask"  # batch key: 1 for the real tokens the routers see, 0 for padding
BATCH_KEYS = frozenset({MASK})
CATEGORIES = ("attention", "dense_mlp", "routed_experts", "router", "other")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
ROUTER_NAMES = ("gate", "mlp.gate", "router", "mlp.router")
MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# PEFT 0.21 on transformers 5 (peft/utils/transformers_weight_conversion.py, for adapters trained on transformers 4)
# rewrites these target_modules of a Qwen2/Qwen3-MoE or Mixtral model into target_parameters on the fused experts.
MLP_NAMES_REFUSED = (
    "PEFT (on transformers 5) rewrites MLP projection names of a mixture of experts into targets on "
    "the fused expert tensors (gate_up_proj at rank 2r), so a dense MLP layer would get no LoRA and the "
    "experts a rank you did not ask for; an all-sparse model has no such module at all."
)


# --------------------------------------------------------------------------- architecture


@dataclass(frozen=True)
class MoeArch:
    """What the trainer needs to know about a MoE config (``num_experts == 0``: a dense model)."""

    num_experts: int
    top_k: int

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def arch_of(config) -> MoeArch:
    experts = next((int(getattr(config, k)) for k in EXPERT_COUNT_KEYS if getattr(config, k, None)), 0)
    return MoeArch(num_experts=experts, top_k=int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0)


def category(name: str) -> str:
    """The kind of a parameter by its (PEFT-wrapped or plain) name."""
    n = f".{name}."
    if ".experts." in n and ".shared_expert" not in n:
        return "routed_experts"
    if ".mlp.gate." in n or ".mlp.router." in n:
        return "router"
    if ".self_attn." in n or ".attention." in n:
        return "attention"
    if ".mlp." in n or ".feed_forward." in n:
        return "dense_mlp"  # the MLP of a dense layer, and shared experts
    return "other"


def expert_rank(student: StudentSpec, arch: MoeArch) -> int:
    """Each routed expert's LoRA rank under ``student.moe.expert_rank``; refuses a rank below 1."""
    r = student.lora.r
    if student.moe.expert_rank == "full" or not arch.is_moe:
        return r
    per = r // arch.num_experts
    if per < 1:
        raise ValueError(
            f"student.moe.expert_rank 'divided' gives each of the {arch.num_experts} experts rank "
            f"student.lora.r // num_experts = {r} // {arch.num_experts} = {per}, and a LoRA rank must be at least 1: "
            f"raise student.lora.r to at least {arch.num_experts}, or use expert_rank: full (rank {r} per expert)"
        )
    return per


def lora_kwargs(student: StudentSpec, config) -> dict[str, Any]:
    """``LoraConfig`` keyword arguments for ``student`` on a model with ``config``."""
    lora, arch = student.lora, arch_of(config)
    kw: dict[str, Any] = dict(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        use_dora=lora.use_dora,
        task_type="CAUSAL_LM",
    )
    if lora.target_parameters:
        kw["target_parameters"] = list(lora.target_parameters)
        rank = expert_rank(student, arch)
        if rank != lora.r:
            # PEFT matches a pattern against "model.layers.N.mlp.experts.<param>"; the expert scaling stays alpha / r.
            keys = [re.escape(t) for t in lora.target_parameters]
            kw["rank_pattern"] = {k: rank for k in keys}
            kw["alpha_pattern"] = {k: lora.alpha * rank / lora.r for k in keys}
    if arch.is_moe and student.moe.router == "trained":
        kw["modules_to_save"] = ["mlp.gate"]
    return kw


def check_targets(model: nn.Module, student: StudentSpec, where: str) -> None:
    """Refuse targets that match nothing in the base model (before PEFT, with the base's own names)."""
    lora, arch = student.lora, arch_of(model.config)
    modules = [n for n, _ in model.named_modules()]
    missing = [t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in modules)]
    if arch.is_moe:
        router = [t for t in lora.target_modules if t in ROUTER_NAMES]
        if router:
            raise ValueError(
                f"student.lora.target_modules {router} names the router of the MoE model {where} (not an nn.Linear: "
                f"PEFT would silently turn it into a parameter target); set student.moe.router: trained to train it"
            )
        mlp = [t for t in lora.target_modules if t.rsplit(".", 1)[-1] in MLP_NAMES]
        if mlp:
            raise ValueError(
                f"student.lora.target_modules {mlp} on the MoE model {where}: {MLP_NAMES_REFUSED} Target the routed "
                f"experts with student.lora.target_parameters "
                f"({', '.join(expert_parameter_names(model)) or 'mlp.experts.gate_up_proj, mlp.experts.down_proj'})"
            )
    if missing:
        raise ValueError(f"student.lora.target_modules {missing} match no module of {where}")
    params = [n for n, _ in model.named_parameters()]
    missing = [t for t in lora.target_parameters if not any(n == t or n.endswith("." + t) for n in params)]
    if missing:
        found = expert_parameter_names(model)
        raise ValueError(
            f"student.lora.target_parameters {missing} match no parameter of {where}"
            + (f"; its routed-expert parameters are {found}" if found else " (it has no fused expert parameters)")
        )


def check_peft_kept_targets(model: nn.Module, student: StudentSpec, where: str) -> None:
    """After ``get_peft_model``: refuse a configuration PEFT rewrote (its transformers-4 compatibility mapping
    moves MoE target names to other tensors with other ranks) instead of training something else silently."""
    cfg = model.peft_config["default"]
    asked_m, asked_p = set(student.lora.target_modules), set(student.lora.target_parameters)
    got_m, got_p = set(cfg.target_modules or ()), set(cfg.target_parameters or ())
    if (got_m, got_p) != (asked_m, asked_p):
        raise ValueError(
            f"PEFT rewrote the LoRA targets for {where} ({getattr(model.config, 'model_type', '?')}): asked "
            f"target_modules {sorted(asked_m)} and target_parameters {sorted(asked_p)}, it would train target_modules "
            f"{sorted(got_m)} and target_parameters {sorted(got_p)} (rank_pattern {dict(cfg.rank_pattern or {})}); "
            f"set student.lora so that nothing is rewritten (routed experts: target_parameters; the router: "
            f"student.moe.router)"
        )


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The distinct routed-expert parameter suffixes of a base model, e.g. ``mlp.experts.gate_up_proj``."""
    out = []
    for n, _ in model.named_parameters():
        m = re.search(r"(?:^|\.)(\w+\.experts\.\w+)$", n)
        if m and category(n) == "routed_experts" and m.group(1) not in out:
            out.append(m.group(1))
    return out


# --------------------------------------------------------------------------- what is trainable


def _numel(p: torch.Tensor) -> int:
    qs = getattr(p, "quant_state", None)  # a packed 4-bit weight: count the weight it stands for
    return int(prod(qs.shape)) if qs is not None and getattr(qs, "shape", None) is not None else p.numel()


def parameter_breakdown(model: nn.Module) -> dict[str, Any]:
    """Parameters and trainable parameters by kind, and which kinds are stored 4-bit (unsharded model)."""
    total = dict.fromkeys(CATEGORIES, 0)
    trainable = dict.fromkeys(CATEGORIES, 0)
    quantized = dict.fromkeys(CATEGORIES, 0)
    for n, p in model.named_parameters():
        c = category(n)
        k = _numel(p)
        if p.requires_grad:
            trainable[c] += k  # adapters and modules_to_save copies
        if not re.search(r"\.(lora_[A-Za-z_]+|modules_to_save)\.", n):
            total[c] += k  # the base model's own parameters (the original of a modules_to_save copy)
            quantized[c] += k if getattr(p, "quant_state", None) is not None else 0
    arch = arch_of(getattr(model, "config", None))
    return {
        "num_experts": arch.num_experts,
        "num_experts_per_tok": arch.top_k,
        "parameters": total,
        "trainable": trainable,
        "experts_quantized": quantized["routed_experts"] > 0,
        "quantized_parameters": {c: v for c, v in quantized.items() if v},
    }


def refuse_frozen_experts(breakdown: dict[str, Any], student: StudentSpec, where: str) -> None:
    """A model with routed experts and no trainable expert parameter does not train (unless on purpose)."""
    experts = breakdown["parameters"]["routed_experts"]
    if not experts or breakdown["trainable"]["routed_experts"] or student.moe.experts == "frozen":
        return
    raise TrainingError(
        f"{where} has {breakdown['num_experts']} routed experts per MoE layer ({experts:,} parameters) and none of "
        f"them would be trained: student.lora.target_modules {list(student.lora.target_modules)} reach only nn.Linear "
        "layers (attention, dense MLPs), not the fused expert tensors. Set student.lora.target_parameters (e.g. "
        "[mlp.experts.gate_up_proj, mlp.experts.down_proj]) to train them, or student.moe.experts: frozen to train "
        "without them on purpose"
    )


# --------------------------------------------------------------------------- batches


def token_mask(batch: dict[str, torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """1 for every real token of a collated batch, 0 for padding (rows laid end to end: all real)."""
    b, t = batch["input_ids"].shape
    if b == 1 and sum(lengths) == t:
        return torch.ones(1, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    for j, n in enumerate(lengths):
        mask[j, :n] = 1
    return mask


# --------------------------------------------------------------------------- the monitor


def _load_balancing_fn(model: nn.Module):
    """Hugging Face's load-balancing loss of the model's own architecture (its modeling module)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for cls in type(base).__mro__:
        fn = getattr(importlib.import_module(cls.__module__), "load_balancing_loss_func", None)
        if fn is not None:
            return fn
    raise TrainingError(
        f"{type(base).__name__} has no load_balancing_loss_func in its modeling module; set "
        "student.moe.aux_loss_coef: 0"
    )


def _per_expert_abs(t: torch.Tensor, num_experts: int, kind: str) -> torch.Tensor:
    """|t| summed per expert for a ParamWrapper's lora_A ``(r·E, in)`` (rows grouped by expert) or lora_B
    ``(out, r·E)`` (columns interleaved, expert fastest); collective for a sharded tensor."""
    from training.sharded import full_tensor

    if kind == "A":
        return full_tensor(t.abs().sum(dim=1)).reshape(num_experts, -1).sum(1)
    return full_tensor(t.abs().sum(dim=0)).reshape(-1, num_experts).sum(0)


@dataclass
class _ExpertLora:
    name: str  # the trainable parameter's name
    param: nn.Parameter
    layer: int
    tensor: str  # the expert parameter it adapts (gate_up_proj, down_proj)
    kind: str  # "A" or "B"
    num_experts: int


@dataclass
class MoeMonitor:
    """Routers' hooks and the MoE checks of one training run (see the module docstring)."""

    student: StudentSpec
    arch: MoeArch
    routers: list[nn.Module]
    expert_loras: list[_ExpertLora]
    breakdown: dict[str, Any]
    log: Any
    world: int
    aux_fn: Any = None
    counts: torch.Tensor = field(init=False)
    window: torch.Tensor = field(init=False)
    active: bool = False
    captured: list = field(default_factory=list)
    grad_checks: list[dict] = field(default_factory=list)
    collapse_warnings: list[str] = field(default_factory=list)
    _handles: list = field(default_factory=list)
    _window_start: int = 0
    _checked_steps: int = 0

    def __post_init__(self):
        self.counts = torch.zeros(len(self.routers), self.arch.num_experts, dtype=torch.float64)
        self.window = torch.zeros_like(self.counts)

    @classmethod
    def attach(
        cls,
        model: nn.Module,
        student: StudentSpec,
        breakdown: dict[str, Any],
        log,
        world: int,
        compute_dtype: torch.dtype,
    ) -> MoeMonitor | None:
        """Hook the routers of a (PEFT-wrapped, possibly sharded) MoE model; ``None`` for a dense model."""
        arch = arch_of(model.config)
        if not arch.is_moe:
            return None
        routers = [m for n, m in model.named_modules() if re.search(r"\.mlp\.(gate|router)$", n)]
        if not routers:
            raise TrainingError("the MoE model has no router modules named mlp.gate or mlp.router to monitor")
        wrappers = {
            n: m for n, m in model.named_modules() if hasattr(m, "parameter_name") and hasattr(m, "num_experts")
        }
        loras = []
        for n, p in model.named_parameters():
            m = re.search(r"^(.*)\.lora_([AB])\.[^.]+\.weight$", n)
            if p.requires_grad and m and m.group(1) in wrappers and category(n) == "routed_experts":
                w = wrappers[m.group(1)]
                layer = re.search(r"\.layers\.(\d+)\.", n)
                loras.append(
                    _ExpertLora(
                        n, p, int(layer.group(1)) if layer else -1, w.parameter_name, m.group(2), int(w.num_experts)
                    )
                )
        coef = student.moe.aux_loss_coef
        mon = cls(
            student, arch, routers, loras, breakdown, log, world, aux_fn=_load_balancing_fn(model) if coef > 0 else None
        )
        for i, r in enumerate(routers):
            mon._handles.append(r.register_forward_hook(mon._hook(i)))
        t = breakdown["trainable"]
        log(
            f"MoE student: {arch.num_experts} routed experts, top-{arch.top_k}, {len(routers)} MoE layers; trainable "
            + ", ".join(f"{c.replace('_', ' ')} {t[c]:,}" for c in CATEGORIES if c != "other" or t[c])
            + f"; router {student.moe.router}; load-balancing loss coefficient {coef:g}"
            + (
                "; fused expert tensors in full precision (4-bit quantizes nn.Linear only)"
                if breakdown["quantized_parameters"] and not breakdown["experts_quantized"]
                else ""
            )
        )
        if loras and compute_dtype in (torch.bfloat16, torch.float16):
            log(
                f"WARNING: expert LoRA is folded into the {str(compute_dtype).removeprefix('torch.')} expert weights "
                "at every forward (PEFT's ParamWrapper), which rounds small early updates; "
                "quantization.compute_dtype float32 avoids it"
            )
        return mon

    def _hook(self, layer: int):
        def hook(_module, _inputs, out):
            if self.active:
                logits = out[0] if isinstance(out, tuple) else out
                idx = (
                    out[2]
                    if isinstance(out, tuple) and len(out) >= 3
                    else torch.topk(logits.softmax(-1), self.arch.top_k, dim=-1).indices
                )
                self.captured.append((layer, logits, idx))

        return hook

    # ------------------------------------------------------------------ one micro-batch
    def begin(self) -> None:
        """The next forward is a training forward: record what every router does."""
        self.captured = []
        self.active = True

    def end(self, mask: torch.Tensor, step_real_tokens: int) -> tuple[torch.Tensor | None, float]:
        """Stop recording; count the routed real tokens; return the micro-batch's auxiliary loss term
        (``coef · aux · n / N``, ``None`` when off) and ``aux · n`` (for the step's reported mean)."""
        self.active = False
        got, self.captured = self.captured, []
        if len(got) != len(self.routers):
            raise TrainingError(f"expected one router output per MoE layer ({len(self.routers)}), recorded {len(got)}")
        flat = mask.reshape(-1)
        weights = flat.to(torch.float64).repeat_interleave(self.arch.top_k)
        for layer, _logits, idx in got:
            c = torch.zeros(self.arch.num_experts, dtype=torch.float64).scatter_add_(
                0, idx.reshape(-1).cpu(), weights.cpu()
            )
            self.counts[layer] += c
            self.window[layer] += c
        if self.aux_fn is None:
            return None, 0.0
        aux = self.aux_fn(
            tuple(lg for _, lg, _ in got), self.arch.num_experts, self.arch.top_k, mask.to(got[0][1].device)
        )
        n = int(flat.sum())
        term = aux * (self.student.moe.aux_loss_coef * n / step_real_tokens) if step_real_tokens else aux * 0.0
        return term, float(aux.detach()) * n

    # ------------------------------------------------------------------ checks
    def check_gradients(self) -> None:
        """Call once per trained step, after its backward (collective). At the first step of the run the
        expert lora_B gradients, at the second lora_A's: all zero means the adapter is not in the forward path."""
        trained_before, self._checked_steps = self._checked_steps, self._checked_steps + 1
        if trained_before >= 2 or not self.expert_loras:
            return
        kind = "B" if trained_before == 0 else "A"
        per_expert = [
            _per_expert_abs(x.param.grad, x.num_experts, x.kind)
            if x.param.grad is not None
            else torch.zeros(x.num_experts)
            for x in self.expert_loras
            if x.kind == kind
        ]
        nonzero = sum(int((v > 0).sum()) for v in per_expert)
        total = sum(len(v) for v in per_expert)
        self.grad_checks.append(
            {"step": trained_before + 1, "lora": kind, "expert_slices_nonzero": nonzero, "expert_slices": total}
        )
        if nonzero == 0:
            raise TrainingError(
                f"step {trained_before + 1}: every routed expert's lora_{kind} gradient is exactly zero "
                f"({total} expert slices): the expert LoRA gets no gradient, so training would leave the experts "
                f"unchanged. Check student.lora.target_parameters against the model, or set student.moe.experts: frozen"
            )
        self.log(
            f"expert LoRA gradients at step {trained_before + 1}: lora_{kind} non-zero for {nonzero} of {total} "
            "(layer, tensor, expert) slices"
        )

    def log_routing(self, step: int, force: bool = False, every: int = 1) -> None:
        """Collective at the same steps on every rank: warn when a layer's routing collapsed since the last look."""
        if not force and step % every:
            return
        window = self.window.clone()
        _all_reduce(window, self.world)
        self.window.zero_()
        k, e = self.arch.top_k, self.arch.num_experts
        for layer in range(window.shape[0]):
            tot = float(window[layer].sum())
            if not tot:
                continue
            busiest = torch.topk(window[layer], min(k, e)).values.sum().item() / tot
            if busiest >= self.student.moe.collapse_share and k < e:
                top = torch.topk(window[layer], min(k, e)).indices.tolist()
                msg = (
                    f"routing collapse in MoE layer {layer}, steps {self._window_start + 1}-{step}: experts {top} took "
                    f"{busiest:.0%} of the routed tokens (uniform routing: {k / e:.0%}; warning at "
                    f"student.moe.collapse_share {self.student.moe.collapse_share:.0%})"
                )
                self.collapse_warnings.append(msg)
                self.log(f"WARNING: {msg}")
        self._window_start = step

    def state(self) -> dict[str, Any]:
        """Collective: what a checkpoint keeps (the tokens routed to each expert so far, all ranks)."""
        counts = self.counts.clone()
        _all_reduce(counts, self.world)
        return {"routed_tokens": counts.tolist(), "collapse_warnings": list(self.collapse_warnings)}

    def load_state(self, state: dict[str, Any] | None, is_main: bool) -> None:
        """Continue a resumed run's counts (held by global rank 0, so the final all-reduce sums them once)."""
        if state and is_main and torch.tensor(state["routed_tokens"]).shape == self.counts.shape:
            self.counts += torch.tensor(state["routed_tokens"], dtype=torch.float64)
        if state:
            self.collapse_warnings = list(state.get("collapse_warnings", []))

    def final_report(self) -> dict[str, Any]:
        """Collective: tokens routed to each expert over training, and every expert's lora_B after it."""
        counts = self.counts.clone()
        _all_reduce(counts, self.world)
        untrained = []
        b_nonzero = b_total = 0
        for x in self.expert_loras:
            if x.kind != "B":
                continue
            v = _per_expert_abs(x.param.detach(), x.num_experts, "B")
            b_total += len(v)
            b_nonzero += int((v > 0).sum())
            untrained += [f"layer {x.layer} {x.tensor} expert {e}" for e in range(len(v)) if v[e] == 0]
        if untrained:
            self.log(
                f"WARNING: {len(untrained)} routed-expert LoRA slices are still zero after training (no token was "
                f"routed to them): {untrained[:8]}"
            )
        per_layer = {f"layer_{i}": [int(c) for c in row] for i, row in enumerate(counts.tolist())}
        return {
            "num_experts": self.arch.num_experts,
            "num_experts_per_tok": self.arch.top_k,
            "moe_layers": len(self.routers),
            "parameters_by_kind": self.breakdown["parameters"],
            "trainable_by_kind": self.breakdown["trainable"],
            "routed_experts_trained": self.breakdown["trainable"]["routed_experts"] > 0,
            "experts_frozen_on_purpose": self.student.moe.experts == "frozen",
            "experts_quantized": self.breakdown["experts_quantized"],
            "expert_rank": expert_rank(self.student, self.arch) if self.expert_loras else None,
            "router": self.student.moe.router,
            "aux_loss_coef": self.student.moe.aux_loss_coef,
            "routed_tokens_per_expert": per_layer,
            "expert_lora_b_nonzero": b_nonzero,
            "expert_lora_b_slices": b_total,
            "experts_untrained": untrained,
            "expert_grad_checks": self.grad_checks,
            "routing_collapse_warnings": self.collapse_warnings,
        }


def _all_reduce(t: torch.Tensor, world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
