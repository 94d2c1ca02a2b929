"""Memory by policy: the micro-batch and the activation policy that fit a device, chosen before training.

``training.micro_batch_size: auto`` and ``training.activation_checkpointing: auto`` are resolved here, by the
planner (from the pricing catalog's ``memory_gb``) and by the trainer (from the device it sees), with the
same estimate (:func:`campaign_orchestrator.costs.memory.training_memory`), so the plan prices the step the
trainer runs.

The rule, fastest first:

* Activation policies in order of recomputation: ``none`` (keep everything), ``recompute`` (the exact
  SwiGLU / norm / input-cast recompute of training/recompute.py, a few percent of the step), ``full``
  (activation checkpointing: each layer's forward again in backward, 6N instead of 4N FLOPs per token).
* A micro-batch of ``target_tokens`` (enough tokens to keep the device busy: many more than 4 × 1024 on
  a large GPU) is the goal; a larger one gains nothing and only takes memory.
* Among the (policy, micro-batch) pairs whose estimated peak fits ``headroom`` × the device's memory, the
  one with the highest relative throughput ``min(1, tokens / target_tokens) / cost(policy)`` wins; ties
  go to less recomputation, then to the smaller micro-batch. A field that is set (not ``auto``) is kept.
* When nothing fits, even one row with full checkpointing, the smallest choice is returned with
  ``fits: false`` (the planner reports it; the trainer tries and says so).

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace

from campaign_orchestrator.costs.memory import ModelShape, training_memory

POLICIES = ("none", "recompute", "full")
# Relative step cost of each policy: full checkpointing reruns the forward (6N against 4N FLOPs per token with a
# frozen base); the exact recompute redoes elementwise work only (benchmarks/train_throughput.py measures it).
POLICY_COST = {"none": 1.0, "recompute": 1.03, "full": 1.5}
# Tokens per micro-step that keep the device busy (the 1.1B shape in benchmarks/train_gpu_step.py measures the
# GPU's curve); on a CPU small steps already saturate the cores.
TARGET_TOKENS = {"cuda": 16384, "cpu": 2048}
DEFAULT_HEADROOM = 0.9  # as cost.planner.memory_headroom
MAX_MICRO_BATCH = 256


@dataclass(frozen=True)
class MemoryPolicy:
    """What the policy chose and why: the micro-batch, the activation policy, the estimated peak against the
    usable memory, and which of the two were chosen here (``auto``) rather than set."""

    micro_batch_size: int
    activation_policy: str
    estimated_peak_gb: float
    usable_gb: float
    device_memory_gb: float
    fits: bool
    seq_len: int
    target_tokens: int
    chosen: tuple[str, ...]

    @property
    def activation_checkpointing(self) -> bool:
        return self.activation_policy == "full"

    @property
    def recompute_cheap(self) -> bool:
        return self.activation_policy == "recompute"

    def as_dict(self) -> dict:
        return asdict(self) | {"chosen": list(self.chosen)}


def activation_policy_of(value: bool | str, recompute_cheap: bool = True) -> str | None:
    """``training.activation_checkpointing`` as a policy name (``None`` for ``auto``): true is ``full``,
    false is ``recompute`` (``none`` where the exact recompute is turned off)."""
    if value == "auto":
        return None
    if value is True:
        return "full"
    if value is False:
        return "recompute" if recompute_cheap else "none"
    if value not in POLICIES:
        raise ValueError(
            f"training.activation_checkpointing: expected auto, none, recompute, full, true or false, got {value!r}"
        )
    return value


def choose_memory_policy(
    shape: ModelShape,
    student,
    training,
    *,
    device_memory_gb: float,
    seq_len: int,
    device_type: str = "cuda",
    compute_dtype: str = "bfloat16",
    headroom: float = DEFAULT_HEADROOM,
    attention: str = "sdpa",
    runtime_gb: float = 0.0,
    heap_retention: float = 0.0,
    target_tokens: int | None = None,
    recompute_cheap: bool = True,
) -> MemoryPolicy:
    """The micro-batch and activation policy for ``student`` (a StudentSpec: LoRA or QLoRA, rank, targets) and
    ``training`` (a TrainingSpec: world, sharding, reshard_after_forward, and the two fields, each a value or
    ``auto``) on a device of ``device_memory_gb`` at rows of ``seq_len`` tokens. ``recompute_cheap`` False: the
    exact recompute is unavailable (e.g. under torch.compile), so ``auto`` chooses between none and full."""
    target = target_tokens or TARGET_TOKENS.get(device_type, TARGET_TOKENS["cuda"])
    usable = device_memory_gb * headroom
    fixed_policy = activation_policy_of(training.activation_checkpointing, recompute_cheap)
    policies = [fixed_policy] if fixed_policy else [p for p in POLICIES if recompute_cheap or p != "recompute"]
    if training.micro_batch_size == "auto":
        top = max(1, min(MAX_MICRO_BATCH, -(-target // max(1, seq_len))))
        micros = sorted({m for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if m < top} | {top})
    else:
        micros = [int(training.micro_batch_size)]
    spec = SimpleNamespace(student=student, training=training)

    def peak(m: int, policy: str) -> float:
        mem = training_memory(shape, spec, seq_len, compute_dtype, runtime_gb, attention, heap_retention, micro_batch=m)
        return mem["total_by_policy_gb"][policy]

    best = None  # (score, -policy index, -micro), policy, micro, peak
    for policy in policies:
        for m in micros:
            gb = peak(m, policy)
            if gb > usable:
                break  # larger micro-batches need more
            key = (min(1.0, m * seq_len / target) / POLICY_COST[policy], -POLICIES.index(policy), -m)
            if best is None or key > best[0]:
                best = (key, policy, m, gb)
    chosen = tuple(
        f
        for f, auto in (
            ("micro_batch_size", training.micro_batch_size == "auto"),
            ("activation_checkpointing", fixed_policy is None),
        )
        if auto
    )
    if best is None:  # nothing fits: the leanest choice, flagged
        policy, m = policies[-1], micros[0]
        return MemoryPolicy(m, policy, peak(m, policy), usable, device_memory_gb, False, seq_len, target, chosen)
    _, policy, m, gb = best
    return MemoryPolicy(m, policy, gb, usable, device_memory_gb, True, seq_len, target, chosen)


def resolved_training(training, policy: MemoryPolicy):
    """``training`` (a TrainingSpec) with ``auto`` micro-batch and activation policy replaced by the chosen ones
    (``activation_checkpointing`` becomes the policy's name: none, recompute or full)."""
    update = {}
    if "micro_batch_size" in policy.chosen:
        update["micro_batch_size"] = policy.micro_batch_size
    if "activation_checkpointing" in policy.chosen:
        update["activation_checkpointing"] = policy.activation_policy
    return training.model_copy(update=update) if update else training


def plan_memory_policy(
    spec,
    shape: ModelShape,
    *,
    device_memory_gb: float | None,
    seq_len: int,
    device_type: str,
    compute_dtype: str,
    headroom: float,
    attention: str,
    runtime_gb: float = 0.0,
    heap_retention: float = 0.0,
):
    """The planner's call: ``(spec, policy)`` with the campaign's ``auto`` fields resolved for its training
    hardware (``policy`` None where nothing is ``auto``). A device of unknown memory cannot size ``auto``."""
    tr = spec.training
    if tr.micro_batch_size != "auto" and tr.activation_checkpointing != "auto":
        return spec, None
    if device_memory_gb is None:
        from campaign_orchestrator.costs.memory import PlanError

        raise PlanError(
            f"training.micro_batch_size / activation_checkpointing 'auto' size the step from the device's "
            f"memory, but the pricing catalog's {tr.hardware!r} has no memory_gb: add it, or set both "
            "fields to values"
        )
    policy = choose_memory_policy(
        shape,
        spec.student,
        tr,
        device_memory_gb=device_memory_gb,
        seq_len=seq_len,
        device_type=device_type,
        compute_dtype=compute_dtype,
        headroom=headroom,
        attention=attention,
        runtime_gb=runtime_gb,
        heap_retention=heap_retention,
    )
    return spec.model_copy(update={"training": resolved_training(tr, policy)}), policy
