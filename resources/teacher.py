"""The teacher resource: one interface, the backend chosen in the campaign spec."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dagster import ConfigurableResource

from campaigns.spec import TeacherSpec


class TeacherResource(ConfigurableResource):
    """Generates teacher completions. ``transformers`` runs a local model on this machine."""

    def generate(self, spec: TeacherSpec, model_path: Path | None, prompts: list[str],
                 progress: Callable[[int], None] | None = None) -> list:
        if spec.backend == "transformers":
            from generation.local import LocalGenerator

            gen = LocalGenerator.from_path(model_path, batch_size=spec.batch_size)
            s = spec.sampling
            return gen.generate(prompts, s.max_new_tokens, s.temperature, s.top_p, s.seed, progress=progress)
        raise NotImplementedError(
            f"teacher backend {spec.backend!r} is not available in this build; use backend: transformers"
        )
