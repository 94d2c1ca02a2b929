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
    quant_type: Literal["nf4", "fp4"] = "nf4"
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    double_quant: bool = False


class StudentSpec(_Strict):
    """The model being fine-tuned."""

    base_model: str = Field(description="Base model path or `@demo/<name>`.")
    revision: str | None = None
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

    drop_empty: bool = True
    drop_truncated: bool = Field(True, description="Drop completions that stopped on the length limit.")
    format_regex: str | None = Field(None, description="Completions must fully match this regex.")
    dedupe: bool = Field(True, description="Drop exact duplicate (prompt, completion) pairs.")
    min_chars: int = Field(1, ge=0)
    max_chars: int | None = Field(None, ge=1)

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
    id_field: str = "id"
    prompt_field: str = "prompt"
    reference_field: str = Field("reference", description="Reference answer, used for held-out evaluation only.")
    category_field: str = "category"
    heldout: HeldoutSpec = HeldoutSpec()
    filters: FilterSpec = FilterSpec()


# --------------------------------------------------------------------------- training


class CheckpointSpec(_Strict):
    """Resumable checkpoints: adapter weights (never the frozen base), optimizer, step, RNG, data position.

    Every start of the trainer is a resume: if a complete checkpoint exists, training continues from it.
    """

    every_steps: int | None = Field(50, ge=1, description="Write a checkpoint every N optimizer steps (None: never by step).")
    every_minutes: float | None = Field(
        30.0, gt=0, description="Also write one when this many minutes passed since the last (None: never by time)."
    )
    keep_last: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept; older ones are deleted.")
    remote_uri: str | None = Field(
        None,
        description="Mirror checkpoints to object storage, e.g. s3://bucket/prefix (credentials and endpoint come from "
        "the standard AWS environment, never from this file); resume fetches from there when the local copy is gone.",
    )

    @field_validator("remote_uri")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$", v):
            raise ValueError(f"expected s3://bucket[/prefix], got {v!r}")
        return v


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
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    micro_batch_size: int = Field(8, ge=1, description="Sequences per process per micro-step.")
    gradient_accumulation_steps: int = Field(1, ge=1)
    max_seq_len: int = Field(512, ge=8, le=1_048_576, description="Longest tokenized sequence.")
    max_grad_norm: float = Field(1.0, gt=0.0)
    seed: int = 0
    nodes: int = Field(1, ge=1, le=4096, description="Machines (torchrun --nnodes).")
    processes_per_node: int = Field(1, ge=1, le=64, description="Processes per machine, one per GPU (--nproc-per-node).")
    sharding: Literal["full", "hybrid", "none"] = Field(
        "full", description="full: FSDP2 across all ranks; hybrid: shard in a node, replicate across nodes; none: replicate."
    )
    launcher: Literal["local", "k8s"] = Field("local", description="local: torchrun subprocesses; k8s: a Kubernetes Job.")
    hardware: str = Field("cpu-2vcpu", description="Pricing-catalog key of one training device (GPU or CPU host).")
    log_every: int = Field(10, ge=1)
    activation_checkpointing: bool = Field(False, description="Recompute decoder-layer activations in backward (less memory).")
    collective_timeout_s: int = Field(
        600, ge=10, le=86_400,
        description="Process-group timeout: a rank that dies or hangs makes every other rank fail after at most this long.",
    )
    eval_rows: int = Field(
        64, ge=0, description="Rows (in dataset order) whose loss is measured before and after training (eval mode)."
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


class GateSpec(_Strict):
    """Blocking thresholds for promotion (common practice: 0.8 / 0 / 30 s / 0.03)."""

    min_score: float = Field(0.8, ge=0.0, le=1.0, description="Candidate score floor.")
    max_regression_vs_base: float = Field(0.03, ge=0.0, le=1.0, description="Allowed drop of candidate below base.")
    max_empty_output_rate: float = Field(0.0, ge=0.0, le=1.0)
    max_avg_latency_s: float = Field(30.0, gt=0.0)
    min_items: int = Field(20, ge=1, description="Fewer scored items than this is INCONCLUSIVE.")


class SuiteSpec(_Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    source: str = Field("heldout", description="`heldout` (the data split) or a JSONL file of items.")
    scorer: Literal["exact_match", "normalized_exact_match"] = "exact_match"
    max_new_tokens: int = Field(64, ge=1)
    batch_size: int = Field(64, ge=1)


class EvaluationSpec(_Strict):
    suites: list[SuiteSpec] = Field(min_length=1)
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
    timezone: str = "UTC"
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
    description: str = ""
    teacher: TeacherSpec
    student: StudentSpec
    data: DataSpec
    training: TrainingSpec
    evaluation: EvaluationSpec
    cost: CostSpec = CostSpec()
    schedule: ScheduleSpec | None = None

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
