"""The teacher resource: one interface, the backend chosen in the campaign spec.

``transformers`` runs a local checkpoint on this machine, ``vllm`` runs offline batch
inference on this machine's GPUs (the ``vllm`` extra), ``openai`` calls any OpenAI-compatible
endpoint. The generation loop, the cache and the backends are plain modules under
``campaign_orchestrator/teacher/``; this resource only turns a :class:`campaigns.spec.TeacherSpec` into a backend
and reads the API key from the environment variable the spec names (never from the spec).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field

from campaigns.spec import TeacherSpec


class TeacherResource(ConfigurableResource):
    """Builds teacher backends from campaign specs."""

    vllm_chunk_size: int | None = Field(
        None, description="Prompts per vllm.LLM.generate call (a cache checkpoint); default: the spec's batch_size."
    )

    def backend(self, spec: TeacherSpec, model_path: Path | None, weights_id: str | None = None):
        """A :class:`campaign_orchestrator.generation.backends.Backend` for ``spec`` (``model_path``: the resolved
        local checkpoint, when there is one; ``weights_id``: its precomputed fingerprint)."""
        from campaign_orchestrator.generation.backends import make_backend, read_api_key

        api_key = read_api_key(spec.api_key_env) if spec.backend == "openai" else None
        if spec.backend == "vllm" and self.vllm_chunk_size:
            spec = spec.model_copy(update={"batch_size": self.vllm_chunk_size})
        return make_backend(spec, model_path, api_key=api_key, weights_id=weights_id)

    def generate(
        self,
        spec: TeacherSpec,
        model_path: Path | None,
        prompts: list[str],
        progress: Callable[[int], None] | None = None,
    ) -> list:
        """One completion per prompt with the spec's sampling (sample 0, no cache): a plain
        call for callers that only want answers, e.g. scoring a served teacher."""
        from campaign_orchestrator.generation.requests import Sampling, build_requests

        b = self.backend(spec, model_path)
        s = Sampling.from_spec(spec.sampling)
        s = Sampling(s.max_new_tokens, s.temperature, s.top_p, s.seed, 1, s.logprobs)
        reqs = [r[0] for r in build_requests(b.identity, s, prompts, spec.chat, [m.model_dump() for m in spec.context])]
        index = {r.key: i for i, r in enumerate(reqs)}
        out: list = [None] * len(prompts)

        def done(req, c) -> None:
            out[index[req.key]] = c
            if progress:
                progress(1)

        unique = list({r.key: r for r in reqs}.values())
        b.run(unique, s, done)
        for i, r in enumerate(reqs):  # identical prompts share one answer
            out[i] = out[index[r.key]]
        return out
