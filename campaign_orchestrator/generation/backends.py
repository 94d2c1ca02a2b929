"""The three teacher backends behind one interface.

A backend has a ``name``, a ``model`` reference, an ``identity`` (part of every cache key) and
``run(requests, sampling, on_done)``, which answers each :class:`GenRequest` and calls
``on_done(request, completion)`` as results arrive, so the cache can keep them before the
rest are done. Errors that concern one request (a prompt longer than the context, a request
the endpoint refuses) come back as a completion with ``error`` set; errors that concern the
whole backend (no vLLM installed, a rejected API key, an unreachable endpoint) raise.

- :class:`TransformersBackend`: a local checkpoint through
:class:`campaign_orchestrator.generation.local.LocalModel`
  (batched, left-padded, batches bucketed by prompt length).
- ``vllm``: offline batch inference with ``vllm.LLM.generate`` and ``SamplingParams``, answered by vLLM's
  engine itself (:class:`~campaign_orchestrator.generation.engines.vllm_engine.VLLMEngine`, the one class that
  runs vLLM; ``VLLMBackend``, its old name here, still imports with a warning). vLLM is imported only when used
  (``pip install '.[vllm]'`` on a GPU image). Tests inject an object with ``vllm.LLM``'s interface.
- :class:`OpenAIBackend`: any OpenAI-compatible endpoint through
  :class:`campaign_orchestrator.generation.openai_client.OpenAICompatibleClient`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from campaign_orchestrator.generation.backend_api import (  # noqa: F401 - exported here too, where they were
    Backend,
    BackendError,
    OnDone,
    teacher_identity,
    weights_identity,
)
from campaign_orchestrator.generation.requests import GenRequest, Sampling


def answer_identity(
    model: str,
    model_path: str | Path,
    revision: str | None = None,
    *,
    weights_id: str | None = None,
    precision: str,
    adapter_id: str | None = None,
    quantization: dict | None = None,
) -> str:
    """What makes a local model's greedy answers the same, for the generation cache: the
    ``transformers`` teacher identity of its weights and resolved ``precision`` (so a student's base
    model and a ``transformers`` teacher over the same weights, as in context distillation, share their
    answers to the same bare prompt: answered once), then its LoRA adapter (``adapter_id``: its content
    key) and its 4-bit settings (``quantization``: the student's, when it loads in 4 bit)."""
    ident = teacher_identity("transformers", model, model_path, revision, weights_id=weights_id, precision=precision)
    if adapter_id:
        ident += f"|adapter:{adapter_id}"
    if quantization:
        ident += (
            "|4bit:" + hashlib.sha256(json.dumps(quantization, sort_keys=True, default=str).encode()).hexdigest()[:12]
        )
    return ident


def local_precision(compute_dtype: str, device: str | None = None) -> str:
    """The transformers teacher's resolved ``<device kind>:<dtype>`` on this host (cheap: the cached per-host
    measurement; imports torch, so only where a stage runs)."""
    from campaign_orchestrator.hardware import key_precision

    return key_precision(compute_dtype, device)


def read_api_key(env_name: str | None) -> str | None:
    """The API key from the environment variable the campaign names (never the key itself)."""
    if not env_name:
        return None
    value = os.environ.get(env_name)
    if not value:
        raise BackendError(
            f"teacher.api_key_env names {env_name!r}, but that environment variable is not set "
            f"(export it in the environment of the Dagster code location / run worker)"
        )
    return value


# --------------------------------------------------------------------------- transformers


class TransformersBackend:
    name = "transformers"

    def __init__(
        self,
        model_path: str | Path,
        model: str | None = None,
        identity: str | None = None,
        batch_size: int = 64,
        local_model=None,
        revision: str | None = None,
        compute_dtype: str = "auto",
        precision: str | None = None,
        adapter_dir: str | Path | None = None,
        load_in_4bit: bool = False,
    ):
        self.model = model or str(model_path)
        self.adapter_dir, self.load_in_4bit = adapter_dir, load_in_4bit  # a student: its LoRA adapter, 4-bit base
        self.compute_dtype = compute_dtype
        self.model_path = Path(model_path)
        # what the identity says it computes in: the model it loads must resolve to the same (``local_model``)
        self.precision_key = precision or (
            None if identity and local_model is not None else local_precision(compute_dtype)
        )
        self.identity = identity or teacher_identity(
            "transformers", self.model, model_path, revision, precision=self.precision_key
        )
        self.batch_size = batch_size
        self._gen = local_model
        self.generate_s = 0.0

    @property
    def local_model(self):
        if self._gen is None:
            from campaign_orchestrator.generation.local import LocalModel

            gen = LocalModel.from_path(
                self.model_path, self.adapter_dir, self.load_in_4bit, self.compute_dtype, batch_size=self.batch_size
            )
            p = gen.precision
            ran = f"{'cuda' if str(p.device).startswith('cuda') else 'cpu'}:{p.dtype}" if p is not None else None
            if self.precision_key and ran and ran != self.precision_key:
                raise BackendError(
                    f"teacher {self.model}: its generations are keyed for {self.precision_key} but the "
                    f"model loaded as {ran} (compute_dtype {self.compute_dtype}); set teacher."
                    f"compute_dtype to the dtype you want instead of auto, or re-run the stage"
                )
            self._gen = gen
        return self._gen

    def run(self, requests: Sequence[GenRequest], sampling: Sampling, on_done: OnDone) -> None:
        if not requests:
            return
        gen = self.local_model
        by_sample: dict[int, list[GenRequest]] = {}
        for r in requests:
            by_sample.setdefault(r.sample_index, []).append(r)
        t0 = time.perf_counter()
        for s, reqs in sorted(by_sample.items()):
            gen.generate(
                [r.payload for r in reqs],
                sampling.max_new_tokens,
                sampling.temperature,
                sampling.top_p,
                sampling.sample_seed(s),
                logprobs=sampling.logprobs,
                on_result=lambda i, c, reqs=reqs: on_done(reqs[i], c),
            )
        self.generate_s += time.perf_counter() - t0

    def stats(self) -> dict:
        p = getattr(self._gen, "precision", None)
        out = {"compute_dtype": p.dtype, "compute_dtype_reason": p.reason} if p is not None else {}
        engine = getattr(self._gen, "last_engine", None)
        if engine:  # which engine answered, and why auto chose it (generation/auto.py)
            why = next(
                (c.get("why") for c in getattr(self._gen, "choice", {}).values() if c.get("chosen") == engine), None
            )
            out |= {"engine": engine} | ({"engine_reason": why} if why else {})
        return out


# --------------------------------------------------------------------------- vLLM


def __getattr__(name: str):
    """``VLLMBackend``, the teacher's vLLM backend before issue 44, still imports, with a warning: one class runs
    vLLM now, :class:`~campaign_orchestrator.generation.engines.vllm_engine.VLLMEngine` (the teacher's ``vllm``
    backend and the ``vllm`` engine of a local model)."""
    if name != "VLLMBackend":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    warnings.warn(
        "campaign_orchestrator.generation.backends.VLLMBackend is now VLLMEngine "
        "(campaign_orchestrator.generation.engines.vllm_engine): build it with VLLMEngine(model=..., ...), or "
        "with make_backend from a teacher spec; the old name will be removed",
        FutureWarning,
        stacklevel=2,
    )
    return _vllm_backend


def _vllm_backend(
    model: str,
    identity: str | None = None,
    revision: str | None = None,
    llm: Any = None,
    sampling_params: Any = None,
    chunk_size: int = 1024,
    tensor_parallel_size: int = 1,
    engine_args: dict | None = None,
    seed: int = 0,
    dtype: str | None = None,
    top_k: int | None = None,
    adapter_dir: str | Path | None = None,
    llm_class: Any = None,
    lora_request_class: Any = None,
):
    """The old ``VLLMBackend(...)`` call: the same arguments, a :class:`VLLMEngine` in the backend role."""
    from campaign_orchestrator.generation.engines.vllm_engine import VLLMEngine

    return VLLMEngine(
        llm_class=llm_class,
        params_class=sampling_params,
        request_class=lora_request_class,
        model=model,
        identity=identity,
        revision=revision,
        adapter_dir=adapter_dir,
        dtype=dtype,
        top_k=top_k,
        extra_args=engine_args,
        tensor_parallel_size=tensor_parallel_size,
        seed=seed,
        chunk_size=chunk_size,
        llm=llm,
    )


# --------------------------------------------------------------------------- OpenAI-compatible


class OpenAIBackend:
    name = "openai"

    def __init__(self, client, identity: str | None = None, revision: str | None = None):
        self.client = client
        self.model = client.model
        self.identity = identity or teacher_identity(
            "openai", client.model, revision=revision, base_url=client.base_url
        )
        self.generate_s = 0.0

    def run(self, requests: Sequence[GenRequest], sampling: Sampling, on_done: OnDone) -> None:
        t0 = time.perf_counter()
        try:
            self.client.run(requests, sampling, on_done)
        finally:
            self.generate_s += time.perf_counter() - t0

    def stats(self) -> dict:
        return self.client.stats.as_dict()


# --------------------------------------------------------------------------- from a campaign spec


def spec_identity(
    spec, model_path: str | Path | None = None, weights_id: str | None = None, precision: str | None = None
) -> str:
    """:func:`teacher_identity` of a :class:`campaigns.spec.TeacherSpec` (cheap: no model load). A transformers
    teacher's ``compute_dtype`` enters it resolved for this host (``precision``, computed when not given:
    :func:`local_precision`), so a bf16 host and an fp32 host never share generations."""
    if spec.backend == "transformers" and precision is None:
        precision = local_precision(spec.compute_dtype)
    if spec.backend == "vllm":
        from campaign_orchestrator.generation.engines.vllm_engine import resolve_dtype, vllm_device

        dtype = (spec.engine_args or {}).get("dtype") or spec.compute_dtype
        device = vllm_device()
        precision = f"{device}:{resolve_dtype(model_path or spec.model, dtype, device)}"
    return teacher_identity(
        spec.backend,
        spec.model,
        model_path,
        spec.revision,
        base_url=spec.base_url,
        engine_args=spec.engine_args if spec.backend == "vllm" else None,
        weights_id=weights_id,
        precision=precision if spec.backend in ("transformers", "vllm") else None,
    )


def make_backend(
    spec,
    model_path: str | Path | None = None,
    *,
    api_key: str | None = None,
    weights_id: str | None = None,
    llm: Any = None,
    sampling_params: Any = None,
    llm_class: Any = None,
) -> Backend:
    """The backend a :class:`campaigns.spec.TeacherSpec` asks for. ``model_path`` is the resolved
    local checkpoint (transformers; vllm when local); ``api_key`` the key read from
    ``spec.api_key_env`` by the caller; ``llm``/``sampling_params``/``llm_class`` inject a vLLM engine (or
    its class).
    Building a backend is cheap: models load on the first request."""
    precision = local_precision(spec.compute_dtype) if spec.backend == "transformers" else None
    ident = spec_identity(spec, model_path, weights_id, precision)
    if spec.backend == "transformers":
        if model_path is None:
            raise BackendError(
                f"backend 'transformers' needs a local checkpoint; {spec.model!r} did not resolve to one"
            )
        return TransformersBackend(
            model_path,
            spec.model,
            ident,
            batch_size=spec.batch_size,
            compute_dtype=spec.compute_dtype,
            precision=precision,
        )
    if spec.backend == "vllm":  # vLLM's engine answers as the backend (no transformers model beside it)
        from campaign_orchestrator.generation.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            llm_class=llm_class,
            params_class=sampling_params,
            model=str(model_path or spec.model),
            identity=ident,
            revision=spec.revision,
            dtype=spec.compute_dtype,
            top_k=spec.sampling.logprobs,
            extra_args=spec.engine_args,
            tensor_parallel_size=spec.tensor_parallel_size,
            seed=spec.sampling.seed,
            chunk_size=spec.batch_size,
            llm=llm,
        )
    if spec.backend == "openai":
        from campaign_orchestrator.generation.openai_client import OpenAICompatibleClient

        client = OpenAICompatibleClient(
            spec.base_url,
            spec.model,
            api_key=api_key,
            api_key_env=spec.api_key_env,
            chat=spec.chat,
            max_concurrency=spec.max_concurrency,
            requests_per_minute=spec.requests_per_minute,
            tokens_per_minute=spec.tokens_per_minute,
            timeout_s=spec.request_timeout_s,
            max_retries=spec.max_retries,
        )
        return OpenAIBackend(client, identity=ident)
    raise BackendError(f"unknown teacher backend {spec.backend!r}")
