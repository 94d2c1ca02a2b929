"""Materialize a campaign up to its sweep (``hparam_sweep`` and everything upstream) in this process, on an
ephemeral Dagster instance: the process the sweep tests SIGKILL mid-rung, and the rerun after it.

    python -m tests.support.sweep_run CAMPAIGN.yaml ARTIFACT_ROOT
"""

import sys

from dagster import AssetKey, AssetSelection, DagsterInstance, define_asset_job

from assets.location import build_definitions
from campaigns.loader import load_campaigns


def run_sweep(path: str, root: str, instance: DagsterInstance | None = None):
    name = next(iter(load_campaigns([path]).campaigns))
    defs = build_definitions([path], artifact_root=root)
    job = define_asset_job("sweep_only", selection=AssetSelection.keys(AssetKey([name, "hparam_sweep"])).upstream())
    from dagster import Definitions

    full = Definitions.merge(defs, Definitions(jobs=[job]))
    return full.resolve_job_def("sweep_only").execute_in_process(
        instance=instance or DagsterInstance.ephemeral(), raise_on_error=False
    )


if __name__ == "__main__":
    result = run_sweep(sys.argv[1], sys.argv[2])
    sys.exit(0 if result.success else 1)
