"""``training.selection``: which checkpoint the stage returns (the best by held-out loss, or the last)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from campaigns.spec.common import _Strict


class SelectionSpec(_Strict):
    """Keep the best checkpoint, not the last (``training/selection.py`` holds the rule).

    Every ``every_steps`` optimizer steps the trainer measures the loss on the held-out validation split, apart
    for task rows and replay rows (``data.replay``), and keeps the adapter whose weighted held-out loss is the
    lowest; with ``patience`` it stops once that many evaluations in a row did not improve it."""

    rule: Literal["last", "best_heldout_loss"] = Field(
        "last",
        description="last: the adapter after the last step; best_heldout_loss: the evaluated checkpoint with "
        "the lowest held-out loss ((1 - replay_weight) x task loss + replay_weight x replay loss; earliest on a tie).",
    )
    every_steps: int = Field(5, ge=1, description="Evaluate (and save a checkpoint) every this many optimizer steps.")
    patience: int | None = Field(
        None, ge=1, description="Stop training after this many evaluations in a row without improvement (None: never)."
    )
    min_delta: float = Field(0.0, ge=0.0, description="An improvement must lower the held-out loss by more than this.")
    replay_weight: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Weight of the replay rows' loss in the held-out loss (the rest: task rows). "
        "Without replay rows in the validation split the task loss alone decides.",
    )
