"""``data.replay``: general prompts answered by the base student (or the teacher, or a file) mixed into training,
so the student keeps how it answered everything else (self-distillation replay)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from campaigns.spec.common import _Strict


class ReplaySpec(_Strict):
    """Rehearsal on the model's own answers: the standard guard against forgetting in fine-tuning, for any teacher.

    ``answered_by: base`` (default) asks the student's base model, through the local generation engine and its
    cache (a rerun asks nothing), greedy, at most ``max_new_tokens``; priced as local compute on the distillation
    set. ``teacher`` asks the campaign's teacher (its backend, cache and price). ``file`` reads ready answers
    (``answers``: JSONL of ``prompt`` and ``completion``). The answered rows join the distillation set with ids
    ``replay:<id>``, through the same filters (empty, truncated) and decontamination against the gate suites."""

    source: str = Field(description="JSONL of general prompts (`id`, `prompt`), relative to the project or absolute.")
    answered_by: Literal["base", "teacher", "file"] = Field(
        "base", description="Who answers the replay prompts: the student's base model, the teacher, or `answers`."
    )
    answers: str | None = Field(None, description="`answered_by: file`: JSONL of `prompt` and `completion`.")
    share: float = Field(
        0.5,
        gt=0.0,
        lt=1.0,
        description="Replay examples as a share of the training mix: replay = share / (1 - share) "
        "x task examples, capped at the replay prompts there are (the first in id order).",
    )
    max_new_tokens: int = Field(64, ge=1, le=4096, description="Longest replay answer generated (base or teacher).")

    @model_validator(mode="after")
    def _answers_with_file(self) -> ReplaySpec:
        if (self.answered_by == "file") != (self.answers is not None):
            raise ValueError("`answers` (a JSONL of prompt and completion) is set exactly when `answered_by: file`")
        return self
