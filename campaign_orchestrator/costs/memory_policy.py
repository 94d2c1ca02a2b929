"""Memory by policy: the micro-batch and the activation policy that fit a device, chosen before training.

``training.micro_batch_size: auto`` and ``training.activation_checkpointing: auto`` are resolved here. One function,
:func:`resolve_training_policy`, gives what a training process will run (micro-batch, activation policy, compile,
compute dtype, the attention the estimate assumes), called with the same inputs by the planner (``campaign plan``:
the device from the pricing catalog's entry) and by the trainer (the device it sees), so the plan prices the step
the trainer runs and the trainer's summary reports it. Its inputs, the same on both sides:

* the device (:class:`DeviceFacts`): its kind, its memory, and what the catalog says the training process itself
  takes there (``perf.runtime_gb``; on a CPU the C heap's retention, ``perf.heap_retention`` or
  ``heap_retention_jemalloc`` by the allocator the process runs on), carried to the trainer in its job
  (:func:`policy_terms`);
* the headroom (``cost.planner.memory_headroom``, also carried in the job);
* rows of ``training.max_seq_len`` tokens: the longest row the trainer may get (the peak is that of the longest
  micro-batch), known before any data is tokenized;
* ``training.compile`` resolved for the device kind: under torch.compile the exact cheap recompute is the compiler's
  partitioner's job, so ``auto`` chooses between none and full, and a set ``recompute`` runs as ``none``;
* the compute dtype each side resolves for the device (the same rule: ``campaign_orchestrator.hardware``).

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

from dataclasses import asdict, dataclass, field
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


def resolved_spec(spec, policy):
    """``spec`` (a CampaignSpec) with its ``auto`` micro-batch and activation policy as ``policy`` (a
    :class:`TrainingPolicy`, or its ``as_dict`` from a plan) resolved them; as it is when ``policy`` is None or
    chose nothing (what reads the effective batch, e.g. the recipe checks, needs numbers)."""
    if policy is None:
        return spec
    p = policy if isinstance(policy, dict) else policy.as_dict()
    update = {}
    if spec.training.micro_batch_size == "auto":
        update["micro_batch_size"] = int(p["micro_batch_size"])
    if spec.training.activation_checkpointing == "auto":
        update["activation_checkpointing"] = p["activation_policy"]
    if not update:
        return spec
    return spec.model_copy(update={"training": spec.training.model_copy(update=update)})


def plan_memory_policy(spec, shape: ModelShape, device: DeviceFacts, *, compute_dtype: str, headroom: float):
    """The planner's call: ``(spec, policy)``, the campaign with its ``auto`` fields resolved for its training
    hardware (``device``, from the catalog's entry) and what the trainer will run there
    (:func:`resolve_training_policy`, as the trainer calls it)."""
    policy = resolve_training_policy(
        shape, spec.student, spec.training, device, compute_dtype=compute_dtype, headroom=headroom
    )
    if policy.memory is None:
        return spec, policy
    return spec.model_copy(update={"training": resolved_training(spec.training, policy.memory)}), policy


@dataclass(frozen=True)
class DeviceFacts:
    """The device a training process runs on, as the policy needs it: ``type`` (``cuda`` or ``cpu``), its memory in
    decimal GB (None: unknown), the process's own memory there (``runtime_gb``) and the share of activations and
    logits the C heap keeps resident (``heap_retention``: CPU hosts, by allocator)."""

    type: str
    memory_gb: float | None
    runtime_gb: float = 0.0
    heap_retention: float = 0.0


def policy_terms(spec, catalog) -> dict:
    """What the policy adds to the device it runs on, from the campaign and its pricing catalog, JSON-able (the
    trainer gets it in its job): ``headroom`` (``cost.planner.memory_headroom``) and per device kind (``cuda``,
    ``cpu``) the catalog's ``runtime_gb``, ``heap_retention`` and ``heap_retention_jemalloc`` of the entry the run
    is billed at there (``training.hardware``; on the CPU of a GPU campaign, ``training.cpu_hardware``)."""
    tr = spec.training
    out: dict = {"headroom": float(spec.cost.planner.memory_headroom)}
    entries = [catalog.get(tr.hardware)] if tr.hardware else []
    if tr.cpu_hardware:
        entries.append(catalog.get(tr.cpu_hardware))
    for entry in entries:
        kind = device_type_of(entry)
        if kind in out:
            continue
        perf = entry.perf
        out[kind] = {
            "runtime_gb": float(perf.get("runtime_gb", 0.0)),
            "heap_retention": float(perf.get("heap_retention", 0.0)),
            "heap_retention_jemalloc": float(perf.get("heap_retention_jemalloc", perf.get("heap_retention", 0.0))),
        }
    return out


def device_type_of(entry) -> str:
    """The device kind a catalog entry names: a GPU (billed per gpu-hour) is ``cuda``, a host ``cpu``."""
    return "cuda" if entry.unit == "gpu-hour" else "cpu"


def device_facts(
    terms: dict | None, device_type: str, memory_gb: float | None, allocator: str = "glibc"
) -> DeviceFacts:
    """:class:`DeviceFacts` of a ``device_type`` device of ``memory_gb`` with the :func:`policy_terms` for its kind
    (none: the process's own memory is not counted), the heap retention of ``allocator`` (``jemalloc`` or other)."""
    t = (terms or {}).get(device_type) or {}
    retention = t.get("heap_retention_jemalloc" if allocator == "jemalloc" else "heap_retention", 0.0)
    return DeviceFacts(device_type, memory_gb, float(t.get("runtime_gb", 0.0)), float(retention))


def memory_attention(student, device_type: str, max_seq_len: int) -> str:
    """The attention the memory estimate assumes: a set kernel as set; ``auto`` as the trainer resolves it before it
    can measure (training.model.attention_kernel: eager on a CPU up to 512 tokens, else sdpa)."""
    a = student.attn_implementation
    if a != "auto":
        return a
    return "eager" if device_type == "cpu" and max_seq_len <= 512 else "sdpa"


@dataclass(frozen=True)
class TrainingPolicy:
    """What a training process runs: the micro-batch, the activation policy (``none``, ``recompute``, ``full``),
    whether its layers are compiled, the compute dtype, the attention and row length the memory estimate assumed,
    and the memory policy's choice where a field was ``auto`` (``memory``; None: both were set)."""

    micro_batch_size: int
    activation_policy: str
    compile: bool
    compute_dtype: str
    attention: str
    seq_len: int
    device: DeviceFacts
    headroom: float
    memory: MemoryPolicy | None = None
    chosen: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return asdict(self) | {
            "memory": None if self.memory is None else self.memory.as_dict(),
            "chosen": list(self.chosen),
        }

    def describe(self) -> str:
        return describe_policy(self.as_dict())


def describe_policy(p: dict) -> str:
    """One line of a :class:`TrainingPolicy` (its ``as_dict``, as a plan or a trainer's summary holds it): what runs,
    and what the memory policy chose where a field was ``auto``."""
    m = p.get("memory")
    text = (
        f"micro-batch {p['micro_batch_size']} × {p['seq_len']} tokens, activations {p['activation_policy']}, "
        f"compile {'on' if p['compile'] else 'off'}, {p['compute_dtype']} on {p['device']['type']}"
    )
    if m:
        text += (
            f" (chosen: {', '.join(m['chosen'])}; estimated peak {m['estimated_peak_gb']:.1f} GB of "
            f"{m['usable_gb']:.1f} GB usable on {m['device_memory_gb']:g} GB"
            + ("" if m["fits"] else "; nothing fits the estimate: the leanest choice is tried")
            + ")"
        )
    return text


def resolve_training_policy(
    shape: ModelShape | None,
    student,
    training,
    device: DeviceFacts,
    *,
    compute_dtype: str,
    headroom: float = DEFAULT_HEADROOM,
    recompute_available: bool = True,
) -> TrainingPolicy:
    """What ``training`` (a TrainingSpec) of ``student`` (a StudentSpec) on ``device`` runs: ``auto`` micro-batch and
    activation policy chosen by :func:`choose_memory_policy` at rows of ``max_seq_len`` tokens, compile resolved for
    the device kind, the cheap recompute unavailable under compile (a set ``recompute`` then runs as ``none``).
    ``recompute_available`` False: the exact recompute is off in this trainer (a measurement's setting).
    The planner and the trainer both call it (module docstring); a device of unknown memory cannot size ``auto``."""
    compiled = training.compiling(device.type)
    recompute = recompute_available and not compiled
    seq_len = int(training.max_seq_len)
    attention = memory_attention(student, device.type, seq_len)
    memory = None
    if "auto" in (training.micro_batch_size, training.activation_checkpointing):
        if device.memory_gb is None:
            from campaign_orchestrator.costs.memory import PlanError

            raise PlanError(
                f"training.micro_batch_size / activation_checkpointing 'auto' size the step from the device's "
                f"memory, but the memory of training.hardware {training.hardware!r} is unknown (the pricing "
                "catalog's entry has no memory_gb): add it, or set both fields to values"
            )
        if shape is None:
            raise ValueError("resolve_training_policy: an `auto` field needs the model's shape")
        memory = choose_memory_policy(
            shape,
            student,
            training,
            device_memory_gb=device.memory_gb,
            seq_len=seq_len,
            device_type=device.type,
            compute_dtype=compute_dtype,
            headroom=headroom,
            attention=attention,
            runtime_gb=device.runtime_gb,
            heap_retention=device.heap_retention,
            recompute_cheap=recompute,
        )
        training = resolved_training(training, memory)
    policy = activation_policy_of(training.activation_checkpointing, recompute)
    if policy == "recompute" and not recompute:
        policy = "none"
    return TrainingPolicy(
        micro_batch_size=int(training.micro_batch_size),
        activation_policy=policy,
        compile=compiled,
        compute_dtype=compute_dtype,
        attention=attention,
        seq_len=seq_len,
        device=device,
        headroom=headroom,
        memory=memory,
        chosen=memory.chosen if memory is not None else (),
    )


def fit_micro_batch(policy: TrainingPolicy, train_rows: int, world: int, accumulation: int) -> TrainingPolicy:
    """An ``auto`` micro-batch larger than the training rows allow (one step: micro × world × accumulation rows) shrunk
    to what the rows fill; a set one as it is (the trainer refuses too few rows for it)."""
    if "micro_batch_size" not in policy.chosen:
        return policy
    cap = max(1, train_rows // (world * accumulation))
    if policy.micro_batch_size <= cap:
        return policy
    import dataclasses

    memory = dataclasses.replace(policy.memory, micro_batch_size=cap) if policy.memory is not None else None
    return dataclasses.replace(policy, micro_batch_size=cap, memory=memory)
