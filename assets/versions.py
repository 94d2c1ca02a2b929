"""The stages' code versions on their Dagster assets. What each stage's code version covers, and how ``compute_dtype:
auto`` and model fingerprints enter it, is in ``stages/versions.py``; the ``<campaign>_model_change`` sensor
(``assets/sensors.py``) compares them with what each stage's latest materialization recorded."""

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
