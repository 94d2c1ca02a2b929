"""The trainer's input: one JSON file written by the launcher (or by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from campaigns.spec import StudentSpec, TrainingSpec


class TrainJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    campaign: str
    base_model_path: str = Field(description="Directory of the base checkpoint (config, weights, tokenizer).")
    dataset_path: str = Field(description="Tokenized Parquet file or directory of Parquet shards.")
    validation_path: str | None = Field(
        None, description="Tokenized validation split (held out by example id); the eval loss is measured on it. "
                          "None or empty: on the first `training.eval_rows` training rows instead."
    )
    output_dir: str = Field(description="Where the adapter, metrics and summary are written.")
    student: StudentSpec
    training: TrainingSpec
    teacher_tokenizer_path: str | None = Field(
        None, description="Directory with the teacher's tokenizer; required for logit distillation (vocabularies must match)."
    )
    gpu_required: bool = Field(
        False, description="training.hardware is priced per GPU-hour: with no visible GPU, refuse to train (unless "
                           "training.allow_cpu_fallback) instead of running on the CPU and being billed as GPU time."
    )
    stop_at_step: int | None = Field(
        None, ge=1, description="Stop after this many completed steps (a sweep rung): checkpoint, measure the eval loss "
        "and write summary.json with `rung: true`; the LR schedule stays that of the full run, so a relaunch with a "
        "later stop (or none) resumes from this checkpoint exactly as an uninterrupted run. None: train to the end."
    )
    checkpoint_uri: str | None = Field(
        None, description="Where this run's checkpoints are mirrored (s3://bucket/prefix/...), unique per run; None: local only."
    )

    @classmethod
    def read(cls, path: str | Path) -> TrainJob:
        return cls.model_validate_json(Path(path).read_text())

    def write(self, path: str | Path) -> Path:
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2))
        return Path(path)
