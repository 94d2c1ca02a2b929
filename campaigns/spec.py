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

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not SLUG.match(v):
            raise ValueError(
                f"must be a slug (lowercase letter first, then lowercase letters, digits or '_', at most 63), got {v!r}"
            )
        return v
