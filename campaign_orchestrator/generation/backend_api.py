"""The teacher backend interface, below every backend: the protocol a backend answers (:class:`Backend`, its
``on_done`` callback :data:`OnDone`), the error it raises for a whole batch (:class:`BackendError`) and the identity
that keys its answers in the generation cache (:func:`teacher_identity`, :func:`weights_identity`).

:mod:`campaign_orchestrator.generation.backends` builds the backends (and still exports these names); this module
sits apart from it so that an engine that also answers as a backend (vLLM's,
:class:`~campaign_orchestrator.generation.engines.vllm_engine.VLLMEngine`) imports it without an import circle.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

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
