"""Picklable factories that build a backend or a local model inside a worker (a Ray actor, a pod, a subprocess).

This is the interface between the code that *batches* (the engines: :class:`LocalModel` and the
teacher backends) and the code that *distributes* (the Ray execution of a stage): a worker receives a
factory, calls :meth:`build` once (the model loads there, not in the driver), and then calls only the
engine's own methods on its shard.

- :class:`BackendFactory` builds a teacher :class:`~campaign_orchestrator.generation.backends.Backend`:
  ``run(requests, sampling, on_done)`` (teacher generations, the teacher answering held-out items).
- :class:`LocalModelFactory` builds a :class:`~campaign_orchestrator.generation.local.LocalModel`:
  ``generate(prompts, max_new_tokens, ..., on_result=...)`` (candidate and base answers in evaluation)
  and ``score(prompts, continuations, top_k)`` (log-likelihood of given text, one forward pass).

What the engines promise a distributor:

1. Results are per input and in input order; ``on_done`` / ``on_result`` is called as each input
   finishes, so a worker can hand back (and a cache can keep) a shard's finished part before the rest.
2. A greedy answer does not depend on which other prompts share its batch (token-identical in fp32),
   so splitting a stage into shards does not change its answers.
3. Errors that concern one input come back as a completion with ``error`` set; errors that concern the
   engine (no model, a rejected API key) raise from ``build`` or the first call.

Factories hold no secrets: an endpoint's API key travels as the *name* of its environment variable
(``TeacherSpec.api_key_env``) and is read in the worker's environment. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LocalModelFactory:
    """How to load a local model (+ adapter) as a :class:`LocalModel` in another process."""

    model_dir: str
    adapter_dir: str | None = None
    load_in_4bit: bool = False
    compute_dtype: str = "auto"
    batch_size: int = 64
    engine: str = "auto"
    max_batch_tokens: int | None = None
    device: str | None = None

    def build(self):
        from campaign_orchestrator.generation.local import LocalModel

        return LocalModel.from_path(
            self.model_dir,
            self.adapter_dir,
            self.load_in_4bit,
            self.compute_dtype,
            batch_size=self.batch_size,
            device=self.device,
            engine=self.engine,
            max_batch_tokens=self.max_batch_tokens,
        )


@dataclass(frozen=True)
class BackendFactory:
    """How to build a campaign's teacher backend in another process: the ``teacher:`` section (a frozen
    pydantic model, picklable), the resolved local checkpoint and its precomputed fingerprint (so a worker
    does not hash the weights again, and every worker keys its generations alike)."""

    spec: Any  # campaigns.spec.TeacherSpec
    model_path: str | None = None
    weights_id: str | None = None

    def build(self):
        from campaign_orchestrator.generation.backends import make_backend, read_api_key

        api_key = read_api_key(self.spec.api_key_env) if self.spec.backend == "openai" else None
        return make_backend(
            self.spec, Path(self.model_path) if self.model_path else None, api_key=api_key, weights_id=self.weights_id
        )
