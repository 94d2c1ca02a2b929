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

from dagster import AssetsDefinition

from campaigns.spec import CampaignSpec
from stages.versions import COVERS, LOGIC_VERSIONS, code_versions  # noqa: F401 - the sensors read them here


def with_versions(assets_defs: list[AssetsDefinition], spec: CampaignSpec) -> list[AssetsDefinition]:
    """The campaign's stage assets with their code versions set (keys and everything else unchanged)."""
    versions = code_versions(spec)

    def apply(s):
        stage = s.key.path[-1]
        if len(s.key.path) != 2 or s.key.path[0] != spec.name or stage not in versions:
            return s
        return s.replace_attributes(code_version=versions[stage])

    return [a.map_asset_specs(apply) if isinstance(a, AssetsDefinition) else a for a in assets_defs]
