"""The ``training:`` section: steps, batch, distribution, checkpoints, profiling, diagnostics, distillation loss."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from campaigns.spec.common import S3Uri, _Strict
from campaigns.spec.selection import SelectionSpec


class ProfilerScheduleSpec(_Strict):
    """``torch.profiler.schedule``: skip ``skip_first`` steps, then cycles of ``wait`` idle, ``warmup``
    traced-but-discarded and ``active`` recorded steps; one Chrome trace per rank per cycle."""

    skip_first: int = Field(
        0, ge=0, description="Steps ignored before the first cycle (compilation, first all-gathers)."
    )
    wait: int = Field(1, ge=0, description="Steps per cycle with the profiler off.")
    warmup: int = Field(1, ge=0, description="Steps per cycle traced and discarded (profiler start-up cost).")
    active: int = Field(3, ge=1, description="Steps per cycle recorded into the trace.")
    repeat: int = Field(1, ge=0, description="Cycles to record (0: keep cycling until training ends).")


class ProfilingSpec(_Strict):
    """torch.profiler traces of the training loop, triaged into a verdict (off by default)."""

    enabled: bool = Field(False, description="Record Chrome traces (one JSON per rank per cycle) and triage them.")
    schedule: ProfilerScheduleSpec = ProfilerScheduleSpec()
    record_shapes: bool = Field(False, description="Record input shapes of every op (larger traces).")
    profile_memory: bool = Field(False, description="Record tensor allocations and frees (memory events in the trace).")
    with_stack: bool = Field(False, description="Record Python call stacks of ops (much larger traces).")
    upload_url: S3Uri = Field(
        None,
        description="Also copy the profile directory (traces, diagnostics, triage) to s3://bucket/prefix/<campaign>/"
        "<run key>/ (credentials and endpoint from the standard AWS environment, never from this file).",
    )


class CheckpointSpec(_Strict):
    """Resumable checkpoints: adapter weights (never the frozen base), optimizer, step, RNG, data position.

    Every start of the trainer is a resume: if a complete checkpoint exists, training continues from it.
    """

    every_steps: int | None = Field(
        50, ge=1, description="Write a checkpoint every N optimizer steps (None: never by step)."
    )
    every_minutes: float | None = Field(
        30.0, gt=0, description="Also write one when this many minutes passed since the last (None: never by time)."
    )
    keep_last: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept; older ones are deleted.")
    remote_uri: S3Uri = Field(
        None,
        description="Mirror checkpoints to object storage, e.g. s3://bucket/prefix (credentials and endpoint come from "
        "the standard AWS environment, never from this file); resume fetches from there when the local copy is gone.",
    )


class DiagnosticCommand(_Strict):
    """One node diagnostic: an argv run without a shell; its output is saved next to the trace."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,62}$", description="Slug naming the output file.")
    command: list[str] = Field(min_length=1, description="Program and arguments, e.g. [nvidia-smi, topo, -m].")
    timeout_s: float = Field(
        30.0, gt=0, le=600, description="Kill the command after this many seconds (noted, not an error)."
    )


def _default_diagnostics() -> list[DiagnosticCommand]:
    return [
        DiagnosticCommand(name="gpu_topology", command=["nvidia-smi", "topo", "-m"], timeout_s=30),
        DiagnosticCommand(name="nvlink_status", command=["nvidia-smi", "nvlink", "-s"], timeout_s=30),
        DiagnosticCommand(name="gpu_performance", command=["nvidia-smi", "-q", "-d", "PERFORMANCE"], timeout_s=30),
        DiagnosticCommand(name="gpu_utilization", command=["nvidia-smi", "dmon", "-s", "u", "-c", "5"], timeout_s=30),
        DiagnosticCommand(name="infiniband", command=["ibstat"], timeout_s=30),
    ]


class DiagnosticsSpec(_Strict):
    """Commands run at the end of training on each node (local rank 0); a missing one is skipped and noted."""

    enabled: bool = Field(True, description="Run the commands (they run concurrently; each has its own timeout).")
    commands: list[DiagnosticCommand] = Field(
        default_factory=_default_diagnostics,
        description="Diagnostics to run; default: nvidia-smi topology, NVLink, clocks/throttling, utilization; ibstat.",
    )

    @field_validator("commands")
    @classmethod
    def _unique(cls, v: list[DiagnosticCommand]) -> list[DiagnosticCommand]:
        names = [c.name for c in v]
        if len(set(names)) != len(names):
            raise ValueError(f"diagnostic names must be unique, got {names}")
        return v


_NCCL_SUBSYS = {
    "INIT",
    "COLL",
    "P2P",
    "SHM",
    "NET",
    "GRAPH",
    "TUNING",
    "ENV",
    "ALLOC",
    "CALL",
    "PROXY",
    "NVLS",
    "BOOTSTRAP",
    "REG",
    "PROFILE",
    "RAS",
    "ALL",
}
_IFACE_LIST = re.compile(r"^\^?=?[A-Za-z0-9_.\-]+(:[0-9]+)?(,[A-Za-z0-9_.\-]+(:[0-9]+)?)*$")


class DistributedEnvSpec(_Strict):
    """NCCL / torch.distributed settings, declared once and exported to every rank at launch.

    Field names are the environment variable names; unset fields are not exported (NCCL's own
    defaults apply). ``training.diagnostics.distributed_env`` turns this into the env dict that the
    local launcher passes to torchrun and the Kubernetes launcher renders into pods.
    """

    NCCL_DEBUG: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(
        None, description="NCCL log level (INFO prints the rings/trees and the transport chosen per peer)."
    )
    NCCL_DEBUG_SUBSYS: str | None = Field(
        None,
        description="Comma-separated NCCL subsystems to log (INIT,COLL,P2P,SHM,NET,GRAPH,TUNING,ENV,...); "
        "a leading ^ excludes them.",
    )
    NCCL_IB_HCA: str | None = Field(
        None,
        description="InfiniBand HCAs (and ports) NCCL may use, e.g. '=mlx5_0:1,mlx5_1:1'; ^ excludes, = matches "
        "exactly instead of by prefix.",
    )
    NCCL_SOCKET_IFNAME: str | None = Field(
        None, description="Network interfaces for NCCL's bootstrap and socket transport, e.g. 'eth0' or '^docker,lo'."
    )
    TORCH_NCCL_ASYNC_ERROR_HANDLING: Literal[0, 1, 2, 3] | None = Field(
        None,
        description="What a failed or timed-out NCCL collective does: 0 nothing, 1 abort the communicators "
        "and end the process, 2 abort the communicators only, 3 end the process without aborting them.",
    )

    @field_validator("NCCL_DEBUG_SUBSYS")
    @classmethod
    def _subsys(cls, v: str | None) -> str | None:
        if v is not None:
            names = v.removeprefix("^").split(",")
            bad = [n for n in names if n.strip().upper() not in _NCCL_SUBSYS]
            if bad:
                raise ValueError(f"unknown NCCL subsystem(s) {bad}; expected a comma list of {sorted(_NCCL_SUBSYS)}")
        return v

    @field_validator("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME")
    @classmethod
    def _iface_list(cls, v: str | None) -> str | None:
        if v is not None and not _IFACE_LIST.match(v):
            raise ValueError(f"expected [^][=]name[:port][,name[:port]...] (e.g. '=mlx5_0:1,mlx5_1:1'), got {v!r}")
        return v

    def env(self) -> dict[str, str]:
        """The environment variables to export (only the fields that are set)."""
        return {k: str(v) for k, v in self.model_dump().items() if v is not None}


class OnPolicySpec(_Strict):
    """`loss: on_policy` (GKD, Agarwal et al. 2024): the student samples completions for training prompts with
    its current weights, the teacher scores every sampled token (its top-k log-probabilities, one prefill per
    sequence, no generation), and the loss is the generalized JSD between the two on those tokens only.
    Sampling and scoring happen in rounds of `samples_per_round` prompts inside the one training job."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    lambda_: float = Field(
        1.0,
        alias="lambda",
        ge=0.0,
        le=1.0,
        description="GKD's lambda: the fraction of optimizer steps (after `warmup_steps`) trained on the student's "
        "own samples; the others are off-policy steps on the teacher's generations (sequence KD). 1.0: fully "
        "on-policy. Below 1 needs the teacher stage (`teacher_generations: generate`).",
    )
    beta: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Generalized JSD interpolation: 0 forward KL(teacher || student), 1 reverse KL(student || "
        "teacher) (the default: mode seeking, as in GKD and Qwen3's distillation), between: JSD(beta).",
    )
    samples_per_round: int = Field(
        32,
        ge=1,
        description="Prompts the student answers (one sample each) per round, across all ranks; a round then trains "
        "samples_per_round / (micro_batch_size x world x gradient_accumulation_steps) on-policy steps, so it must "
        "be a multiple of that. Smaller: samples fresher (closer to the current weights), more rounds.",
    )
    top_k: int = Field(
        20,
        ge=1,
        le=1000,
        description="Teacher log-probabilities kept per sampled position (the rest of its mass is one tail bucket, "
        "as in the logit loss).",
    )
    temperature: float = Field(
        1.0,
        ge=0.0,
        le=5.0,
        description="Student sampling temperature (0: greedy; 1: the student's own distribution, "
        "what the on-policy estimate assumes).",
    )
    max_new_tokens: int = Field(64, ge=1, le=32768, description="Longest student sample, in tokens.")
    warmup: Literal["none", "sequence_kd"] = Field(
        "none",
        description="sequence_kd: the first `warmup_steps` optimizer steps are off-policy sequence KD on the "
        "teacher's generations (the existing stages), then training switches on-policy.",
    )
    warmup_steps: int = Field(0, ge=0, description="`warmup: sequence_kd`: how many off-policy steps come first.")
    teacher_generations: Literal["generate", "none"] = Field(
        "generate",
        description="none: no teacher stage at all (nor distillation_set / tokenized_dataset): the prompts "
        "go straight to the trainer, for a fully on-policy campaign (`lambda: 1`, no warmup); the eval loss is then "
        "not measured (no teacher text to measure it on).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> OnPolicySpec:
        if self.warmup == "sequence_kd" and self.warmup_steps < 1:
            raise ValueError(
                "`warmup: sequence_kd` needs `warmup_steps` (the off-policy steps first), e.g. warmup_steps: 10"
            )
        if self.warmup == "none" and self.warmup_steps:
            raise ValueError(
                f"`warmup_steps: {self.warmup_steps}` without `warmup: sequence_kd`: write "
                "`warmup: sequence_kd` or remove warmup_steps"
            )
        if self.teacher_generations == "none" and (self.lambda_ < 1.0 or self.warmup != "none"):
            what = f"lambda {self.lambda_} < 1" if self.lambda_ < 1.0 else f"warmup: {self.warmup}"
            raise ValueError(
                f"`teacher_generations: none` skips the teacher stage, but {what} trains off-policy "
                "steps on the teacher's generations: write `teacher_generations: generate`, or "
                "`lambda: 1.0` with `warmup: none`"
            )
        return self


class DistillationSpec(_Strict):
    """What the student learns from the teacher."""

    loss: Literal["sequence", "logits", "on_policy"] = Field(
        "sequence",
        description="sequence: cross-entropy on the teacher's text; logits: forward KL against the teacher's stored "
        "top-k log-probabilities (remaining mass as one tail bucket) mixed with cross-entropy. `logits` needs "
        "teacher.sampling.logprobs (an API teacher that returns them). A teacher with another tokenizer than the "
        "student's, or an API teacher (it returns text), is aligned by byte offsets: exact KL where the two "
        "tokenizers' tokens match, a vocabulary-free (ULD, sorted probabilities) term elsewhere; the trainer's "
        "summary says which share of positions each covered. on_policy: the student "
        "samples, the teacher scores its tokens, generalized JSD on them (`on_policy` section; a teacher that "
        "shares the student's tokenizer: a local `transformers` one, in process beside the student, or an "
        "`openai` server that returns prompt_logprobs).",
    )
    kl_weight: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="`logits`: loss = (1 - kl_weight) * CE + kl_weight * KL (each exact per token).",
    )
    teacher_tokenizer: str | None = Field(
        None,
        description="`logits` or `on_policy` with a remote teacher (openai/vllm served name): a directory holding the "
        "teacher's tokenizer, checked against the student's before training starts (`logits`: recorded as the "
        "teacher's tokenizer identity; without it an API teacher is `api:<model>`). Local teachers are checked "
        "directly.",
    )
    on_policy: OnPolicySpec = Field(
        default_factory=OnPolicySpec,
        description="`loss: on_policy`: GKD's lambda and beta, rounds, the teacher's "
        "top-k, student sampling, the off-policy warm start, and whether the teacher stage runs.",
    )

    @property
    def skips_teacher(self) -> bool:
        """No teacher stage in the graph: the prompts feed the trainer directly (fully on-policy)."""
        return self.loss == "on_policy" and self.on_policy.teacher_generations == "none"


class TrainingSpec(_Strict):
    """Steps, batch, optimizer, distribution (nodes, processes, sharding), launcher, checkpoints and loss."""

    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; exclusive with `epochs`.")
    epochs: float | None = Field(None, gt=0, description="Passes over the dataset; exclusive with `max_steps`.")
    learning_rate: float = Field(2e-4, ge=0.0, le=1.0, description="Peak learning rate (0 trains nothing, on purpose).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps before the cosine decay.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay on the adapter weights.")
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        8,
        description="Rows per process per micro-step (a packed row holds several examples). auto: the memory "
        "policy (campaign_orchestrator.costs.memory_policy) picks it from the device's memory, the model's shape, "
        "LoRA or QLoRA, the sequence length and the world: the most rows, up to a step's worth of tokens that keeps "
        "the device busy, whose estimated peak fits; the planner and the trainer resolve it alike and the trainer's "
        "summary says what it used. Not with `distillation.loss: on_policy` (rounds are counted in micro-batches).",
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    max_seq_len: int = Field(512, ge=8, le=1_048_576, description="Longest tokenized sequence.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    loss_normalization: Literal["token", "example"] = Field(
        "token",
        description="token: the step's cross-entropy is the mean over its loss tokens (each token counts once, so a "
        "long answer weighs more than a short one); example: the mean over its examples of each example's mean "
        "token loss (each answer counts once, whatever its length: a one-word task answer beside sentence-long "
        "replay answers). `example` needs `distillation.loss: sequence` and runs the cross-entropy on the logits "
        "(no fused linear cross-entropy).",
    )
    seed: int = Field(0, description="Seed of LoRA init, data order and dropout.")
    nodes: int = Field(1, ge=1, le=4096, description="Machines (torchrun --nnodes).")
    processes_per_node: int = Field(
        1, ge=1, le=64, description="Processes per machine, one per GPU (--nproc-per-node)."
    )
    sharding: Literal["full", "hybrid", "none"] = Field(
        "full",
        description="full: FSDP2 across all ranks; hybrid: shard in a node, replicate across nodes; none: replicate.",
    )
    launcher: Literal["local", "k8s"] = Field(
        "local", description="local: torchrun subprocesses; k8s: a Kubernetes Job."
    )
    hardware: str | None = Field(
        None,
        description="Pricing-catalog key of one training device (a GPU, or a CPU host); required in a campaign "
        "(the ledger bills training, and local evaluation, at it; no silent default). A GPU entry (gpu-hour) "
        "makes training refuse to start where no GPU is visible, unless `allow_cpu_fallback`.",
    )
    allow_cpu_fallback: bool = Field(
        False,
        description="With GPU `hardware` and no visible GPU: train (and evaluate locally) on the CPU anyway, "
        "billed as CPU time at `cpu_hardware`, and say so (default: fail before training, with a message).",
    )
    cpu_hardware: str | None = Field(
        None, description="`allow_cpu_fallback`: pricing-catalog key CPU time is billed at (e.g. cpu-2vcpu)."
    )
    log_every: int = Field(10, ge=1, description="Log and stream metrics every this many steps.")
    profiling: ProfilingSpec = Field(
        ProfilingSpec(), description="torch.profiler traces and their triage (off by default)."
    )
    diagnostics: DiagnosticsSpec = Field(DiagnosticsSpec(), description="Node diagnostics run at the end of training.")
    distributed_env: DistributedEnvSpec = Field(
        DistributedEnvSpec(), description="NCCL / torch.distributed environment variables exported to every rank."
    )
    activation_checkpointing: bool | Literal["auto", "none", "recompute", "full"] = Field(
        False,
        description="What backward recomputes instead of keeping (the activation policy). none: keep every "
        "activation (fastest, most memory); recompute: keep all but the cheap ones, recomputed exactly in backward "
        "(the SwiGLU products, the norms' outputs, PEFT's input casts: training/recompute.py); full: keep only each "
        "decoder layer's input and rerun the layer in backward (least memory, ~1.5x the step's FLOPs). false is "
        "recompute, true is full. auto: the memory policy picks the least recomputation whose estimated peak fits "
        "the device (with `micro_batch_size: auto`, together with the micro-batch); the trainer's summary says which.",
    )
    reshard_after_forward: bool | Literal["auto"] = Field(
        "auto",
        description="FSDP2 (`fully_shard(reshard_after_forward=...)`): false keeps each layer's parameters "
        "gathered from its forward until its backward (no second all-gather; the unsharded layers stay in memory, "
        "which the planner's estimate counts), true frees them after the forward and gathers them again in backward. "
        "auto: false on one node (fast intra-node links), true across nodes. A world of one is never sharded.",
    )
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile each decoder layer's forward (in place: parameter names, checkpoints, "
        "adapters unchanged). auto: on for CUDA; on a CPU, on only where a measurement on the host says the run pays "
        "inductor's warm-up back with faster steps (training/compile_choice.py; the reason in the summary's "
        "`compile.auto`). The compiling first step(s) are reported apart from "
        "the timed ones (`compile` in the summary; `compiling` per step in metrics.parquet). Under compile the exact "
        "cheap-activation recompute is left to the compiler's own partitioner (`recompute` is then `none`).",
    )
    collective_timeout_s: int = Field(
        600,
        ge=10,
        le=86_400,
        description=(
            "Process-group timeout: a rank that dies or hangs makes every other rank fail after at most this long."
        ),
    )
    eval_rows: int = Field(
        64,
        ge=0,
        description="Rows of the validation split (without one: the first training rows) whose loss is measured "
        "before and after training (eval mode).",
    )
    export_merged: bool = Field(
        False, description="Also write the base with the adapter merged in (compute dtype) next to the adapter."
    )
    checkpoint: CheckpointSpec = CheckpointSpec()
    selection: SelectionSpec = Field(
        SelectionSpec(),
        description="Which checkpoint the stage returns: the last, or "
        "the best by held-out task and replay loss (early stop with `patience`).",
    )
    distillation: DistillationSpec = DistillationSpec()

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingSpec:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of `max_steps` or `epochs`")
        if self.loss_normalization == "example" and self.distillation.loss != "sequence":
            raise ValueError(
                f"`loss_normalization: example` weighs each example's cross-entropy; it is not for "
                f"`distillation.loss: {self.distillation.loss}` (set loss_normalization: token)"
            )
        if self.distillation.loss == "on_policy" and self.micro_batch_size == "auto":
            raise ValueError(
                "`micro_batch_size: auto` is not for `distillation.loss: on_policy`: a round's "
                "samples_per_round is a multiple of the micro-batch, so set micro_batch_size to a number"
            )
        if self.distillation.loss == "on_policy":
            op = self.distillation.on_policy
            if op.samples_per_round % self.effective_batch:
                raise ValueError(
                    f"distillation.on_policy.samples_per_round ({op.samples_per_round}) must be a multiple of "
                    f"micro_batch_size x nodes x processes_per_node x gradient_accumulation_steps = "
                    f"{self.effective_batch} (the samples one on-policy step trains on), e.g. "
                    f"{max(1, op.samples_per_round // self.effective_batch) * self.effective_batch}"
                )
            if self.max_steps is not None and op.warmup_steps >= self.max_steps:
                raise ValueError(
                    f"distillation.on_policy.warmup_steps ({op.warmup_steps}) leaves no on-policy step "
                    f"of max_steps {self.max_steps}: lower warmup_steps or raise max_steps"
                )
        if self.allow_cpu_fallback and self.cpu_hardware is None:
            raise ValueError(
                "`allow_cpu_fallback: true` bills CPU time: set `cpu_hardware` to the pricing-catalog key "
                "it is billed at (e.g. cpu-2vcpu)"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def effective_batch(self) -> int:
        if self.micro_batch_size == "auto":
            raise ValueError(
                "training.micro_batch_size is 'auto': the effective batch is known once the memory "
                "policy resolved it (campaign_orchestrator.costs.memory_policy)"
            )
        return self.micro_batch_size * self.world_size * self.gradient_accumulation_steps

    @property
    def resharding_after_forward(self) -> bool:
        """``reshard_after_forward`` resolved: ``auto`` is false on one node, true across nodes."""
        if self.reshard_after_forward == "auto":
            return self.nodes > 1
        return self.reshard_after_forward

    def compiling(self, device_type: str) -> bool:
        """``compile`` resolved for a device type (``cuda``, ``cpu``) without measuring: ``auto`` compiles on CUDA
        only. The trainer resolves ``auto`` on a CPU by measurement first (``training.compile_choice``)."""
        if self.compile == "auto":
            return device_type == "cuda"
        return self.compile
