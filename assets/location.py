"""Build one Dagster ``Definitions`` from every campaign file.

Each campaign gets its asset graph (key prefix and group = campaign name), its gate check, a
job ``<name>_campaign`` and, when its spec has one, a schedule. A broken file never breaks
the others: it becomes an ``invalid_campaigns`` asset carrying its validation report.
"""

import logging

from dagster import AssetSelection, Definitions, ScheduleDefinition, define_asset_job, DefaultScheduleStatus

from assets import adapter, cluster, cost, demo_models, distillation, evaluation, generations, invalid, prompts, promotion, tokenized
from assets.io_manager import ManifestIOManager
from campaigns.loader import load_campaigns
from campaigns.spec import CampaignSpec
from resources import ArtifactStore, LocalTorchrunLauncher, PricingResource, TeacherResource
from resources.cluster import ClusterValidation

log = logging.getLogger(__name__)

STAGE_BUILDERS = (prompts, generations, distillation, tokenized, adapter, evaluation, promotion, cost)


def campaign_assets(spec: CampaignSpec) -> list:
    return [m.build(spec) for m in STAGE_BUILDERS]


def campaign_job_name(name: str) -> str:
    return f"{name}_campaign"


def default_resources(artifact_root: str = "artifacts") -> dict:
    return {
        "storage": ArtifactStore(root=artifact_root),
        "io_manager": ManifestIOManager(root=artifact_root),
        "teacher": TeacherResource(),
        "launcher": LocalTorchrunLauncher(),
        "pricing": PricingResource(),
        "cluster": ClusterValidation(),
    }


def build_definitions(campaign_files: list[str] | None = None, artifact_root: str = "artifacts",
                      resources: dict | None = None) -> Definitions:
    loaded = load_campaigns(campaign_files)
    for err in loaded.errors:
        log.warning("invalid campaign file (other campaigns still load):\n%s", err.render())
    assets: list = [demo_models.demo_models, *cluster.ASSETS]
    jobs, schedules = [cluster.job()], []
    for name, spec in loaded.campaigns.items():
        assets += campaign_assets(spec)
        job = define_asset_job(campaign_job_name(name), selection=AssetSelection.groups(name).upstream(),
                               description=f"Run campaign {name} end to end ({loaded.sources[name]}).",
                               tags={"campaign": name})
        jobs.append(job)
        if spec.schedule is not None:
            schedules.append(ScheduleDefinition(
                name=f"{name}_schedule", job=job, cron_schedule=spec.schedule.cron,
                execution_timezone=spec.schedule.timezone, tags={"trigger": "schedule"},
                default_status=DefaultScheduleStatus.RUNNING if spec.schedule.enabled else DefaultScheduleStatus.STOPPED))
    assets += [invalid.build(e) for e in loaded.errors]
    return Definitions(assets=assets, jobs=jobs, schedules=schedules,
                       resources=resources or default_resources(artifact_root))
