"""The Ray executor driven the way the stage drives it, for the scale-out tests."""

from __future__ import annotations

from campaign_orchestrator.generation.requests import Sampling
from campaign_orchestrator.generation.runner import run_generation
from campaign_orchestrator.generation.scaleout.stage import RayExecutor


def on_ray(prompts, sampling: Sampling, recipe, ident, cfg, execution, budget=None, **executor):
    """``run_generation`` with the Ray executor: ``(result, what the pool did)``."""
    ex = RayExecutor(recipe, ident, cfg, execution, **executor)
    return run_generation(prompts, ex, sampling, cfg.open(), budget=budget), ex.run
