"""A Ray generation job as data: what runs (recipe), on what (prompts), into which cache, with which settings.

The driver inside a Dagster step builds a :class:`Job` and runs it in-process (:func:`campaign_orchestrator.
scaleout.stage.run_job`); on Kubernetes the same job is written as ``JOB.json`` and run inside the cluster by
``python -m campaign_orchestrator.generation.scaleout --job JOB.json``. Everything here is JSON (no pickles cross the
Dagster/cluster boundary); secrets travel as environment variable *names* only.

JOB.json::

    {"kind": "teacher_generations" | "teacher_scoring" | "answers",
     "recipe": {"type": "backend", "spec": {<teacher: section>}, "model_path": ..., "weights_id": ...}
             | {"type": "answer", "generator": {<LocalModelFactory fields>}, "identity": "...", "model": "..."},
     "identity": "<the model identity every request key hashes>",
     "prompts": "<Parquet path or s3:// URI: columns id, prompt, optional category>",
     "output": "<Parquet path the generation rows are written to>",
     "cache": {"store_url": ..., "namespace": ..., "spool_dir": ..., "s3_endpoint_url": ..., "s3_region": ...},
     "sampling": {"max_new_tokens": ..., "temperature": ..., "top_p": ..., "seed": ..., "n": ..., "logprobs": ...},
     "chat": false, "context": [{"role": ..., "content": ...}], "context_categories": null,
     "execution": {<execution: section>}}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("teacher_generations", "teacher_scoring", "answers")


@dataclass(frozen=True)
class AnswerFactory:
    """A local model (+ adapter) answering evaluation prompts, as a teacher-like backend: a
    :class:`~campaign_orchestrator.generation.factories.LocalModelFactory` plus the identity its answers are cached
    under (its weights, adapter and resolved dtype), so evaluation answers are resumable per shard too."""

    generator: Any  # LocalModelFactory
    identity: str
    model: str = "local"

    def build(self):
        from campaign_orchestrator.generation.backends import TransformersBackend

        return TransformersBackend(
            self.generator.model_dir, self.model, self.identity, local_model=self.generator.build()
        )


def recipe_to_json(recipe) -> dict:
    from campaign_orchestrator.generation.factories import BackendFactory

    if isinstance(recipe, BackendFactory):
        return {
            "type": "backend",
            "spec": recipe.spec.model_dump(mode="json"),
            "model_path": recipe.model_path,
            "weights_id": recipe.weights_id,
        }
    if isinstance(recipe, AnswerFactory):
        return {
            "type": "answer",
            "generator": asdict(recipe.generator),
            "identity": recipe.identity,
            "model": recipe.model,
        }
    raise TypeError(f"no JSON form for recipe {type(recipe).__name__}")


def recipe_from_json(d: dict):
    from campaign_orchestrator.generation.factories import BackendFactory, LocalModelFactory

    if d.get("type") == "backend":
        from campaigns.spec import TeacherSpec

        return BackendFactory(TeacherSpec.model_validate(d["spec"]), d.get("model_path"), d.get("weights_id"))
    if d.get("type") == "answer":
        return AnswerFactory(LocalModelFactory(**d["generator"]), d["identity"], d.get("model", "local"))
    raise ValueError(f"JOB.json recipe.type must be 'backend' or 'answer', got {d.get('type')!r}")


@dataclass
class Job:
    kind: str
    recipe: Any
    identity: str
    prompts: str
    output: str
    cache: dict
    sampling: dict
    execution: dict
    chat: bool = False
    context: list = field(default_factory=list)
    context_categories: list | None = None

    def to_json(self) -> str:
        d = {k: v for k, v in vars(self).items() if k != "recipe"} | {"recipe": recipe_to_json(self.recipe)}
        return json.dumps(d, indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "JOB.json") -> Job:
        d = json.loads(text)
        missing = [
            k
            for k in ("kind", "recipe", "identity", "prompts", "output", "cache", "sampling", "execution")
            if k not in d
        ]
        if missing:
            raise ValueError(f"{source}: missing field(s) {missing}")
        if d["kind"] not in KINDS:
            raise ValueError(f"{source}: kind must be one of {KINDS}, got {d['kind']!r}")
        return cls(**(d | {"recipe": recipe_from_json(d["recipe"])}))

    @classmethod
    def read(cls, path: str | Path) -> Job:
        return cls.from_json(Path(path).read_text(), str(path))
