"""The campaign spec: one YAML file, validated by these pydantic models.

Every field is documented where it is declared. Unknown keys are errors (``extra="forbid"``),
so a typo never silently falls back to a default. This module imports only pydantic (and the
stdlib-only ``campaign_orchestrator.paths``): the trainer, the evaluation code and the Dagster code
location all read the same models.

Model references: a model path is either a filesystem path (absolute, or relative to the
campaign's project directory, ``CampaignSpec.path``) or ``@demo/<name>``, a model built by the project's own
``demo`` step under the artifact root (see ``campaign_orchestrator/demo/``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from campaign_orchestrator import paths

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
    requests_per_minute: int | None = Field(
        None, ge=1, description="`openai` backend: client-side request rate limit (the provider's RPM quota)."
    )
    tokens_per_minute: int | None = Field(
        None, ge=1, description="`openai` backend: client-side token rate limit (prompt + max_new_tokens per request)."
    )
    request_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="`openai` backend: seconds one request may take before it is retried."
    )
    max_retries: int = Field(
        6, ge=0, le=50, description="`openai` backend: retries per request on 429, 5xx, timeouts (backoff, Retry-After)."
    )
    price: str | None = Field(
        None,
        description="`openai` backend: pricing-catalog key (unit million-tokens) of the API; cost = tokens x price. "
        "Self-hosted teachers are priced by `hardware` instead.",
    )
    hardware: str = Field("cpu-2vcpu", description="Pricing-catalog key of the hardware a self-hosted teacher runs on.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="`vllm` backend: GPUs per model (vllm.LLM tensor_parallel_size); GPU-hours count this many."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="`vllm` backend: extra vllm.LLM keyword arguments (e.g. gpu_memory_utilization, max_model_len, "
        "dtype); part of the cache key.",
    )

    @model_validator(mode="after")
    def _openai_needs_url(self) -> TeacherSpec:
        if self.backend == "openai" and not self.base_url:
            raise ValueError("backend 'openai' needs `base_url` (e.g. http://localhost:8000/v1)")
        if self.chat and self.backend == "transformers":
            raise ValueError("`chat: true` needs backend 'openai' or 'vllm' (the transformers backend sends raw prompts)")
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise ValueError("`api_key_env` is the *name* of an environment variable (e.g. OPENAI_API_KEY), not the key")
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
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = Field(
        "auto",
        description="Attention kernel for training. auto: sdpa on GPU; on CPU eager for sequences up to 512 "
        "tokens (PyTorch's CPU flash-attention backward is several times slower there), sdpa beyond.",
    )


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
    scorer: Literal["exact_match", "normalized_exact_match"] | None = Field(
        None, description="Keep only completions the task's scorer rates >= `min_score` against the prompt's reference."
    )
    min_score: float = Field(1.0, ge=0.0, le=1.0, description="Threshold for `scorer`.")
    min_chars: int = Field(1, ge=0, description="Drop completions shorter than this (after stripping).")
    max_chars: int | None = Field(None, ge=1, description="Drop completions longer than this.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Drop completions longer than this many tokens.")

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


class DatasetSpec(_Strict):
    """How the tokenized_dataset stage turns the distillation set into packed training rows.

    The rows are tokenized once with the student's tokenizer and stored as sharded Parquet;
    every setting here is part of the stage's content key (a change builds a new dataset).
    """

    template: Literal["auto", "chat", "plain"] = Field(
        "auto", description="auto: the student tokenizer's chat template when it has one, else plain "
        "`<bos> prompt completion <eos>`; chat: require the chat template; plain: never use it."
    )
    train_on_prompt: bool = Field(
        False, description="Loss on every token (prompt included) instead of the completion/assistant tokens only."
    )
    packing: bool = Field(
        True, description="Best-fit-decreasing packing of several examples into rows of training.max_seq_len "
        "(position_ids restart per example, so attention never crosses examples); false: one example per row."
    )
    padding: Literal["free", "longest", "max_length"] = Field(
        "free", description="How the trainer batches rows. free: a micro-batch's rows concatenated into one "
        "sequence, no padding (right for every attention kernel, flash-attention included); longest: pad to the "
        "longest row; max_length: pad every row to training.max_seq_len (static shapes)."
    )
    too_long: Literal["drop", "truncate"] = Field(
        "drop", description="Examples longer than training.max_seq_len: drop them, or keep their first "
        "max_seq_len tokens (dropped anyway if no completion token is left). Both are counted."
    )
    shard_size_mb: float = Field(256.0, gt=0, le=65536, description="Target size of one Parquet shard (MiB).")
    validation_fraction: float = Field(
        0.02, ge=0.0, lt=1.0, description="Share of examples held out as a validation split, chosen by a seeded "
        "hash of the example id (never by packed row), so an example keeps its side across rebuilds."
    )
    split_seed: int = Field(0, ge=0, description="Seed of the train/validation id hash.")
    extra_sources: list[str] = Field(
        default_factory=list, description="More prompt/completion (`prompt`, `completion`) or conversational "
        "(`messages`) data added to the distillation set: JSONL/JSON/Parquet/CSV files, globs, or directories "
        "saved with `Dataset.save_to_disk`; relative to the repository root. Optional `id` column."
    )
    num_proc: int | None = Field(
        None, ge=1, le=512, description="Tokenizer processes (datasets `map` num_proc); default: every core, for "
        "inputs large enough to pay for the process start-up."
    )


# --------------------------------------------------------------------------- training


def _s3_uri(v: str | None) -> str | None:
    if v is not None and not re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$", v):
        raise ValueError(f"expected s3://bucket[/prefix], got {v!r}")
    return v


S3Uri = Annotated[str | None, AfterValidator(_s3_uri)]


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
    upload_url: S3Uri = Field(
        None,
        description="Also copy the profile directory (traces, diagnostics, triage) to s3://bucket/prefix/<campaign>/"
        "<run key>/ (credentials and endpoint from the standard AWS environment, never from this file).",
    )


class CheckpointSpec(_Strict):
    """Resumable checkpoints: adapter weights (never the frozen base), optimizer, step, RNG, data position.

    Every start of the trainer is a resume: if a complete checkpoint exists, training continues from it.
    """

    every_steps: int | None = Field(50, ge=1, description="Write a checkpoint every N optimizer steps (None: never by step).")
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

class DistillationSpec(_Strict):
    """What the student learns from the teacher."""

    loss: Literal["sequence", "logits"] = Field(
        "sequence",
        description="sequence: cross-entropy on the teacher's text; logits: forward KL against the teacher's stored "
        "top-k log-probabilities (remaining mass as one tail bucket) mixed with cross-entropy. `logits` needs "
        "teacher.sampling.logprobs and a teacher that shares the student's tokenizer.",
    )
    kl_weight: float = Field(
        0.5, ge=0.0, le=1.0, description="`logits`: loss = (1 - kl_weight) * CE + kl_weight * KL (each exact per token)."
    )
    teacher_tokenizer: str | None = Field(
        None,
        description="`logits` with a remote teacher (openai/vllm served name): a directory holding the teacher's "
        "tokenizer, checked against the student's before training starts. Local teachers are checked directly.",
    )


class TrainingSpec(_Strict):
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; exclusive with `epochs`.")
    epochs: float | None = Field(None, gt=0, description="Passes over the dataset; exclusive with `max_steps`.")
    learning_rate: float = Field(2e-4, ge=0.0, le=1.0, description="Peak learning rate (0 trains nothing, on purpose).")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps before the cosine decay.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay on the adapter weights.")
    micro_batch_size: int = Field(8, ge=1, description="Rows per process per micro-step (a packed row holds several examples).")
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
    activation_checkpointing: bool = Field(False, description="Recompute decoder-layer activations in backward (less memory).")
    collective_timeout_s: int = Field(
        600, ge=10, le=86_400,
        description="Process-group timeout: a rank that dies or hangs makes every other rank fail after at most this long.",
    )
    eval_rows: int = Field(
        64, ge=0, description="Rows of the validation split (without one: the first training rows) whose loss is measured "
                        "before and after training (eval mode)."
    )
    export_merged: bool = Field(
        False, description="Also write the base with the adapter merged in (compute dtype) next to the adapter."
    )
    checkpoint: CheckpointSpec = CheckpointSpec()
    distillation: DistillationSpec = DistillationSpec()

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


GateRule = Literal[
    "max_error_rate",
    "min_items",
    "min_score",
    "max_regression_vs_base",
    "max_category_regression",
    "max_empty_output_rate",
    "max_p95_latency_s",
    "max_avg_latency_s",
]


class GateSpec(_Strict):
    """Promotion rules, judged per suite on the paired candidate/base results.

    ``evaluation.gate`` applies to every suite; a suite's own ``gate`` overrides only the fields
    it sets. A rule set to ``null`` is off. Interval rules compare the paired confidence interval
    of candidate − base with the allowed drop: BREACH when the whole interval is beyond it, PASS
    when the whole interval is within it, INSUFFICIENT_EVIDENCE otherwise.
    """

    min_score: float | None = Field(
        0.8, ge=0.0, le=1.0,
        description="Floor on the candidate's mean score (point estimate; the report shows its interval too).",
    )
    max_regression_vs_base: float | None = Field(
        0.03, ge=0.0, le=1.0,
        description="Allowed absolute drop of candidate below base, judged on the paired interval of candidate − base.",
    )
    max_category_regression: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Per-category non-regression: the same interval rule in every category with at least "
                    "`min_category_items` paired items (smaller categories are reported, not judged).",
    )
    min_category_items: int = Field(10, ge=1, description="Categories with fewer paired items are not judged.")
    max_empty_output_rate: float | None = Field(
        0.0, ge=0.0, le=1.0, description="Largest share of the candidate's answered items that may be empty."
    )
    max_p95_latency_s: float | None = Field(
        30.0, gt=0.0,
        description="Largest 95th-percentile latency of the candidate's answered items, in seconds (an endpoint: "
                    "per request; local generation: the wall time of the item's batch).",
    )
    max_avg_latency_s: float | None = Field(
        None, gt=0.0, description="Largest mean latency of the candidate's answered items, in seconds."
    )
    min_items: int = Field(20, ge=1, description="Fewer paired, scored items than this is INCONCLUSIVE.")
    max_error_rate: float = Field(
        0.05, ge=0.0, le=1.0,
        description="Largest share of items either model may fail on the serving side (timeouts, crashes); "
                    "errors are never scored as wrong answers, and more of them make the suite INCONCLUSIVE.",
    )
    advisory: list[GateRule] = Field(
        default_factory=list, description="Rules reported with their numbers but not blocking promotion."
    )


class SuiteSpec(_Strict):
    """A set of items, a scorer and the generation settings every compared model answers with."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="Suite name (a slug), unique in the campaign.")
    source: str = Field(
        "heldout",
        description="`heldout` (the data split) or a JSONL file of {id, prompt, reference, category}, "
                    "relative to the repository root or absolute.",
    )
    scorer: Literal["exact_match", "normalized_exact_match", "label_accuracy", "rouge_l", "regex", "json_schema"] = Field(
        "exact_match",
        description="exact_match; normalized_exact_match (SQuAD normalization); label_accuracy (answer must be one "
                    "of `labels`); rouge_l (LCS F1, continuous); regex (output fully matches `pattern`); "
                    "json_schema (output is JSON valid under `json_schema`).",
    )
    labels: list[str] | None = Field(None, min_length=2, description="`label_accuracy`: the allowed labels.")
    pattern: str | None = Field(None, description="`regex`: the regular expression the whole output must match.")
    json_schema: dict | str | None = Field(
        None, description="`json_schema`: the schema inline, or a JSON file path relative to the repository root."
    )
    max_new_tokens: int = Field(64, ge=1, description="Completion length limit (greedy decoding for every model).")
    batch_size: int = Field(64, ge=1, description="Prompts per local generation batch.")
    tier: Literal["blocking", "advisory"] = Field(
        "blocking", description="advisory: the suite is scored and reported but never blocks promotion."
    )
    gate: GateSpec | None = Field(None, description="Overrides of `evaluation.gate` for this suite (only the fields set).")

    @model_validator(mode="after")
    def _scorer_needs(self) -> SuiteSpec:
        need = {"label_accuracy": ("labels", self.labels), "regex": ("pattern", self.pattern),
                "json_schema": ("json_schema", self.json_schema)}
        if self.scorer in need and need[self.scorer][1] is None:
            raise ValueError(f"scorer {self.scorer!r} needs `{need[self.scorer][0]}`")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"`pattern` is not a valid regular expression: {e}") from e
        return self


class StatisticsSpec(_Strict):
    """How intervals are computed (the report names the method)."""

    interval: Literal["paired_bootstrap", "paired_t"] = Field(
        "paired_bootstrap",
        description="Interval of the paired per-item difference candidate − base: percentile paired bootstrap, "
                    "or Student's t on the per-item differences.",
    )
    confidence: float = Field(0.95, ge=0.5, le=0.999, description="Confidence level of every interval.")
    resamples: int = Field(10_000, ge=100, le=1_000_000, description="Bootstrap resamples.")
    seed: int = Field(0, ge=0, description="Bootstrap seed: the same items and seed give the same intervals.")


class EndpointSpec(_Strict):
    """An OpenAI-compatible server (e.g. `vllm serve BASE --enable-lora`) that answers for both models."""

    base_url: str = Field(description="The endpoint, e.g. http://host:8000/v1.")
    base_model: str = Field(description="Served name of the base model (`model` in the request).")
    candidate_model: str | None = Field(
        None, description="Served name of the candidate (a LoRA module name, `--lora-modules NAME=PATH`)."
    )
    load_adapter: bool = Field(
        False,
        description="Load the candidate's adapter into the server first (vLLM `POST /v1/load_lora_adapter`, needs "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and the adapter path visible to the server); it is served "
                    "as `<campaign>-<candidate key>`, so the scored model is exactly this candidate.",
    )
    api_key_env: str | None = Field(
        None, description="Name of the environment variable holding the API key (never the key itself)."
    )
    max_concurrency: int = Field(8, ge=1, le=1024, description="Requests in flight per model.")
    timeout_s: float = Field(60.0, gt=0.0, description="Per-request timeout; a timeout is an item error, not a wrong answer.")

    @model_validator(mode="after")
    def _candidate_named(self) -> EndpointSpec:
        if self.candidate_model is None and not self.load_adapter:
            raise ValueError("set `candidate_model` (the served LoRA name) or `load_adapter: true`")
        return self


class EvaluationSpec(_Strict):
    suites: list[SuiteSpec] = Field(min_length=1, description="Suites; the first is the campaign's primary score.")
    gate: GateSpec = Field(GateSpec(), description="Rules for every suite (a suite's `gate` overrides fields).")
    statistics: StatisticsSpec = StatisticsSpec()
    backend: Literal["local", "openai"] = Field(
        "local",
        description="local: base and base + adapter loaded here with transformers/PEFT; openai: both answered by "
                    "`endpoint` (the serving path, scored on the same items).",
    )
    endpoint: EndpointSpec | None = Field(None, description="`openai` backend: the server.")
    requires_human_review: bool = Field(
        False,
        description="Promotion also waits for an approval recorded against this exact candidate "
                    "(`campaign approve` or the `<campaign>_approve` job).",
    )
    evaluate_teacher: bool = Field(True, description="Also score the teacher, as the ceiling the student aims at.")

    @field_validator("suites")
    @classmethod
    def _unique(cls, v: list[SuiteSpec]) -> list[SuiteSpec]:
        names = [s.name for s in v]
        if len(set(names)) != len(names):
            raise ValueError(f"suite names must be unique, got {names}")
        return v

    @model_validator(mode="after")
    def _endpoint_for_openai(self) -> EvaluationSpec:
        if self.backend == "openai" and self.endpoint is None:
            raise ValueError("backend 'openai' needs `endpoint` (base_url, base_model, candidate_model)")
        return self

    def gate_for(self, suite: SuiteSpec) -> GateSpec:
        """The campaign-wide gate with the suite's own settings laid over it."""
        if suite.gate is None:
            return self.gate
        return self.gate.model_copy(update={f: getattr(suite.gate, f) for f in suite.gate.model_fields_set})


# --------------------------------------------------------------------------- cost, schedule


class PriceOverride(_Strict):
    """A campaign's own price for a catalog entry (a negotiated contract, a reserved instance)."""

    usd: float | None = Field(None, ge=0, description="On-demand USD per hour (hourly entries).")
    spot_usd: float | None = Field(None, ge=0, description="Spot USD per hour (hourly entries).")
    input_usd: float | None = Field(None, ge=0, description="USD per million input tokens (API entries).")
    output_usd: float | None = Field(None, ge=0, description="USD per million output tokens (API entries).")
    batch_discount: float | None = Field(None, ge=0, lt=1, description="Fraction off with a batch API (0.5 = half price).")
    source: str | None = Field(None, description="Where this price comes from (shown in the ledger and reports).")


class PlannerSpec(_Strict):
    """Assumptions of `campaign plan` and of the budget checks made before each stage. Hardware
    figures (peak FLOP/s, bandwidth, overheads) come from the pricing catalog's `perf` block."""

    mfu: float = Field(0.35, gt=0, le=1, description="Share of the device's peak FLOP/s training reaches.")
    generation_mfu: float = Field(0.5, gt=0, le=1, description="Share of peak FLOP/s prefill reaches.")
    completion_fill: float = Field(
        1.0, gt=0, le=1,
        description="Expected completion length as a fraction of max_new_tokens (1.0 plans for the longest answers).")
    memory_headroom: float = Field(0.9, gt=0, le=1, description="Usable fraction of device memory when judging fit.")


class CostSpec(_Strict):
    """Prices, budgets and planning assumptions of a campaign."""

    catalog: str | None = Field(
        None, description="Pricing catalog file (dated entries with sources); default: the catalog shipped with the "
                          "project (campaigns/pricing/catalog.yaml).")
    catalog_version: str | None = Field(
        None, description="Pin the catalog `version` this campaign was planned with; a different version is an error.")
    overrides: dict[str, float | PriceOverride] = Field(
        default_factory=dict,
        description="Price overrides by catalog key: a number (USD per the entry's unit) or a mapping of price fields.")
    pricing_tier: Literal["on_demand", "spot"] = Field("on_demand", description="Which hourly price hardware is billed at.")
    teacher_batch_api: bool = Field(False, description="An API teacher is billed at its batch price (catalog batch_discount).")
    budget_usd: float | None = Field(
        None, gt=0, description="Stop spending beyond this many dollars (spend read from the cost ledger).")
    budget_scope: Literal["campaign", "run"] = Field(
        "campaign", description="campaign: budgets cover every run of the campaign; run: each run on its own.")
    stage_budgets_usd: dict[Literal["teacher_generations", "student_adapter", "evaluation"], float] = Field(
        default_factory=dict, description="Optional per-stage budgets in USD, e.g. {teacher_generations: 50}.")
    check_estimates: bool = Field(
        True, description="Before a stage starts, refuse it when the planner's estimate exceeds the budget left.")
    planner: PlannerSpec = PlannerSpec()

    @field_validator("stage_budgets_usd")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: x for k, x in v.items() if x <= 0}
        if bad:
            raise ValueError(f"stage budgets must be > 0 USD, got {bad}")
        return v

    def price_overrides(self) -> dict[str, float | dict]:
        """Overrides in the pricing catalog's form (numbers, or dicts without unset fields)."""
        return {k: v if isinstance(v, int | float) else v.model_dump(exclude_none=True) for k, v in self.overrides.items()}


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


# --------------------------------------------------------------------------- kubernetes

K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # DNS-1123 label (namespaces, claims, accounts)
K8S_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # DNS-1123 subdomain (secrets, priority classes)
K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
K8S_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
K8S_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names that hold credentials: their values belong in a Kubernetes Secret (`secret_env`), never in the spec.
SECRET_LIKE_ENV = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL", re.I)


def _k8s_name(v: str | None, what: str, pattern: re.Pattern = K8S_NAME, max_len: int = 63) -> str | None:
    if v is not None and (len(v) > max_len or not pattern.match(v)):
        raise ValueError(f"{what} must be a Kubernetes name (lowercase letters, digits, '-'; at most {max_len}), got {v!r}")
    return v


def _quantity(v: str | None, what: str) -> str | None:
    if v is not None and not K8S_QUANTITY.match(v):
        raise ValueError(f"{what} must be a Kubernetes quantity such as '64Gi', '500m' or '32', got {v!r}")
    return v


def _labels(v: dict[str, str]) -> dict[str, str]:
    for k, val in v.items():
        if len(k.split("/")[-1]) > 63 or not K8S_LABEL_KEY.match(k):
            raise ValueError(f"label key {k!r} is not a valid Kubernetes label key")
        if len(val) > 63 or not K8S_LABEL_VALUE.match(val):
            raise ValueError(f"label {k}={val!r}: values are at most 63 letters, digits, '-', '_', '.'")
    return v


class TolerationSpec(_Strict):
    """One Kubernetes toleration (e.g. of the ``nvidia.com/gpu`` taint on GPU nodes)."""

    key: str | None = Field(None, description="Taint key; empty with operator Exists tolerates every taint.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal: match `value`; Exists: any value.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty tolerates all effects.")
    toleration_seconds: int | None = Field(None, ge=0, description="NoExecute only: how long the pod stays bound.")


class SecretEnvSpec(_Strict):
    """An environment variable read from a Kubernetes Secret (the value never appears in manifests)."""

    name: str = Field(description="Environment variable name in the trainer container, e.g. HF_TOKEN.")
    secret: str = Field(description="Name of the Kubernetes Secret in the job's namespace.")
    key: str = Field(description="Key inside the Secret.")
    optional: bool = Field(False, description="Start even when the Secret or key is missing.")

    @field_validator("name")
    @classmethod
    def _env(cls, v: str) -> str:
        if not ENV_NAME.match(v):
            raise ValueError(f"not an environment variable name: {v!r}")
        return v

    @field_validator("secret")
    @classmethod
    def _secret(cls, v: str) -> str:
        return _k8s_name(v, "secret", K8S_SUBDOMAIN, 253)


class SecretVolumeSpec(_Strict):
    """A Kubernetes Secret mounted read-only as files (e.g. a netrc or a cloud credentials file)."""

    secret: str = Field(description="Name of the Kubernetes Secret in the job's namespace.")
    mount_path: str = Field(description="Absolute directory in the container where the Secret's keys appear as files.")

    @field_validator("secret")
    @classmethod
    def _secret(cls, v: str) -> str:
        return _k8s_name(v, "secret", K8S_SUBDOMAIN, 253)

    @field_validator("mount_path")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"mount_path must be absolute, got {v!r}")
        return v


class VolumeClaimSpec(_Strict):
    """A PersistentVolumeClaim mounted into every training pod."""

    claim: str = Field(description="Name of the PersistentVolumeClaim (ReadWriteMany when several nodes write).")
    mount_path: str = Field(description="Absolute directory where the claim is mounted.")
    read_only: bool = Field(False, description="Mount read-only (e.g. a shared model cache).")
    sub_path: str | None = Field(None, description="Mount only this sub-directory of the volume.")

    @field_validator("claim")
    @classmethod
    def _claim(cls, v: str) -> str:
        return _k8s_name(v, "claim", K8S_SUBDOMAIN, 253)

    @field_validator("mount_path")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"mount_path must be absolute, got {v!r}")
        return v.rstrip("/") or "/"


class KubernetesSpec(_Strict):
    """Where and how `training.launcher: k8s` runs the trainer: one pod per node, one process per GPU.

    Kubernetes objects passed through verbatim (``affinity``) use Kubernetes' own field names and
    are checked against the Kubernetes schema when the manifests are rendered. Credentials are
    only ever *named* here (``secret_env``, ``secret_volumes``, ``image_pull_secrets``).
    """

    workload: Literal["indexed_job", "pytorchjob"] = Field(
        "indexed_job", description="indexed_job: a batch/v1 Indexed Job + headless Service (no operator needed);"
                                   " pytorchjob: a Kubeflow PyTorchJob (needs the training operator).")
    namespace: str = Field("default", description="Namespace the training objects are created in.")
    image: str = Field(description="Trainer image (deploy/Dockerfile), ideally pinned by tag or digest.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Kubernetes imagePullPolicy of the training pods."
    )
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secrets for a private registry.")
    service_account: str | None = Field(None, description="ServiceAccount of the training pods.")
    priority_class: str | None = Field(None, description="PriorityClass of the training pods (preemption order).")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods require, e.g. nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3.")
    tolerations: list[TolerationSpec] = Field(default_factory=list, description="Taints the pods tolerate.")
    affinity: dict[str, Any] | None = Field(
        None, description="A Kubernetes Affinity object (nodeAffinity / podAffinity / podAntiAffinity), verbatim.")
    gpu_resource: str | None = Field(
        "nvidia.com/gpu", description="Extended resource requested per process (`processes_per_node` of them per"
                                      " pod); null runs CPU-only pods (gloo), e.g. on a test cluster.")
    cpu: str | None = Field(None, description="CPU request and limit per pod, e.g. '96'.")
    memory: str | None = Field(None, description="Memory request and limit per pod, e.g. '1600Gi'.")
    shm_size: str = Field("64Gi", description="Size limit of the in-memory /dev/shm volume (NCCL, data loader workers).")
    env: dict[str, str] = Field(
        default_factory=dict, description="Plain environment variables, e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG."
                                          " Credentials go in `secret_env`.")
    secret_env: list[SecretEnvSpec] = Field(default_factory=list, description="Environment variables from Secrets.")
    secret_volumes: list[SecretVolumeSpec] = Field(default_factory=list, description="Secrets mounted as files.")
    artifacts: VolumeClaimSpec = Field(
        default_factory=lambda: VolumeClaimSpec(claim="campaign-artifacts", mount_path="/app/artifacts"),
        description="The shared volume holding the artifact root, mounted at the same path in the Dagster run"
                    " pod and the training pods (the trainer reads and writes the paths Dagster gives it).")
    volumes: list[VolumeClaimSpec] = Field(default_factory=list, description="More claims, e.g. a read-only model cache.")
    working_dir: str = Field("/app", description="Working directory of the trainer container (the image's code root).")
    rendezvous_port: int = Field(29500, ge=1024, le=65535, description="c10d rendezvous / master port on node 0.")
    backoff_limit: int = Field(0, ge=0, le=100, description="Job retries before it is marked failed.")
    active_deadline_seconds: int | None = Field(
        None, ge=1, description="Kubernetes stops the job after this many seconds of running.")
    ttl_seconds_after_finished: int | None = Field(
        3600, ge=0, description="Kubernetes deletes a finished job after this long (a backstop: the launcher cleans up).")
    termination_grace_period_seconds: int = Field(30, ge=0, description="Time a pod gets to exit after SIGTERM.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels on every object (team, cost centre).")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations on the pods.")

    @field_validator("namespace", "service_account")
    @classmethod
    def _names(cls, v: str | None, info) -> str | None:
        return _k8s_name(v, info.field_name)

    @field_validator("priority_class")
    @classmethod
    def _subdomain(cls, v: str | None) -> str | None:
        return _k8s_name(v, "priority_class", K8S_SUBDOMAIN, 253)

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, v: list[str]) -> list[str]:
        for s in v:
            _k8s_name(s, "image_pull_secrets entry", K8S_SUBDOMAIN, 253)
        return v

    @field_validator("cpu", "memory", "shm_size")
    @classmethod
    def _quantities(cls, v: str | None, info) -> str | None:
        return _quantity(v, info.field_name)

    @field_validator("labels")
    @classmethod
    def _label_map(cls, v: dict[str, str]) -> dict[str, str]:
        return _labels(v)

    @field_validator("affinity")
    @classmethod
    def _affinity(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        allowed = {"nodeAffinity", "podAffinity", "podAntiAffinity"}
        if v is not None and not set(v) <= allowed:
            raise ValueError(f"affinity takes only {sorted(allowed)} (Kubernetes field names), got {sorted(v)}")
        return v

    @field_validator("env")
    @classmethod
    def _plain_env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not ENV_NAME.match(name):
                raise ValueError(f"not an environment variable name: {name!r}")
            if SECRET_LIKE_ENV.search(name):
                raise ValueError(
                    f"env {name} looks like a credential: store it in a Kubernetes Secret and list it under"
                    f" `secret_env` (name: {name}, secret: <secret name>, key: <key>) instead of writing its value here")
        return v

    @model_validator(mode="after")
    def _unique_mounts(self) -> KubernetesSpec:
        paths = ["/dev/shm", self.artifacts.mount_path] + [v.mount_path for v in self.volumes] + \
                [s.mount_path for s in self.secret_volumes]
        dup = sorted({p for p in paths if paths.count(p) > 1})
        if dup:
            raise ValueError(f"two volumes are mounted at the same path: {dup}")
        names = [e.name for e in self.secret_env]
        clash = sorted(set(names) & set(self.env) | {n for n in names if names.count(n) > 1})
        if clash:
            raise ValueError(f"environment variables defined twice (env / secret_env): {clash}")
        return self
# --------------------------------------------------------------------------- automation


class NewDataSpec(_Strict):
    """New-data sensor ``<campaign>_new_data``: watches ``data.source`` (local glob or ``s3://`` prefix).

    Files are identified by content hash: a touched, renamed or re-uploaded file with the same
    content is not new data. The first evaluation records the files already there as the
    baseline; files that appear later are new data. A run (``prompts`` and everything
    downstream) is requested once the new rows pass every threshold set here.
    """

    enabled: bool = Field(False, description="Start the sensor switched on (it can always be toggled in the UI).")
    min_new_rows: int = Field(1, ge=1, description="Request a run only once at least this many new rows are pending.")
    min_new_fraction: float | None = Field(
        None, gt=0.0, description="And only once new rows / rows already used reach this fraction (e.g. 0.1); unset: no fraction rule."
    )
    interval_s: int = Field(60, ge=5, le=86_400, description="Seconds between two evaluations of the sensor.")


class ModelChangeSpec(_Strict):
    """Model-change sensor ``<campaign>_model_change``.

    Every stage carries a code version derived from its slice of the spec (teacher identity,
    including a path model's weights hash, for generations; student base identity for
    tokenizing; training settings for the adapter; ...). A stage whose latest materialization
    has another code version, or was made from an older version of an upstream asset, is stale;
    the sensor re-materializes the stale stages and everything downstream of them in one run,
    nothing upstream.
    """

    enabled: bool = Field(False, description="Start the sensor switched on.")
    interval_s: int = Field(60, ge=5, le=86_400, description="Seconds between two evaluations of the sensor.")


class DriftSpec(_Strict):
    """Drift schedule ``<campaign>_drift``: re-evaluates the promoted model on the freshest held-out data.

    A retraining run (``prompts`` and everything downstream, on the freshest data) is requested by
    the ``<campaign>_drift_retrain`` sensor when the promoted model scores below
    ``evaluation.gate.min_score`` or more than ``max_drop`` below its own promotion-time score.
    """

    enabled: bool = Field(False, description="Start the drift schedule and its retraining sensor switched on.")
    cron: str = Field("0 4 * * *", description="Cron expression of the re-evaluation, e.g. '0 4 * * *'.")
    timezone: str = Field("UTC", description="IANA timezone of the cron expression.")
    max_drop: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Allowed drop below the promotion-time score; unset: `evaluation.gate.max_regression_vs_base`.",
    )

    @field_validator("cron")
    @classmethod
    def _five_fields(cls, v: str) -> str:
        if len(v.split()) != 5:
            raise ValueError(f"a cron expression has 5 fields (minute hour day month weekday), got {v!r}")
        return v


class AutomationSpec(_Strict):
    """What re-runs the campaign by itself. Every sensor exists (stopped) even when not enabled here."""

    new_data: NewDataSpec = Field(default_factory=NewDataSpec, description="New prompt files trigger a run.")
    model_change: ModelChangeSpec = Field(
        default_factory=ModelChangeSpec, description="A new teacher, student base or training setting re-runs what it affects."
    )
    drift: DriftSpec = Field(default_factory=DriftSpec, description="Scheduled re-evaluation of the promoted model.")


# --------------------------------------------------------------------------- campaign


class CampaignSpec(_Strict):
    """One distillation / fine-tune campaign."""

    name: Annotated[str, Field(description="Slug: lowercase letters, digits, underscores; the asset key prefix.")]
    description: str = Field("", description="Free text shown in the UI.")
    teacher: TeacherSpec
    student: StudentSpec
    data: DataSpec
    training: TrainingSpec
    dataset: DatasetSpec = DatasetSpec()
    evaluation: EvaluationSpec
    cost: CostSpec = CostSpec()
    schedule: ScheduleSpec | None = None
    kubernetes: KubernetesSpec | None = Field(
        None, description="Cluster settings for `training.launcher: k8s` (image, namespace, GPUs, volumes, secrets).")
    automation: AutomationSpec = Field(
        default_factory=AutomationSpec, description="Sensors and automation that re-run the campaign (all off by default)."
    )

    _project_dir: Path | None = PrivateAttr(None)

    def set_project_dir(self, path: Path) -> None:
        """Set by the loader: the project the campaign file belongs to (``campaign_orchestrator.paths``)."""
        self._project_dir = Path(path)

    @property
    def project_dir(self) -> Path:
        """What the campaign's relative paths are relative to (default: the project directory)."""
        return self._project_dir or paths.project_dir()

    def path(self, p: str | Path) -> Path:
        """A path from the campaign file (data source, suite, catalog, local model) as an absolute path."""
        return paths.resolve(p, self.project_dir)

    @model_validator(mode="after")
    def _logit_distillation_needs_logprobs(self) -> CampaignSpec:
        if self.training.distillation.loss == "logits" and self.teacher.sampling.logprobs is None:
            raise ValueError(
                "training.distillation.loss 'logits' needs the teacher's top-k log-probabilities: "
                "set teacher.sampling.logprobs (e.g. 8)"
            )
        return self

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not SLUG.match(v):
            raise ValueError(
                f"must be a slug (lowercase letter first, then lowercase letters, digits or '_', at most 63), got {v!r}"
            )
        return v

    @model_validator(mode="after")
    def _k8s_launcher_needs_cluster(self) -> CampaignSpec:
        if self.training.launcher == "k8s" and self.kubernetes is None:
            raise ValueError(
                "training.launcher is 'k8s' but the campaign has no `kubernetes:` section; add at least"
                " `kubernetes: {image: <trainer image>, namespace: <namespace>}` (see campaigns/examples/cluster.yaml)")
        if self.kubernetes is not None:
            where = {n: "kubernetes.env" for n in self.kubernetes.env}
            where.update({x.name: "kubernetes.secret_env" for x in self.kubernetes.secret_env})
            clash = sorted(n for n in self.training.distributed_env.env() if n in where)
            if clash:
                raise ValueError(
                    "environment variables set twice: "
                    + ", ".join(f"{n} (training.distributed_env and {where[n]})" for n in clash)
                    + "; set each in one place: keep it under training.distributed_env (validated, exported to every"
                    " rank by the local and the k8s launcher) and remove it from the kubernetes section")
        return self
