"""A `campaign run` stand-in: ``python -m tests.support.launch_parent JOB_FILE WORKDIR RUN_ID``.

Materializes one asset that launches the TrainJob through the real ``LocalTorchrunLauncher``, on the
instance of ``$DAGSTER_HOME``, with the owner tags ``campaign run`` puts on its runs; tests SIGKILL it.
"""

import sys
from pathlib import Path

from dagster import DagsterInstance, Definitions, MaterializeResult, asset, define_asset_job

from assets.run_recovery import owner_tags
from resources.local_launcher import LocalTorchrunLauncher
from training.config import TrainJob


def main() -> int:
    job_file, workdir, run_id = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

    @asset(pool="gpu")
    def train(context) -> MaterializeResult:
        LocalTorchrunLauncher().launch(context, TrainJob.read(job_file), workdir)
        return MaterializeResult()

    job = Definitions(assets=[train], jobs=[define_asset_job("train_job")]).resolve_job_def("train_job")
    with DagsterInstance.get() as instance:  # as campaign_app/cli/run.py runs a campaign
        result = job.execute_in_process(instance=instance, run_id=run_id, tags=owner_tags(), raise_on_error=False)
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main())
