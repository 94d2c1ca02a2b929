"""An ``lm_eval`` suite's settings (``evaluation.suites[].lm_eval``) and the blocking decontamination
check of the training data against every gate suite (``data.decontamination``).

An ``lm_eval`` suite runs tasks of EleutherAI's lm-evaluation-harness (``lm_eval`` 0.4.13: task YAML
files, their prompts, filters and metrics) on the base and on the candidate with one set of harness
settings; the project's gate then judges the per-document metric, paired (``evaluation/harness.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from campaigns.object_store import is_s3_url
from campaigns.spec.common import _s3_uri, _Strict


class LmEvalSpec(_Strict):
    """Harness settings of an ``lm_eval`` suite: the same for the base and the candidate."""

    tasks: list[str] = Field(
        min_length=1,
        description="Task or group names: the harness's own task library (e.g. arc_easy, hellaswag, mmlu: "
        "`lm_eval ls tasks`) and the YAML files under `include_path`, which win on a name both define "
        "(a group's subtasks are the suite's categories unless `category_field` is set). Offline, a "
        "library task's Hugging Face dataset must be in the local datasets cache (HF_HOME).",
    )
    include_path: str | None = Field(
        None,
        description="Directory of your own task YAML files (and their local data): relative to the project, "
        "absolute, or s3://bucket/prefix/ (null: only the harness's task library). The harness runs in "
        "a content-addressed copy of it, so relative `dataset_kwargs.data_files` paths are relative "
        "to this directory.",
    )
    num_fewshot: int | None = Field(
        None,
        ge=0,
        description="Few-shot examples per prompt (null: each task's own `num_fewshot`, else 0; a task "
        "whose YAML says `num_fewshot: 0` keeps 0, as in the harness).",
    )
    apply_chat_template: bool = Field(
        False,
        description="Render prompts with the tokenizer's chat template (the candidate's adapter tokenizer "
        "when the adapter directory carries one); base and candidate must render the same prompts.",
    )
    system_instruction: str | None = Field(None, description="System message for chat-templated prompts.")
    fewshot_as_multiturn: bool = Field(
        True, description="With the chat template: few-shot examples as earlier turns (false: one user turn)."
    )
    gen_kwargs: dict[str, Any] | None = Field(
        None,
        description="Laid over every generation task's `generation_kwargs` (e.g. {max_gen_toks: 32}); "
        "`until` replaces the task's list.",
    )
    limit: int | None = Field(None, ge=1, description="Only the first N documents of each task (null: all).")
    seed: int = Field(1234, ge=0, description="The harness's python, numpy, torch and few-shot seeds.")
    metric: str | None = Field(
        None,
        description="The per-document metric the gate judges (null: each task's first metric). Its "
        "aggregation must be `mean`, so the suite's score is the mean of per-document values.",
    )
    filter: str | None = Field(
        None,
        description="The filter pipeline whose output is scored (null: each task's first `filter_list` entry, "
        "`none` when it has none).",
    )
    category_field: str | None = Field(
        None, description="Document field holding the item's category (null: the task name, i.e. a group's subtasks)."
    )
    offline: bool = Field(
        True,
        description="HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 for the harness process (tasks read local "
        "data or the local datasets cache). Metrics must be local in every case.",
    )

    @field_validator("include_path")
    @classmethod
    def _s3_form(cls, v: str | None) -> str | None:
        return _s3_uri(v) if v is not None and is_s3_url(v) else v

    @field_validator("tasks")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"task names must be unique, got {v}")
        return v


class DecontaminationSpec(_Strict):
    """N-gram overlap of the training data (prompts and teacher outputs of the distillation set) with the
    documents of every gate suite: the project's suites (their prompts) and ``lm_eval`` suites (each task
    document's decontamination query, by default its rendered `doc_to_text`). Checked on
    ``distillation_set`` by the blocking ``decontamination`` check, so it runs before training."""

    action: Literal["drop", "fail", "off"] = Field(
        "drop",
        description="drop: overlapping examples are removed from the distillation set and counted; fail: "
        "they are kept and the check fails (nothing downstream runs); off: not checked.",
    )
    ngram: int = Field(13, ge=1, le=64, description="N-gram length, in lowercased word tokens (\\w+).")
    min_doc_tokens: int = Field(
        2,
        ge=1,
        description="A suite document shorter than `ngram` tokens is matched whole (as one contiguous "
        "token sequence); one shorter than this is not checked (and counted).",
    )
