"""The Ray executor driven the way the stage drives it, for the scale-out tests."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from campaign_orchestrator.generation.requests import Sampling
from campaign_orchestrator.generation.runner import run_generation
from campaign_orchestrator.generation.scaleout.stage import RayExecutor


def on_ray(prompts, sampling: Sampling, recipe, ident, cfg, execution, budget=None, **executor):
    """``run_generation`` with the Ray executor: ``(result, what the pool did)``."""
    ex = RayExecutor(recipe, ident, cfg, execution, **executor)
    return run_generation(prompts, ex, sampling, cfg.open(), budget=budget), ex.run


@dataclass(frozen=True)
class GatedRecipe:
    """A teacher recipe whose workers hand each answer on only while no gate file names their process: with
    ``<gate_dir>/<pid>`` present, an answer the worker has received (and journaled: the client does that first)
    waits before it reaches the worker's spool, and ``<gate_dir>/<pid>.blocked`` says one does. The test's way to
    hold a worker with answers received and not yet recorded, as a loaded host does for a moment."""

    inner: object  # a BackendFactory
    gate_dir: str

    def build(self):
        return GatedBackend(self.inner.build(), self.gate_dir)


class GatedBackend:
    def __init__(self, inner, gate_dir: str):
        self.inner, self.gate_dir = inner, Path(gate_dir)
        self.client, self.name, self.model, self.identity = inner.client, inner.name, inner.model, inner.identity

    @property
    def generate_s(self) -> float:
        return self.inner.generate_s

    def stats(self) -> dict:
        return self.inner.stats()

    def run(self, requests, sampling, on_done) -> None:
        def gated(req, completion) -> None:
            gate = self.gate_dir / str(os.getpid())
            if gate.exists():
                gate.with_suffix(".blocked").write_text(req.prompt)
                while gate.exists():
                    time.sleep(0.01)
            on_done(req, completion)

        self.inner.run(requests, sampling, gated)
