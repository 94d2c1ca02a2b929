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
- :class:`VLLMBackend`: offline batch inference with ``vllm.LLM.generate`` and
  ``SamplingParams``; vLLM is imported only here, only when used (``pip install '.[vllm]'``
  on a GPU image). Tests inject an object with ``vllm.LLM``'s interface.
- :class:`OpenAIBackend`: any OpenAI-compatible endpoint through
  :class:`campaign_orchestrator.generation.openai_client.OpenAICompatibleClient`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from campaign_orchestrator.generation.completion import Completion
from campaign_orchestrator.generation.requests import GenRequest, Sampling

OnDone = Callable[[GenRequest, Completion], None]


class BackendError(RuntimeError):
    pass


class Backend(Protocol):
    name: str
    model: str
    identity: str

    def run(self, requests: Sequence[GenRequest], sampling: Sampling, on_done: OnDone) -> None: ...

    def stats(self) -> dict: ...


def weights_identity(path: str | Path, revision: str | None = None) -> str:
    """Content fingerprint of a checkpoint directory (every byte, each file version read once) + revision."""
    from campaign_orchestrator.content import HashCache, model_fingerprint
    from campaigns import paths

    return f"{model_fingerprint(Path(path), HashCache(paths.hash_cache_file()))}@{revision or ''}"


def teacher_identity(
    backend: str,
    model: str,
    model_path: str | Path | None = None,
    revision: str | None = None,
    base_url: str | None = None,
    engine_args: dict | None = None,
    weights_id: str | None = None,
    precision: str | None = None,
) -> str:
    """What makes two teachers the same for the cache: backend + weights (+ numerics options).

    Local weights are identified by content (``weights_id``, computed when not given); a model
    only known by name (a hub id for vLLM, a served name behind an endpoint) by its name,
    revision and, for endpoints, the URL: pin ``revision`` when the weights behind a name can
    change. ``precision`` is what a local model computes in, resolved (``cpu:float32``,
    ``cuda:bfloat16``: :func:`campaign_orchestrator.hardware.key_precision`, never ``auto``): bf16 and
    fp32 answers of the same weights are different generations."""
    if backend == "openai":
        return f"openai:{(base_url or '').rstrip('/')}|{model}@{revision or ''}"
    if precision is not None and (":" not in precision or "auto" in precision):
        raise ValueError(
            f"teacher precision must be a resolved '<device>:<dtype>' (e.g. cpu:float32), got "
            f"{precision!r}; resolve it with campaign_orchestrator.hardware.key_precision"
        )
    wid = weights_id or (
        weights_identity(model_path, revision) if model_path is not None else f"name:{model}@{revision or ''}"
    )
    ident = f"{backend}:{wid}"
    if engine_args:
        ident += "|" + hashlib.sha256(json.dumps(engine_args, sort_keys=True, default=str).encode()).hexdigest()[:12]
    if precision:
        ident += f"|{precision}"
    return ident


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


def _max_model_len(llm) -> int | None:
    for holder in (llm, getattr(llm, "llm_engine", None)):
        cfg = getattr(holder, "model_config", None)
        n = getattr(cfg, "max_model_len", None)
        if isinstance(n, int):
            return n
    return None


class VLLMBackend:
    """Offline batch generation with ``vllm.LLM``.

    Requests go to ``LLM.generate`` as token ids, rendered as every local backend renders them (:meth:`_render`:
    the chat template for a bare prompt when the tokenizer has one, the context messages whole), in chunks of
    ``chunk_size`` prompts; each chunk's results reach the cache before the next chunk starts.
    When every sample of a prompt is missing and sampling is not greedy, the prompt is sent
    once with ``SamplingParams(n=...)`` (vLLM shares the prompt's KV cache across samples);
    otherwise one request per sample with ``seed + sample_index``. Prompts that do not fit
    ``max_model_len`` are skipped with an error before they reach vLLM; if vLLM still rejects a
    chunk with ``ValueError``, its prompts are retried one by one so only the bad ones fail.
    """

    name = "vllm"

    def __init__(
        self,
        model: str,
        identity: str | None = None,
        revision: str | None = None,
        llm: Any = None,
        sampling_params: Callable[..., Any] | None = None,
        chunk_size: int = 1024,
        tensor_parallel_size: int = 1,
        engine_args: dict | None = None,
        seed: int = 0,
        dtype: str | None = None,
        top_k: int | None = None,
        adapter_dir: str | Path | None = None,
        llm_class: Callable[..., Any] | None = None,
        lora_request_class: Callable[..., Any] | None = None,
    ):
        from campaign_orchestrator.generation.engines.vllm_engine import engine_args as vllm_args
        from campaign_orchestrator.generation.engines.vllm_engine import resolve_dtype, vllm_device

        self.model, self.revision = model, revision
        extra = dict(engine_args or {})
        # where and in what dtype vLLM computes, resolved before it starts and passed to it, so the key names what
        # runs (checked against the started engine: _load)
        self.device = vllm_device()
        self.dtype = resolve_dtype(model, extra.pop("dtype", None) or dtype or "auto", self.device)
        self.identity = identity or teacher_identity(
            "vllm", model, None, revision, engine_args=engine_args, precision=f"{self.device}:{self.dtype}"
        )
        self.chunk_size = chunk_size
        self._llm, self._sp, self._llm_class = llm, sampling_params, llm_class
        self.adapter_dir, self._lora_class = adapter_dir, lora_request_class
        self._engine = {
            "tensor_parallel_size": tensor_parallel_size,
            "seed": seed,
            **vllm_args(model, dtype=self.dtype, adapter_dir=adapter_dir, top_k=top_k, extra=extra, device=self.device),
        }
        self._engine.pop("model")
        self.generate_s = 0.0
        self._tok = None
        self._max_len: int | None = None

    def _load(self) -> None:
        """Import vLLM and start the engine, on first use only (a fully cached run never does)."""
        if self._llm is not None and self._sp is not None:
            return
        if self._llm_class is None or self._sp is None:
            try:
                import vllm
            except ImportError as e:
                raise BackendError(
                    "teacher backend 'vllm' needs the vllm package, which is not installed here; "
                    "install the `vllm` extra on a GPU image (pip install '.[vllm]') or use backend "
                    "'transformers' (local) or 'openai' (a served endpoint)"
                ) from e
            self._sp = self._sp or vllm.SamplingParams
            self._llm_class = self._llm_class or vllm.LLM
        if self._llm is None:
            from campaign_orchestrator.generation.engines.vllm_engine import stop_with

            self._llm = self._llm_class(model=self.model, revision=self.revision, **self._engine)
            stop_with(self, self._llm)
            ran = self.ran_dtype()
            if ran is not None and self.dtype != "default" and ran != self.dtype:
                raise BackendError(
                    f"teacher {self.model}: its generations are keyed for {self.device}:{self.dtype} but vLLM "
                    f"started in {ran}; name the dtype in teacher.engine_args.dtype or teacher.compute_dtype"
                )

    def ran_dtype(self) -> str | None:
        """The dtype the started engine computes in, as vLLM reports it (None before it starts, or for an
        engine that does not say: a stand-in)."""
        cfg = getattr(getattr(self._llm, "llm_engine", None), "model_config", None)
        dtype = getattr(cfg, "dtype", None)
        return None if dtype is None else str(dtype).removeprefix("torch.")

    def _lora(self):
        from campaign_orchestrator.generation.engines.vllm_engine import lora_request

        return lora_request(self.adapter_dir, self._lora_class)

    @property
    def llm(self):
        self._load()
        return self._llm

    @property
    def SamplingParams(self):  # noqa: N802 - vLLM's class name
        self._load()
        return self._sp

    @property
    def tokenizer(self):
        """The teacher's tokenizer: loaded with transformers from a local checkpoint (the one every local backend
        renders with), else vLLM's own (a hub id vLLM fetched)."""
        if self._tok is None:
            if (Path(self.model) / "config.json").exists():
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.model, revision=self.revision)
            else:
                self._tok = self.llm.get_tokenizer()
        return self._tok

    def _render(self, req: GenRequest) -> list[int]:
        """The prompt's token ids, rendered as every local backend renders it
        (:func:`~campaign_orchestrator.dataset.formatting.render_prompt_ids`: a bare prompt as one user turn of
        the chat template when the tokenizer has one, context messages whole), so a ``vllm`` teacher answers what
        a ``transformers`` teacher over the same weights is asked, and what the student is trained on."""
        from campaign_orchestrator.dataset.formatting import render_prompt_ids

        return render_prompt_ids(self.tokenizer, list(req.messages) if req.messages is not None else req.prompt)

    def _params(self, s: Sampling, n: int, seed: int):
        kw: dict = {"n": n, "temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_new_tokens}
        if not s.greedy:
            kw["seed"] = seed
        if s.logprobs:
            kw["logprobs"] = s.logprobs
        return self.SamplingParams(**kw)

    def _completion(self, ro, co, k: int | None, latency: float) -> Completion:
        from campaign_orchestrator.generation.engines.vllm_engine import vllm_completion

        return vllm_completion(ro, co, k, latency)

    def _call(self, items: list[tuple[list[GenRequest], Any, list[int]]]) -> list:
        prompts = [{"prompt_token_ids": ids} for _g, _p, ids in items]
        params = [p for _g, p, _ids in items]
        lora = {"lora_request": self._lora()} if self.adapter_dir is not None else {}
        return self.llm.generate(prompts, sampling_params=params, use_tqdm=False, **lora)

    def _deliver(self, items, outputs, s: Sampling, latency: float, on_done: OnDone) -> None:
        for (group, _p, _ids), ro in zip(items, outputs, strict=True):
            for req, co in zip(group, ro.outputs, strict=True):
                on_done(req, self._completion(ro, co, s.logprobs, latency))

    def run(self, requests: Sequence[GenRequest], sampling: Sampling, on_done: OnDone) -> None:
        if not requests:
            return
        self._max_len = _max_model_len(self.llm)
        groups: dict[str, list[GenRequest]] = {}
        for r in requests:
            groups.setdefault(json.dumps(r.payload), []).append(r)
        items: list[tuple[list[GenRequest], Any, list[int]]] = []
        for group in groups.values():
            ids = self._render(group[0])
            if self._max_len and len(ids) >= self._max_len:
                for r in group:
                    on_done(
                        r,
                        Completion.failed(
                            f"prompt of {len(ids)} tokens does not fit the teacher's context "
                            f"(max_model_len {self._max_len})",
                            len(ids),
                        ),
                    )
                continue
            indexes = sorted(r.sample_index for r in group)
            if not sampling.greedy and len(group) > 1 and indexes == list(range(len(group))):
                params = self._params(sampling, len(group), sampling.seed)
                items.append((sorted(group, key=lambda r: r.sample_index), params, ids))
            else:
                items += [([r], self._params(sampling, 1, r.seed), ids) for r in group]
        for start in range(0, len(items), self.chunk_size):
            self._run_part(items[start : start + self.chunk_size], sampling, on_done)

    def _run_part(self, part, sampling: Sampling, on_done: OnDone) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self._call(part)
        except ValueError as e:
            if len(part) == 1:
                for r in part[0][0]:
                    on_done(r, Completion.failed(f"vLLM rejected the prompt: {e}"))
                return
            for it in part:  # isolate the prompt(s) vLLM refuses
                self._run_part([it], sampling, on_done)
            return
        latency = time.perf_counter() - t0
        self.generate_s += latency
        self._deliver(part, outputs, sampling, latency, on_done)

    def stats(self) -> dict:
        """What the started engine computed in and vLLM's own prefix-cache counters (tokens looked up and found
        cached: a teacher context shared by many prompts is found after its first prefill); ``{}`` before it
        starts."""
        from campaign_orchestrator.generation.engines.vllm_engine import prefix_cache_counts

        ran = self.ran_dtype()
        if ran is None:
            return {}
        out = {"engine": "vllm", "compute_dtype": ran, "compute_dtype_reason": f"vLLM on {self.device}"}
        return out | (prefix_cache_counts(self._llm) or {})

    def close(self) -> None:
        """Stop the engine (vLLM's engine-core process and its memory); a later request starts another."""
        from campaign_orchestrator.generation.engines.vllm_engine import shutdown_llm

        llm, self._llm, self._tok = self._llm, None, None
        shutdown_llm(llm)


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
    if spec.backend == "vllm":
        return VLLMBackend(
            str(model_path or spec.model),
            ident,
            spec.revision,
            llm=llm,
            sampling_params=sampling_params,
            chunk_size=spec.batch_size,
            tensor_parallel_size=spec.tensor_parallel_size,
            engine_args=spec.engine_args,
            seed=spec.sampling.seed,
            dtype=spec.compute_dtype,
            top_k=spec.sampling.logprobs,
            llm_class=llm_class,
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
