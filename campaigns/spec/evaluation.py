"""The ``evaluation:`` section: suites, the gate's rules, statistics, an endpoint backend."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from campaigns.spec.common import _Strict
from campaigns.spec.lm_eval import LmEvalSpec

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
        0.8,
        ge=0.0,
        le=1.0,
        description="Floor on the candidate's mean score (point estimate; the report shows its interval too).",
    )
    max_regression_vs_base: float | None = Field(
        0.03,
        ge=0.0,
        le=1.0,
        description="Allowed absolute drop of candidate below base, judged on the paired interval of candidate − base.",
    )
    max_category_regression: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Per-category non-regression: the same interval rule in every category with at least "
        "`min_category_items` paired items (smaller categories are reported, not judged).",
    )
    min_category_items: int = Field(10, ge=1, description="Categories with fewer paired items are not judged.")
    max_empty_output_rate: float | None = Field(
        0.0, ge=0.0, le=1.0, description="Largest share of the candidate's answered items that may be empty."
    )
    max_p95_latency_s: float | None = Field(
        30.0,
        gt=0.0,
        description="Largest 95th-percentile latency of the candidate's answered items, in seconds, measured per "
        "item (an endpoint: its request; local generation: from the start of the item's batch to its last "
        "token).",
    )
    max_avg_latency_s: float | None = Field(
        None, gt=0.0, description="Largest mean latency of the candidate's answered items, in seconds."
    )
    min_items: int = Field(20, ge=1, description="Fewer paired, scored items than this is INCONCLUSIVE.")
    max_error_rate: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
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
    scorer: Literal[
        "exact_match", "normalized_exact_match", "contains_answer", "label_accuracy", "rouge_l", "regex", "json_schema"
    ] = Field(
        "exact_match",
        description="exact_match; normalized_exact_match (SQuAD normalization); contains_answer (the normalized "
        "reference appears as whole tokens in the normalized output: for models that answer in a "
        "sentence); label_accuracy (answer must be one "
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
    gate: GateSpec | None = Field(
        None, description="Overrides of `evaluation.gate` for this suite (only the fields set)."
    )
    kind: Literal["items", "lm_eval"] = Field(
        "items",
        description="items: the project's items and scorer (the fields above); lm_eval: tasks of "
        "lm-evaluation-harness (`lm_eval`), their prompts, filters and per-document metric, "
        "judged by the same gate (`batch_size` is the harness's batch size).",
    )
    lm_eval: LmEvalSpec | None = Field(None, description="`kind: lm_eval`: the harness tasks and settings.")

    @model_validator(mode="after")
    def _kind_settings(self) -> SuiteSpec:
        if self.kind == "lm_eval":
            if self.lm_eval is None:
                raise ValueError(
                    "kind 'lm_eval' needs `lm_eval` (at least `tasks`; `include_path` for your own task files)"
                )
            unused = sorted(
                {"source", "scorer", "labels", "pattern", "json_schema", "max_new_tokens"} & self.model_fields_set
            )
            if unused:
                raise ValueError(
                    f"{unused} are not used by kind 'lm_eval' (the task YAML defines prompts, references "
                    "and metrics; generation limits go in lm_eval.gen_kwargs)"
                )
        elif self.lm_eval is not None:
            raise ValueError("`lm_eval` is set but kind is 'items'; set kind: lm_eval")
        return self

    @model_validator(mode="after")
    def _scorer_needs(self) -> SuiteSpec:
        need = {
            "label_accuracy": ("labels", self.labels),
            "regex": ("pattern", self.pattern),
            "json_schema": ("json_schema", self.json_schema),
        }
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
    timeout_s: float = Field(
        60.0, gt=0.0, description="Per-request timeout; a timeout is an item error, not a wrong answer."
    )

    @model_validator(mode="after")
    def _candidate_named(self) -> EndpointSpec:
        if self.candidate_model is None and not self.load_adapter:
            raise ValueError("set `candidate_model` (the served LoRA name) or `load_adapter: true`")
        return self


class EvaluationSpec(_Strict):
    """The suites candidate and base are scored on, the gate, its statistics, human review and serving."""

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
    score_teacher: bool = Field(
        True,
        validation_alias=AliasChoices("score_teacher", "evaluate_teacher"),
        description="Also score the teacher on the held-out items, whatever its backend (through its own backend and "
        "the generation cache, priced like its generations), as the ceiling the student aims at: the "
        "summary, metadata and dashboard show student ÷ teacher. `evaluate_teacher` is the older name.",
    )

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
