"""Code versions and automation conditions of the campaign stages, from the spec.

Each stage's code version is a hash of the slice of the campaign spec that changes its output
(plus a logic version), so Dagster marks exactly the affected stages stale when that slice
changes:

========================  =====================================================================
stage                      what its code version covers
========================  =====================================================================
prompts                    ``data`` (source, fields, held-out split), not the filters
teacher_generations        teacher identity: backend, model, revision, weights hash, sampling
distillation_set           ``data.filters``
tokenized_dataset          student base identity (tokenizer), ``training.max_seq_len``
student_adapter            student base identity, LoRA, quantization, training settings
evaluation                 ``evaluation``, student base identity, teacher identity (if scored)
promoted_model             promotion logic only
campaign_cost              ``cost``
========================  =====================================================================

A model's identity is its reference and revision, plus, for a model given as a path, the
fingerprint of its files (``campaign_orchestrator.content.model_fingerprint``: the sha256 of every byte of
every file, each file version read once and its digest kept in the per-user hash cache), taken when the
code location loads. ``@demo/``
models are assets of their own (``demo_models``), so their rebuilds reach the stages as
upstream data changes.

A ``compute_dtype: auto`` enters these code versions as written: they are computed when the code location
loads, which never imports torch. The stage keys (the content-addressed stage directories and the
generation cache's namespace) hold what it resolved to on the host that runs the stage (teacher
generations, the adapter, the local evaluation: ``<device kind>:<dtype>``, from the per-host measurement
in ``campaign_orchestrator.hardware``), so the same campaign on a CPU with native bf16 and on one without
shares no cached generation, adapter or evaluation: the second host regenerates, retrains and re-evaluates.

The campaign's ``<campaign>_model_change`` sensor (``assets/sensors.py``) compares these code
versions, computed afresh at every tick (so weights replaced in place are seen without a
reload), with the ones each stage's latest materialization recorded, and re-materializes the
stale stages and everything downstream of them in one run, nothing upstream.
"""

from __future__ import annotations

import logging
from pathlib import Path

from campaign_orchestrator import models
from campaign_orchestrator.content import short, value_sha256
from campaigns.spec import CampaignSpec
from stages.common import model_identity
from stages.student_adapter import training_key_fields

log = logging.getLogger(__name__)

# Bump a stage's logic version when its code changes what it produces.
LOGIC_VERSIONS = {
    "prompts": 1,
    "teacher_generations": 1,
    "distillation_set": 1,
    "tokenized_dataset": 1,
    "student_adapter": 1,
    "evaluation": 1,
    "promoted_model": 1,
    "campaign_cost": 1,
}


def model_ref_identity(ref: str, revision: str | None, base: Path | None = None) -> dict:
    """What identifies a model for versioning: the reference, revision and, for a path (relative: to
    ``base``, the campaign's project directory), its files."""
    m = models.parse(ref, None, base)
    out = models.identity(ref, base, revision)
    if m.kind in ("demo", "packaged", "hub", "s3", "gguf"):
        return out  # demo: rebuilds arrive as upstream updates; gguf: its file hash; hub, s3: name + revision
    if m.path.is_dir():
        out["weights"] = model_identity(m.path)
    else:
        log.warning("model %s not found at %s when loading the code location: versioned by name only", ref, m.path)
    return out


def teacher_identity(spec: CampaignSpec) -> dict | list:
    """The teacher's identity for the code version (several teachers: each one's, with its name and categories, so
    a change to any of them, or a category moved, is seen)."""
    if spec.several_teachers:
        return [
            {"name": e.name, "categories": e.categories, **teacher_identity(spec.for_teacher(e))} for e in spec.teachers
        ]
    t = spec.teacher
    if t.backend == "openai":
        ident = {"ref": t.model, "revision": t.revision, "base_url": t.base_url, "chat": t.chat}
    else:
        ident = model_ref_identity(t.model, t.revision, spec.project_dir)
    return {"backend": t.backend, **ident, "sampling": t.sampling.model_dump()}


def student_identity(spec: CampaignSpec) -> dict:
    return model_ref_identity(spec.student.base_model, spec.student.revision, spec.project_dir)


def stage_settings(spec: CampaignSpec) -> dict[str, dict]:
    """Per stage, the spec slice (and model identities) its output depends on."""
    d, ev, tr = spec.data, spec.evaluation, spec.training
    student = student_identity(spec)
    scores_teacher = ev.score_teacher
    return {
        "prompts": {"data": d.model_dump(exclude={"filters", "decontamination", "replay"})},
        "teacher_generations": {"teacher": teacher_identity(spec)},
        "distillation_set": {
            "filters": d.filters.model_dump(),
            "decontamination": d.decontamination.model_dump(),
            "gate_suites": [x.model_dump(include={"name", "source", "kind", "lm_eval"}) for x in ev.suites],
        }
        | ({"replay": d.replay.model_dump(), "student": student} if d.replay else {}),
        "tokenized_dataset": {"student": student, "max_seq_len": tr.max_seq_len},
        "student_adapter": {"student": student, "training": training_key_fields(spec)},
        "evaluation": {
            "evaluation": ev.model_dump(),
            "student": student,
            "teacher": teacher_identity(spec) if scores_teacher else None,
        },
        "promoted_model": {},
        "campaign_cost": {"cost": spec.cost.model_dump()},
    }


def code_versions(spec: CampaignSpec) -> dict[str, str]:
    return {
        stage: f"v{LOGIC_VERSIONS[stage]}-{short(value_sha256(settings), 16)}"
        for stage, settings in stage_settings(spec).items()
    }


# What each stage's code version covers, for run reasons and docs.
COVERS = {
    "prompts": "data source, fields and held-out split",
    "teacher_generations": "teacher: backend, model, revision, weights, sampling",
    "distillation_set": "data filters, decontamination",
    "tokenized_dataset": "student base tokenizer, max_seq_len",
    "student_adapter": "student base (model, revision, weights), LoRA, quantization, training settings",
    "evaluation": "evaluation settings, student base, teacher",
    "promoted_model": "promotion logic",
    "campaign_cost": "cost settings",
}
