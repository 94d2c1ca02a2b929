"""The campaign spec: one YAML file, validated by these pydantic models.

Every field is documented where it is declared. Unknown keys are errors (``extra="forbid"``),
so a typo never silently falls back to a default. This module imports only pydantic: the
trainer, the evaluation code and the Dagster code location all read the same models.

Model references: a model path is either a filesystem path (absolute, or relative to the
campaign file's repository root) or ``@demo/<name>``, a model built by the project's own
``tinymodels`` step under the artifact root (see ``tinymodels/``).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SLUG = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- teacher


class SamplingSpec(_Strict):
    """Sampling parameters passed to every teacher backend (vLLM ``SamplingParams`` names)."""

    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(64, ge=1, le=32768, description="Completion length limit.")
    n: int = Field(1, ge=1, le=64, description="Completions per prompt.")
    seed: int = Field(0, ge=0, description="Sampling seed; with the prompt and sample index it fixes each sample.")
    logprobs: int | None = Field(
        None, ge=1, le=20, description="Store the top-k log-probabilities of each generated token (logit distillation)."
    )


class TeacherSpec(_Strict):
    """The model that writes the answers the student learns from."""

    backend: Literal["transformers", "openai", "vllm"] = Field(
        "transformers", description="transformers: local model; openai: any OpenAI-compatible endpoint; vllm: offline batch."
    )
    model: str = Field(description="Model path, `@demo/<name>`, or the served model name for `openai`.")
    revision: str | None = Field(None, description="Model revision; part of the generation cache key.")
    sampling: SamplingSpec = SamplingSpec()
    batch_size: int = Field(64, ge=1, le=4096, description="Prompts per local generation batch.")
    base_url: str | None = Field(None, description="`openai` backend: the endpoint, e.g. http://host:8000/v1.")
    api_key_env: str | None = Field(
        None, description="`openai` backend: name of the environment variable holding the API key (never the key itself)."
    )
    chat: bool = Field(False, description="`openai` backend: use /v1/chat/completions instead of /v1/completions.")
    max_concurrency: int = Field(16, ge=1, le=1024, description="`openai` backend: requests in flight.")
    hardware: str = Field("cpu-2vcpu", description="Pricing-catalog key of the hardware a self-hosted teacher runs on.")

    @model_validator(mode="after")
    def _openai_needs_url(self) -> TeacherSpec:
        if self.backend == "openai" and not self.base_url:
            raise ValueError("backend 'openai' needs `base_url` (e.g. http://localhost:8000/v1)")
        return self


# --------------------------------------------------------------------------- student


class LoraSpec(_Strict):
    r: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Module names that get LoRA adapters.",
    )


class QuantizationSpec(_Strict):
    load_in_4bit: bool = Field(True, description="QLoRA: load the frozen base in 4-bit with bitsandbytes.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type (NF4 is the QLoRA default).")
    compute_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Dtype of matmuls and of the packed 4-bit storage (so FSDP can shard it)."
    )
    double_quant: bool = Field(False, description="Also quantize the quantization constants (saves ~0.4 bit/param).")


class StudentSpec(_Strict):
    """The model being fine-tuned."""

    base_model: str = Field(description="Base model path or `@demo/<name>`.")
    revision: str | None = Field(None, description="Base model revision; part of the adapter's cache key.")
    lora: LoraSpec = LoraSpec()
    quantization: QuantizationSpec = QuantizationSpec()


# --------------------------------------------------------------------------- data


class HeldoutSpec(_Strict):
    fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Share of prompts held out for evaluation, by id hash.")
    seed: int = Field(0, ge=0, description="Seed of the id-hash split.")
    max_items: int | None = Field(None, ge=1, description="Cap on held-out items (taken in id-hash order).")


class FilterSpec(_Strict):
    """Rules that turn teacher generations into the distillation set; each is counted."""

    drop_empty: bool = Field(True, description="Drop empty completions.")
    drop_truncated: bool = Field(True, description="Drop completions that stopped on the length limit.")
    format_regex: str | None = Field(None, description="Completions must fully match this regex.")
    dedupe: bool = Field(True, description="Drop exact duplicate (prompt, completion) pairs.")
    min_chars: int = Field(1, ge=0, description="Drop completions shorter than this (after stripping).")
    max_chars: int | None = Field(None, ge=1, description="Drop completions longer than this.")

    @field_validator("format_regex")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from e
        return v


class DataSpec(_Strict):
    source: str = Field(description="JSONL file or glob of files, relative to the repository root or absolute.")
    id_field: str = Field("id", description="Field holding a stable item id (hash of the prompt when absent).")
    prompt_field: str = Field("prompt", description="Field holding the prompt text.")
    reference_field: str = Field("reference", description="Reference answer, used for held-out evaluation only.")
    category_field: str = Field("category", description="Field holding the item's category (for per-category results).")
    heldout: HeldoutSpec = HeldoutSpec()
    filters: FilterSpec = FilterSpec()


# --------------------------------------------------------------------------- training


class ProfilerScheduleSpec(_Strict):
    """``torch.profiler.schedule``: skip ``skip_first`` steps, then cycles of ``wait`` idle, ``warmup``
    traced-but-discarded and ``active`` recorded steps; one Chrome trace per rank per cycle."""

    skip_first: int = Field(0, ge=0, description="Steps ignored before the first cycle (compilation, first all-gathers).")
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
    upload_url: str | None = Field(
        None,
        description="Also copy the profile directory (traces, diagnostics, triage) to s3://bucket/prefix/<campaign>/"
        "<run key>/ (credentials and endpoint from the standard AWS environment, never from this file).",
    )

    @field_validator("upload_url")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$", v):
            raise ValueError(f"expected s3://bucket[/prefix], got {v!r}")
        return v


class DiagnosticCommand(_Strict):
    """One node diagnostic: an argv run without a shell; its output is saved next to the trace."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,62}$", description="Slug naming the output file.")
    command: list[str] = Field(min_length=1, description="Program and arguments, e.g. [nvidia-smi, topo, -m].")
    timeout_s: float = Field(30.0, gt=0, le=600, description="Kill the command after this many seconds (noted, not an error).")


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


_NCCL_SUBSYS = {"INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "CALL", "PROXY", "NVLS",
                "BOOTSTRAP", "REG", "PROFILE", "RAS", "ALL"}
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
        None, description="Comma-separated NCCL subsystems to log (INIT,COLL,P2P,SHM,NET,GRAPH,TUNING,ENV,...); "
        "a leading ^ excludes them."
    )
    NCCL_IB_HCA: str | None = Field(
        None, description="InfiniBand HCAs (and ports) NCCL may use, e.g. '=mlx5_0:1,mlx5_1:1'; ^ excludes, = matches "
        "exactly instead of by prefix."
    )
    NCCL_SOCKET_IFNAME: str | None = Field(
        None, description="Network interfaces for NCCL's bootstrap and socket transport, e.g. 'eth0' or '^docker,lo'."
    )
    TORCH_NCCL_ASYNC_ERROR_HANDLING: Literal[0, 1, 2, 3] | None = Field(
        None, description="What a failed or timed-out NCCL collective does: 0 nothing, 1 abort the communicators "
        "and end the process, 2 abort the communicators only, 3 end the process without aborting them."
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


class TrainingSpec(_Strict):
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; exclusive with `epochs`.")
    epochs: float | None = Field(None, gt=0, description="Passes over the dataset; exclusive with `max_steps`.")
    learning_rate: float = Field(2e-4, ge=0.0, le=1.0, description="Peak learning rate (0 trains nothing, on purpose).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps before the cosine decay.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay on the adapter weights.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per process per micro-step.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    max_seq_len: int = Field(512, ge=8, le=1_048_576, description="Longest tokenized sequence.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    seed: int = Field(0, description="Seed of LoRA init, data order and dropout.")
    nodes: int = Field(1, ge=1, le=4096, description="Machines (torchrun --nnodes).")
    processes_per_node: int = Field(1, ge=1, le=64, description="Processes per machine, one per GPU (--nproc-per-node).")
    sharding: Literal["full", "hybrid", "none"] = Field(
        "full", description="full: FSDP2 across all ranks; hybrid: shard in a node, replicate across nodes; none: replicate."
    )
    launcher: Literal["local", "k8s"] = Field("local", description="local: torchrun subprocesses; k8s: a Kubernetes Job.")
    hardware: str = Field("cpu-2vcpu", description="Pricing-catalog key of one training device (GPU or CPU host).")
    log_every: int = Field(10, ge=1, description="Log and stream metrics every this many steps.")
    profiling: ProfilingSpec = Field(ProfilingSpec(), description="torch.profiler traces and their triage (off by default).")
    diagnostics: DiagnosticsSpec = Field(DiagnosticsSpec(), description="Node diagnostics run at the end of training.")
    distributed_env: DistributedEnvSpec = Field(
        DistributedEnvSpec(), description="NCCL / torch.distributed environment variables exported to every rank."
    )

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingSpec:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of `max_steps` or `epochs`")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.world_size * self.gradient_accumulation_steps


# --------------------------------------------------------------------------- evaluation


class GateSpec(_Strict):
    """Blocking thresholds for promotion (common practice: 0.8 / 0 / 30 s / 0.03)."""

    min_score: float = Field(0.8, ge=0.0, le=1.0, description="Candidate score floor.")
    max_regression_vs_base: float = Field(0.03, ge=0.0, le=1.0, description="Allowed drop of candidate below base.")
    max_empty_output_rate: float = Field(0.0, ge=0.0, le=1.0, description="Largest allowed share of empty outputs.")
    max_avg_latency_s: float = Field(30.0, gt=0.0, description="Largest allowed average latency per item.")
    min_items: int = Field(20, ge=1, description="Fewer scored items than this is INCONCLUSIVE.")


class SuiteSpec(_Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="Suite name (lowercase slug).")
    source: str = Field("heldout", description="`heldout` (the data split) or a JSONL file of items.")
    scorer: Literal["exact_match", "normalized_exact_match"] = Field(
        "exact_match", description="Per-item scorer (see evaluation/scorers.py)."
    )
    max_new_tokens: int = Field(64, ge=1, description="Generation length limit for every model scored.")
    batch_size: int = Field(64, ge=1, description="Items per generation batch (local models).")


class EvaluationSpec(_Strict):
    suites: list[SuiteSpec] = Field(min_length=1, description="Evaluation suites; the first is the primary one.")
    gate: GateSpec = GateSpec()
    evaluate_teacher: bool = Field(True, description="Also score the teacher, as the ceiling the student aims at.")

    @field_validator("suites")
    @classmethod
    def _unique(cls, v: list[SuiteSpec]) -> list[SuiteSpec]:
        names = [s.name for s in v]
        if len(set(names)) != len(names):
            raise ValueError(f"suite names must be unique, got {names}")
        return v


# --------------------------------------------------------------------------- cost, schedule


class CostSpec(_Strict):
    catalog: str = Field("campaigns/pricing/catalog.yaml", description="Pricing catalog file (dated entries with sources).")
    overrides: dict[str, float] = Field(
        default_factory=dict, description="Price overrides by catalog key (USD per the entry's unit)."
    )
    budget_usd: float | None = Field(None, gt=0, description="Stop spending beyond this many dollars.")


class ScheduleSpec(_Strict):
    cron: str = Field(description="Cron expression, e.g. '0 3 * * *'.")
    timezone: str = Field("UTC", description="IANA timezone of the cron expression.")
    enabled: bool = Field(False, description="Start the schedule switched on.")

    @field_validator("cron")
    @classmethod
    def _five_fields(cls, v: str) -> str:
        if len(v.split()) != 5:
            raise ValueError(f"a cron expression has 5 fields (minute hour day month weekday), got {v!r}")
        return v


# --------------------------------------------------------------------------- campaign


class CampaignSpec(_Strict):
    """One distillation / fine-tune campaign."""

    name: Annotated[str, Field(description="Slug: lowercase letters, digits, underscores; the asset key prefix.")]
    description: str = Field("", description="Free text shown in the UI.")
    teacher: TeacherSpec
    student: StudentSpec
    data: DataSpec
    training: TrainingSpec
    evaluation: EvaluationSpec
    cost: CostSpec = CostSpec()
    schedule: ScheduleSpec | None = None

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not SLUG.match(v):
            raise ValueError(
                f"must be a slug (lowercase letter first, then lowercase letters, digits or '_', at most 63), got {v!r}"
            )
        return v
