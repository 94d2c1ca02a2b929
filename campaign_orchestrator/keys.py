"""What keys a trained adapter: the settings that change what is trained, resolved for where the trainer runs.

A content key holds resolved values, never ``auto``: ``student.quantization.compute_dtype`` enters as the
``<device kind>:<dtype>`` the trainer computes in (``campaign_orchestrator.hardware.key_precision``), and
``training.micro_batch_size: auto`` as the micro-batch the trainer will pick on its device
(``costs.memory_policy.resolve_training_policy``, the planner's and the trainer's one call, shrunk to what the
training rows fill): the micro-batch sets the effective batch (micro × world × accumulation) and, with
``training.epochs``, the step count, so two devices that would train differently never share an adapter, and two
that train identically still do.

Speed-only choices change how fast, not what is trained, and stay out of the key: FSDP2's resharding, compile, the
launcher, logging, checkpoints and timeouts always; the attention kernel and the activation policy when they are
``auto`` (chosen per device at run time). A set attention kernel or activation policy stays in the key as it
always was: keys made before this rule keep their value, so no adapter is trained again for it.

Without a ``precision`` (:func:`training_key_fields`) the fields are the spec's as written: the code versions the
model-change sensor compares are computed when the code location loads, where nothing is resolved (torch is not
imported there); they are versions, not content keys.

No Dagster import; torch only inside :func:`trainer_device` for the local launcher (this host's device).
"""

from __future__ import annotations

from pathlib import Path

# Student fields added after adapters were first keyed: left out of the key at their defaults, so adding
# them changed no existing adapter's key (nor its cache, nor the model-change sensor's versions).
ADDED_STUDENT_DEFAULTS = {("lora", "target_parameters"): [], ("lora", "use_dora"): False}

# Training fields that change how fast or where, never what is trained: a relaunch with them changed still resumes.
SPEED_ONLY_TRAINING = (
    "launcher",
    "log_every",
    "hardware",
    "allow_cpu_fallback",
    "cpu_hardware",
    "checkpoint",
    "collective_timeout_s",
    "diagnostics",
    "distributed_env",
    "reshard_after_forward",
    "compile",
)


def student_key_fields(spec) -> dict:
    """The student settings that key its adapter (see ``ADDED_STUDENT_DEFAULTS``; ``moe`` at its defaults too)."""
    from campaigns.spec import MoeSpec

    out = spec.student.model_dump()
    for (section, name), default in ADDED_STUDENT_DEFAULTS.items():
        if out[section][name] == default:
            del out[section][name]
    if spec.student.moe == MoeSpec():
        del out["moe"]
    return out


def training_key_fields(spec, precision: str | None = None, micro_batch: int | None = None) -> dict:
    """Settings that change the trained adapter (``SPEED_ONLY_TRAINING`` left out, so changing them keeps an
    interrupted run's checkpoints usable). With ``precision`` (the resolved ``<device>:<dtype>``) the fields are
    resolved as a content key holds them (module docstring): ``compute_dtype`` replaced by it, an ``auto`` attention
    kernel and activation policy left out, ``micro_batch_size: auto`` replaced by ``micro_batch`` (required then).
    Without: the spec's fields as written (code versions computed when the code location loads)."""
    student = student_key_fields(spec)
    training = spec.training.model_dump(exclude=set(SPEED_ONLY_TRAINING))
    if spec.training.distillation.loss != "on_policy":  # added with on-policy distillation: keys no other adapter
        del training["distillation"]["on_policy"]
    if spec.training.selection.rule == "last":  # added with checkpoint selection: keys no other adapter
        del training["selection"]
    if spec.training.loss_normalization == "token":  # added with example normalization: keys no other adapter
        del training["loss_normalization"]
    if precision is None:
        return {"student": student, "training": training}
    student["quantization"]["compute_dtype"] = precision
    if student.get("attn_implementation") == "auto":  # measured per device and shape at run time: speed only
        del student["attn_implementation"]
    if training["activation_checkpointing"] == "auto":  # chosen per device: what backward recomputes, speed only
        del training["activation_checkpointing"]
    if training["micro_batch_size"] == "auto":
        if micro_batch is None:
            raise ValueError(
                "training.micro_batch_size is 'auto': the adapter's key needs the micro-batch the trainer will use "
                "(campaign_orchestrator.keys.key_policy resolves it for the trainer's device)"
            )
        training["micro_batch_size"] = int(micro_batch)
    return {"student": student, "training": training}


def trainer_device(spec, catalog):
    """Where ``spec``'s trainer will run, as the training policy sees it
    (:class:`~campaign_orchestrator.costs.memory_policy.DeviceFacts`): the local launcher's processes on this host
    (its GPU when torch sees one, else its CPU, with the allocator the launcher starts them on); the Kubernetes
    launcher's on ``training.hardware``'s device, its memory from the pricing catalog."""
    from campaign_orchestrator.costs.memory_policy import device_facts, device_type_of, policy_terms

    terms = policy_terms(spec, catalog)
    if spec.training.launcher == "local":
        from campaign_orchestrator import allocator
        from campaign_orchestrator.hardware import default_device, device_memory_gb

        kind = default_device()
        try:
            alloc = "jemalloc" if allocator.preload_env() else "glibc"
        except allocator.AllocatorError:
            alloc = "glibc"
        return device_facts(terms, kind, device_memory_gb(kind), alloc)
    entry = catalog.get(spec.training.hardware)
    return device_facts(terms, device_type_of(entry), entry.memory_gb)


def key_policy(spec, catalog, base_model: str | Path, precision: str, train_rows: int | None = None, device=None):
    """The :class:`~campaign_orchestrator.costs.memory_policy.TrainingPolicy` the adapter's key names when
    ``training.micro_batch_size`` is ``auto`` (None otherwise: the key holds the set value): resolved for
    ``device`` (default: :func:`trainer_device` of the pricing ``catalog``) by the trainer's own call, in
    ``precision``'s dtype, shrunk to what ``train_rows`` fill as the trainer shrinks it."""
    if spec.training.micro_batch_size != "auto":
        return None
    from campaign_orchestrator.costs.memory import ModelShape
    from campaign_orchestrator.costs.memory_policy import fit_micro_batch, resolve_training_policy

    tr = spec.training
    policy = resolve_training_policy(
        ModelShape.from_model_dir(Path(base_model)),
        spec.student,
        tr,
        device or trainer_device(spec, catalog),
        compute_dtype=precision.split(":")[-1],
        headroom=float(spec.cost.planner.memory_headroom),  # as policy_terms gives the trainer
    )
    if train_rows is not None:
        policy = fit_micro_batch(policy, train_rows, tr.world_size, tr.gradient_accumulation_steps)
    return policy


def adapter_key_fields(spec, precision: str, policy=None) -> dict:
    """:func:`training_key_fields` resolved: ``precision`` and the micro-batch of ``policy`` (:func:`key_policy`)."""
    return training_key_fields(spec, precision, None if policy is None else policy.micro_batch_size)


def policy_mismatch(summary: dict, policy) -> str | None:
    """Why an adapter may not be stored under a key made for ``policy``: the trainer's summary says it ran another
    micro-batch than the key names (None: it ran what was keyed, or nothing was resolved for the key)."""
    ran = (summary.get("training_policy") or {}).get("micro_batch_size")
    if policy is None or ran is None or int(ran) == policy.micro_batch_size:
        return None
    return (
        f"the trainer ran micro-batch {ran} but the adapter's key was made for {policy.micro_batch_size} "
        f"(training.micro_batch_size: auto, resolved for {policy.device.type} with {policy.device.memory_gb:g} GB); "
        "set training.micro_batch_size to a number, or run the trainer on the device it was keyed for"
    )


def job_policy_terms(spec, catalog) -> dict:
    """What the trainer's job carries so it resolves ``auto`` with the planner's inputs
    (``costs.memory_policy.policy_terms``)."""
    from campaign_orchestrator.costs.memory_policy import policy_terms

    return policy_terms(spec, catalog)


def spec_as_trained(spec, policy):
    """``spec`` with the ``auto`` fields ``policy`` resolved (``costs.memory_policy.resolved_spec``): what reads the
    effective batch (the recipe checks) reads numbers."""
    from campaign_orchestrator.costs.memory_policy import resolved_spec

    return resolved_spec(spec, policy)
