"""Moved: the trainer is split into recipes (``training.recipes``); these names keep old imports working.

``LoraTrainer`` is :class:`training.recipes.LoraFinetuneRecipe` itself (class attributes set on it reach every
recipe); :func:`run` picks the recipe for the job. New code imports from ``training.recipes``.
"""

from training.recipes import LABEL_ALIGNED, LoraFinetuneRecipe, StepResult, TrainingError, run

LoraTrainer = LoraFinetuneRecipe

__all__ = ["LABEL_ALIGNED", "LoraTrainer", "StepResult", "TrainingError", "run"]
