"""The trainer's input: one JSON file written by the launcher (or by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from campaigns.spec import StudentSpec, TrainingSpec


class OnPolicyJob(BaseModel):
    """What ``training.distillation.loss: on_policy`` needs beyond the campaign's sections: the prompts the student
    samples on, how the student asks them, and the teacher that scores the samples (in process, or a server)."""

    model_config = ConfigDict(extra="forbid")

    prompts_path: str = Field(description="The prompts stage's training split (Parquet: id, prompt, category, ...).")
    template: str = Field("auto", description="How the student renders a bare prompt (dataset.template).")
    teacher_backend: str = Field(description="teacher.backend: transformers (in process) or openai (a server).")
    teacher_model_path: str | None = Field(
        None, description="`transformers`: the teacher's directory, loaded beside the student on every rank."
    )
    teacher_compute_dtype: str = Field("auto", description="`transformers`: the dtype the teacher scores in.")
    teacher_identity: str = Field("", description="What makes two teachers the same (recorded per round).")
    teacher: dict = Field(
        default_factory=dict,
        description="The campaign's teacher section (for a server scorer: base_url, model, "
        "chat, api_key_env: the name of the key's variable, never the key; timeouts).",
    )
    context: list[dict] = Field(default_factory=list, description="teacher.context: messages before the prompt.")
    context_categories: list[str] | None = Field(
        None, description="teacher.context_categories: only prompts of these categories get the context."
    )


class TrainJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    campaign: str
    base_model_path: str = Field(description="Directory of the base checkpoint (config, weights, tokenizer).")
    dataset_path: str = Field(description="Tokenized Parquet file or directory of Parquet shards.")
    validation_path: str | None = Field(
        None,
        description="Tokenized validation split (held out by example id); the eval loss is measured on it. "
        "None or empty: on the first `training.eval_rows` training rows instead.",
    )
    output_dir: str = Field(description="Where the adapter, metrics and summary are written.")
    student: StudentSpec
    training: TrainingSpec
    teacher_tokenizer_path: str | None = Field(
        None,
        description=(
            "Directory with the teacher's tokenizer; required for logit distillation (vocabularies must match)."
        ),
    )
    gpu_required: bool = Field(
        False,
        description="training.hardware is priced per GPU-hour: with no visible GPU, refuse to train (unless "
        "training.allow_cpu_fallback) instead of running on the CPU and being billed as GPU time.",
    )
    stop_at_step: int | None = Field(
        None,
        ge=1,
        description="Stop after this many completed steps (a sweep rung): checkpoint, measure the eval loss "
        "and write summary.json with `rung: true`; the LR schedule stays that of the full run, so a relaunch with a "
        "later stop (or none) resumes from this checkpoint exactly as an uninterrupted run. None: train to the end.",
    )
    on_policy: OnPolicyJob | None = Field(
        None,
        description="`training.distillation.loss: on_policy`: prompts and teacher scoring. With "
        "`teacher_generations: none` there is no tokenized dataset (dataset_path empty).",
    )
    policy_terms: dict | None = Field(
        None,
        description="What the training policy adds to the device the trainer sees (campaign_orchestrator.costs."
        "memory_policy.policy_terms, from the campaign and its pricing catalog): the headroom and, per device kind, "
        "the process's own memory and the C heap's retention, so the trainer resolves `auto` with the planner's "
        "inputs. None: headroom 0.9, nothing else counted.",
    )
    checkpoint_uri: str | None = Field(
        None,
        description=(
            "Where this run's checkpoints are mirrored (s3://bucket/prefix/...), unique per run; None: local only."
        ),
    )

    @classmethod
    def read(cls, path: str | Path) -> TrainJob:
        return cls.model_validate_json(Path(path).read_text())

    def write(self, path: str | Path) -> Path:
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2))
        return Path(path)
