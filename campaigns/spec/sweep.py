"""The ``sweep:`` section: a hyperparameter sweep (Optuna, asynchronous successive halving) run before the
student is trained for good; the best configuration it finds drives ``student_adapter``.

Everything is optional but ``space``; the search space names campaign fields by their dotted path
(``training.learning_rate``, ``student.lora.r``, ``training.distillation.kl_weight``, ...). Which
fields may be swept, and whether each bound is a value the field accepts, is checked against the
rest of the campaign (``CampaignSpec._sweep_fits_campaign``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from campaigns.spec.common import _Strict

# The sections a sweep may change, and the fields of them it may not: what runs where (hardware, launcher,
# topology), how long (max_steps is the top rung), logging, checkpointing and the data layout (the tokenized
# dataset is built once for every trial, so nothing that changes it is swept).
SWEEPABLE_SECTIONS = ("training", "training.distillation", "student.lora")
NOT_SWEEPABLE = {
    "training": {
        "max_steps",
        "epochs",
        "nodes",
        "processes_per_node",
        "sharding",
        "launcher",
        "hardware",
        "allow_cpu_fallback",
        "cpu_hardware",
        "log_every",
        "profiling",
        "diagnostics",
        "distributed_env",
        "collective_timeout_s",
        "eval_rows",
        "export_merged",
        "checkpoint",
        "distillation",
        "max_seq_len",
    },
    "training.distillation": {"loss", "teacher_tokenizer"},
    "student.lora": {"target_modules", "target_parameters"},
}


class ParamSpec(_Strict):
    """One dimension of the search space (Optuna's ``suggest_float`` / ``suggest_int`` / ``suggest_categorical``)."""

    type: Literal["log_uniform", "uniform", "int", "categorical"] = Field(
        description="log_uniform: a float sampled on a log scale (learning rates); uniform: a float; int: an integer "
        "(log-spaced with `log: true`); categorical: one of `choices`."
    )
    low: float | None = Field(None, description="Lower bound (log_uniform, uniform, int).")
    high: float | None = Field(None, description="Upper bound, inclusive (log_uniform, uniform, int).")
    log: bool = Field(False, description="int: sample on a log scale (e.g. LoRA ranks 4..64).")
    choices: list[Any] | None = Field(None, min_length=1, description="categorical: the values tried.")

    @model_validator(mode="after")
    def _bounds(self) -> ParamSpec:
        if self.type == "categorical":
            if not self.choices or self.low is not None or self.high is not None:
                raise ValueError("a categorical parameter takes `choices` (a non-empty list), not low/high")
            return self
        if self.choices is not None:
            raise ValueError(f"a {self.type} parameter takes low/high, not `choices`")
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} parameter needs both `low` and `high`")
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or self.low > self.high:
            raise ValueError(f"need finite low <= high, got low={self.low} high={self.high}")
        if (self.type == "log_uniform" or self.log) and self.low <= 0:
            raise ValueError(f"a log-scale parameter needs low > 0, got {self.low}")
        if self.type == "int" and (self.low != int(self.low) or self.high != int(self.high)):
            raise ValueError(f"an int parameter needs integer bounds, got low={self.low} high={self.high}")
        return self

    def values_to_check(self) -> list[Any]:
        """The values a campaign must accept for this dimension (bounds or every choice)."""
        if self.type == "categorical":
            return list(self.choices or [])
        if self.type == "int":
            return [int(self.low), int(self.high)]
        return [self.low, self.high]


class RungSpec(_Strict):
    """Successive-halving rungs: trials run ``min_steps``, the best 1/``reduction_factor`` go on to
    ``min_steps × reduction_factor`` steps, and so on; the last rung is ``training.max_steps``."""

    min_steps: int = Field(ge=1, description="Steps every trial runs before it can be pruned (the first rung).")
    reduction_factor: int = Field(
        3, ge=2, le=16, description="Keep the best 1/reduction_factor at each rung (Optuna's eta)."
    )


class SweepSpec(_Strict):
    """A hyperparameter sweep inside the campaign (docs/sweeps.md)."""

    space: dict[str, ParamSpec] = Field(
        min_length=1,
        description="Dotted campaign field → its range, e.g. `training.learning_rate: {type: log_uniform, "
        "low: 1e-4, high: 1e-1}`, `student.lora.r: {type: categorical, choices: [4, 8, 16]}`.",
    )
    trials: int = Field(
        8,
        ge=1,
        le=10_000,
        description="Trials in the study (finished or pruned; a failed trial that is retried counts once).",
    )
    rungs: RungSpec = Field(description="Successive-halving rungs (the top rung is training.max_steps).")
    metric: Literal["eval_loss"] = Field(
        "eval_loss",
        description="eval_loss: the trainer's token cross-entropy on the tokenized dataset's validation "
        "split (held out by example id from training, and disjoint from the gate's held-out items), lower is better.",
    )
    budget_usd: float | None = Field(
        None,
        gt=0,
        description="Dollar cap for the whole sweep (every rung of every trial, from the ledger): no rung is "
        "launched whose estimated cost would cross it; rungs in flight finish and are checkpointed.",
    )
    parallel: int = Field(
        1,
        ge=1,
        le=256,
        description="Trials running at once (threads of one sweep step; each trial "
        "launches through the campaign's launcher; the sweep step holds the `gpu` pool slot).",
    )
    include_default: bool = Field(
        True, description="Trial 0 is the campaign's own configuration (the baseline the best trial is compared with)."
    )
    enqueue: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Parameter sets tried first, in order (Optuna's enqueue_trial), each a "
        "mapping of some `space` fields to values; the rest are sampled.",
    )
    sampler: Literal["tpe", "random"] = Field("tpe", description="Optuna sampler for the trials not enqueued.")
    seed: int = Field(0, description="Sampler seed.")
    storage: str | None = Field(
        None,
        description="Optuna storage URL (sqlite:///..., postgresql://user@host/db); default a SQLite file "
        "under the artifact root (<root>/<campaign>/hparam_sweep/optuna.db). Secrets: use ${ENV} in the URL.",
    )
    heartbeat_s: int = Field(
        10,
        ge=1,
        le=3600,
        description="A running trial's heartbeat; a trial silent for "
        "`grace_s` is marked failed (and retried) by the next sweep process.",
    )
    grace_s: int = Field(30, ge=2, le=86_400, description="Silence after which a running trial counts as dead.")
    max_retries: int = Field(
        2, ge=0, le=100, description="Retries of a failed (killed) trial; each resumes from its own last checkpoint."
    )

    @model_validator(mode="after")
    def _space(self) -> SweepSpec:
        for name in self.space:
            section, _, field = name.rpartition(".")
            if section not in SWEEPABLE_SECTIONS:
                raise ValueError(
                    f"sweep.space.{name}: unknown field; a sweep varies fields of "
                    f"{', '.join(SWEEPABLE_SECTIONS)} (e.g. training.learning_rate, student.lora.r)"
                )
            if field in NOT_SWEEPABLE[section]:
                raise ValueError(
                    f"sweep.space.{name}: not sweepable (hardware, topology, length, logging, "
                    f"checkpointing and the data layout are fixed across trials)"
                )
        if self.grace_s <= self.heartbeat_s:
            raise ValueError(f"sweep.grace_s ({self.grace_s}) must exceed sweep.heartbeat_s ({self.heartbeat_s})")
        for i, point in enumerate(self.enqueue):
            extra = sorted(set(point) - set(self.space))
            if extra:
                raise ValueError(f"sweep.enqueue[{i}]: {extra} not in sweep.space ({sorted(self.space)})")
        return self

    def ladder(self, max_steps: int) -> list[int]:
        """The rungs in steps: min_steps × reduction_factor^k below max_steps, then max_steps."""
        out, s = [], self.rungs.min_steps
        while s < max_steps:
            out.append(s)
            s *= self.rungs.reduction_factor
        return out + [max_steps]

    def plan_rungs(self, max_steps: int) -> list[dict]:
        """Surviving trials and steps per rung, for the planner: rung k keeps ceil(trials / eta^k)."""
        out, prev = [], 0
        for k, steps in enumerate(self.ladder(max_steps)):
            n = max(1, math.ceil(self.trials / self.rungs.reduction_factor**k))
            out.append({"rung": k, "steps": steps, "new_steps": steps - prev, "trials": n})
            prev = steps
        return out


def set_field(doc: dict, dotted: str, value: Any) -> dict:
    """``doc`` (a campaign as plain data) with ``dotted`` set to ``value`` (a copy; parents created)."""
    import copy

    out = copy.deepcopy(doc)
    node = out
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return out
