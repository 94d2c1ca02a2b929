"""Build one Dagster ``Definitions`` from every campaign file.

Each campaign gets its asset graph (key prefix and group = campaign name), its gate check, a
job ``<name>_campaign`` and, when its spec has one, a schedule; its sensors, drift check and
the stages' code versions come from ``assets/sensors.py`` and ``assets/versions.py``. One sensor,
``reap_dead_campaign_runs`` (``assets/run_recovery.py``), frees the pool slots of runs whose
``campaign run`` process died. A broken file never breaks the others: it becomes an
``invalid_campaigns`` asset carrying its validation report.
"""

import logging

from dagster import AssetSelection, DefaultScheduleStatus, Definitions, ScheduleDefinition, define_asset_job

from assets import (
    campaign_cost,
    cluster,
    demo_models,
    distillation_set,
    evaluation,
    hparam_sweep,
    invalid_campaigns,
    promoted_model,
    prompts,
    student_adapter,
    sweep_trial,
    teacher_generations,
    tokenized_dataset,
)
from assets.drift_evaluation import drift_key
from assets.io_manager import ManifestIOManager
from assets.run_recovery import reaper_sensor
from assets.sensors import automation_tags, campaign_automation, trigger_tags
from assets.versions import with_versions
from campaigns.loader import load_campaigns
from campaigns.spec import CampaignSpec
from resources import ArtifactStore, LocalTorchrunLauncher, PricingResource, TeacherResource
from resources.cluster import ClusterValidation
from resources.k8s import K8sTrainingLauncher
from resources.k8s.kuberay_launcher import KubeRayJobLauncher
from resources.training_launcher import TrainingLauncher
from stages.campaign_cost import upstream

log = logging.getLogger(__name__)

STAGE_BUILDERS = (
    prompts,
    teacher_generations,
    distillation_set,
    tokenized_dataset,
    student_adapter,
    evaluation,
    promoted_model,
    campaign_cost,
)


def campaign_assets(spec: CampaignSpec) -> list:
    # a fully on-policy campaign (teacher_generations: none) has no teacher stage: its prompts feed the trainer
    kept = {*upstream(spec), "prompts", "promoted_model", "campaign_cost"}
    out = [m.build(spec) for m in STAGE_BUILDERS if m.__name__.rpartition(".")[2] in kept]
    out.append(evaluation.gate(spec))  # the blocking gate check: its own step, after the evaluation
    if spec.sweep is not None:  # the sweep step and its per-trial partitions (docs/sweeps.md)
        out += [hparam_sweep.build(spec), sweep_trial.build(spec)]
    return out


def campaign_job_name(name: str) -> str:
    return f"{name}_campaign"


def default_resources(artifact_root: str = "artifacts", ledger: str | None = None) -> dict:
    return {
        "storage": ArtifactStore(root=artifact_root),
        "io_manager": ManifestIOManager(root=artifact_root, ledger=ledger),
        "teacher": TeacherResource(),
        "launcher": TrainingLauncher(local=LocalTorchrunLauncher(), k8s=K8sTrainingLauncher()),
        "pricing": PricingResource(ledger=ledger),
        "cluster": ClusterValidation(),
        "kuberay": KubeRayJobLauncher(),  # generation stages with execution.kuberay (stages/executors.py)
    }


def build_definitions(
    campaign_files: list[str] | None = None, artifact_root: str = "artifacts", resources: dict | None = None
) -> Definitions:
    loaded = load_campaigns(campaign_files)
    for err in loaded.errors:
        log.warning("invalid campaign file (other campaigns still load):\n%s", err.render())
    assets: list = [*demo_models.ASSETS, *cluster.ASSETS]
    jobs, schedules, sensors = [cluster.job()], [], [reaper_sensor()]
    for name, spec in loaded.campaigns.items():
        assets += with_versions(campaign_assets(spec), spec)
        job = define_asset_job(
            campaign_job_name(name),
            selection=(
                AssetSelection.groups(name).upstream()
                - AssetSelection.keys(drift_key(spec))
                - AssetSelection.keys(*([sweep_trial.trial_key(spec)] if spec.sweep else []))
            ),
            description=f"Run campaign {name} end to end ({loaded.sources[name]}).",
            tags={"campaign": name, "trigger": "manual"},
        )  # sensors and schedules override it
        jobs += [job, promoted_model.approve_job(spec)]
        if spec.schedule is not None:
            schedules.append(
                ScheduleDefinition(
                    name=f"{name}_schedule",
                    job=job,
                    cron_schedule=spec.schedule.cron,
                    metadata=automation_tags(spec, "schedule"),
                    execution_timezone=spec.schedule.timezone,
                    tags=trigger_tags(
                        spec, "schedule", f"campaign schedule (cron '{spec.schedule.cron}' {spec.schedule.timezone})"
                    ),
                    default_status=DefaultScheduleStatus.RUNNING
                    if spec.schedule.enabled
                    else DefaultScheduleStatus.STOPPED,
                )
            )
        auto = campaign_automation(spec, campaign_job_name(name))
        assets += auto.assets
        jobs += auto.jobs
        schedules += auto.schedules
        sensors += auto.sensors
    assets += [invalid_campaigns.build(e) for e in loaded.errors]
    return Definitions(
        assets=assets,
        jobs=jobs,
        schedules=schedules,
        sensors=sensors,
        resources=resources or default_resources(artifact_root),
    )
