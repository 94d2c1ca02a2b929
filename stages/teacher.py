"""The campaign's teacher as the stages use it: where its weights are, its identity for the generation cache, the
backend that answers (``transformers`` runs a local checkpoint, ``vllm`` offline batch inference on this machine's
GPUs, ``openai`` any OpenAI-compatible endpoint), its generation cache, and what its new generations used.

The backends, the generation loop and the cache are plain modules under ``campaign_orchestrator/generation/``;
this module turns a :class:`campaigns.spec.TeacherSpec` into them and reads the API key from the environment
variable the spec names (never from the spec)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from campaign_orchestrator import models
from campaigns.spec import CampaignSpec, TeacherSpec
from stages.common import model_identity
from stages.context import TeacherSettings
from stages.storage import Store

UNPRICED_NOTE = "unknown: teacher.price is `unpriced`"


@dataclass(frozen=True)
class TeacherModel:
    """The teacher's local checkpoint (None: an endpoint; a vLLM hub id), its weights' fingerprint and its
    identity for the generation cache (:func:`campaign_orchestrator.generation.backends.spec_identity`)."""

    path: Path | None
    weights_id: str | None
    identity: str


def teacher_model_path(store: Store, spec: CampaignSpec) -> Path | None:
    """The local checkpoint of the teacher, or None (an endpoint; a vLLM hub id)."""
    t = spec.teacher
    if t.backend == "openai":
        return None
    if t.backend == "vllm" and models.is_hub_id(t.model, spec.project_dir):
        return None  # a hub id vLLM downloads itself; identified by name + revision
    return store.resolve_model(t.model, spec.project_dir, t.revision)


def teacher_model(store: Store, spec: CampaignSpec) -> TeacherModel:
    """The teacher's checkpoint, fingerprint and identity, computed once per stage."""
    from campaign_orchestrator.generation.backends import spec_identity

    t = spec.teacher
    path = teacher_model_path(store, spec)
    weights_id = model_identity(path, t.revision) if path is not None else None
    return TeacherModel(path, weights_id, spec_identity(t, path, weights_id))


def teacher_backend(settings: TeacherSettings, spec: TeacherSpec, model_path: Path | None, weights_id: str | None):
    """A :class:`campaign_orchestrator.generation.backends.Backend` for ``spec`` (``model_path``: the resolved local
    checkpoint, when there is one; ``weights_id``: its precomputed fingerprint)."""
    from campaign_orchestrator.generation.backends import make_backend, read_api_key

    api_key = read_api_key(spec.api_key_env) if spec.api else None
    if settings.vllm_chunk_size and spec.backend == "vllm":
        spec = spec.model_copy(update={"batch_size": settings.vllm_chunk_size})
    return make_backend(spec, model_path, api_key=api_key, weights_id=weights_id)


def teacher_cache(store: Store, identity: str, sampling):
    """The generation cache of the model ``identity`` answering with ``sampling``."""
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.requests import namespace

    return GenerationCache(store.cache_store(), namespace(identity, sampling), store.spool_dir())


def teacher_setup(ctx, spec: CampaignSpec, sampling) -> tuple:
    """The teacher's backend, identity and generation cache for ``sampling`` (the same cache for its training
    generations and for scoring it on the held-out items): ``(backend, cache, model)``."""
    tm = teacher_model(ctx.store, spec)
    backend = teacher_backend(ctx.teacher, spec.teacher, tm.path, tm.weights_id)
    return backend, teacher_cache(ctx.store, tm.identity, sampling), tm


def teacher_usage(stats) -> dict:
    """What this run's new generations used, as ``pricing.bill`` prices it by the teacher's one price field:
    API tokens paid for in this run (cache hits are free) x ``teacher.price``, or generation seconds x
    ``teacher.hardware`` (x GPUs for vLLM); billed None when ``price: unpriced`` (the spend is unknown)."""
    return {
        "seconds": stats.generate_s,
        "prompt_tokens": stats.new_prompt_tokens,
        "completion_tokens": stats.new_completion_tokens,
    }


def ask_kwargs(t: TeacherSpec) -> dict:
    """How the teacher is asked, as every executor takes it: chat, its context turns and the categories they
    precede."""
    return {"chat": t.chat, "context": [m.model_dump() for m in t.context], "context_categories": t.context_categories}


def route(spec: CampaignSpec, rows: list[dict]) -> dict[str, list[dict]]:
    """Each teacher's rows (by the row's ``category``; the default teacher takes the rest), every teacher present,
    in the file's order; one teacher takes every row."""
    out: dict[str, list[dict]] = {e.name: [] for e in spec.teachers}
    for r in rows:
        out[spec.teacher_for(r.get("category")).name].append(r)
    return out
