"""Training recipes, one per algorithm (after torchtune's recipes): a class whose methods are the steps of a run.

* :class:`LoraFinetuneRecipe` (``lora_finetune``): supervised fine-tuning and logit distillation of a LoRA / QLoRA
  student under FSDP2 (``training.distillation.loss`` ``sequence`` or ``logits``); a mixture-of-experts student is a
  model-setup concern of it.
* :class:`OnPolicyDistillationRecipe` (``on_policy_distillation``): GKD rounds (``loss: on_policy``), a subclass that
  overrides the step's parts.

:func:`run` picks the recipe for a job file and runs it (``python -m training --config FILE``).
"""

from __future__ import annotations

from pathlib import Path

from training.config import TrainJob
from training.errors import TrainingError
from training.recipes.lora_finetune import LABEL_ALIGNED, LoraFinetuneRecipe, StepResult
from training.recipes.on_policy_distillation import OnPolicyDistillationRecipe
from training.trainer_guards import die_with_launcher

__all__ = [
    "LABEL_ALIGNED",
    "LoraFinetuneRecipe",
    "OnPolicyDistillationRecipe",
    "StepResult",
    "TrainingError",
    "recipe_for",
    "run",
]


def recipe_for(job: TrainJob) -> type[LoraFinetuneRecipe]:
    """The recipe class of a job's ``training.distillation.loss``."""
    return OnPolicyDistillationRecipe if job.training.distillation.loss == "on_policy" else LoraFinetuneRecipe


def run(config_path: str | Path) -> dict:
    """Read a TrainJob file, set up and train its recipe, clean up; returns the summary (empty on ranks > 0)."""
    die_with_launcher()  # under the local launcher: die with torchrun (its workers are in their own sessions)
    job = TrainJob.read(config_path)
    recipe = recipe_for(job)(job)
    ok = False
    try:
        recipe.setup()
        summary = recipe.train()
        ok = True
        return summary
    finally:
        recipe.cleanup(ok)
