"""The sensors and schedules that re-run a campaign by itself, built from its ``automation`` spec.

Per campaign ``<c>``:

- ``<c>_new_data`` (sensor): new prompt files in ``data.source`` (by content hash) past the
  spec's threshold request a run of ``prompts`` and everything downstream.
- ``<c>_model_change`` (sensor): a stage made with another code version than the spec gives it
  now (teacher, student base incl. weights hash, training settings, ...; ``assets/versions.py``)
  or from an older upstream asset is stale: it and its downstream stages are re-materialized.
- ``<c>_drift`` (schedule): materializes ``<c>/drift_evaluation``, the promoted model on the
  freshest held-out data.
- ``<c>_drift_retrain`` (asset sensor): a DRIFTED verdict requests a retraining run.

Every run they start carries the tags ``trigger`` (``sensor``, ``model_change``, ``schedule``,
``drift``; ``campaign run`` sets ``manual``), ``trigger_reason`` (a sentence) and ``campaign``,
shown on the run's page in the UI. Each of them exists for every campaign, switched off unless
the spec enables it, so it can be turned on in the UI (Automation tab) at any time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dagster import (
    AssetSelection,
    DagsterRunStatus,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    EventLogEntry,
    RunRequest,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SkipReason,
    asset_sensor,
    define_asset_job,
    schedule,
    sensor,
)

from assets.common import STAGES, key
from assets.drift_evaluation import drift_key
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore

TRIGGER, REASON = "trigger", "trigger_reason"
IN_PROGRESS = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
]


def trigger_tags(spec: CampaignSpec, trigger: str, reason: str, **extra: str) -> dict[str, str]:
    return {"campaign": spec.name, TRIGGER: trigger, REASON: reason, **extra}


def automation_tags(spec: CampaignSpec, kind: str) -> dict[str, str]:
    """Definition tags (sensors) and metadata (schedules) that group a campaign's automation in the UI: filter the
    Automation tab by ``campaign`` to find all of it together (names are ``<campaign>_<kind>`` too)."""
    return {"campaign": spec.name, "automation": kind}


def stage_keys(spec: CampaignSpec):
    """What a retraining run materializes: every campaign stage (cached stages cost nothing)."""
    return [key(spec, s) for s in STAGES]


def _sensor_status(on: bool) -> DefaultSensorStatus:
    return DefaultSensorStatus.RUNNING if on else DefaultSensorStatus.STOPPED


def new_data_sensor(spec: CampaignSpec, job_name: str):
    nd = spec.automation.new_data

    @sensor(
        name=f"{spec.name}_new_data",
        tags=automation_tags(spec, "new_data"),
        job_name=job_name,
        minimum_interval_seconds=nd.interval_s,
        default_status=_sensor_status(nd.enabled),
        description=f"New files in `{spec.data.source}` (by content hash) re-run campaign {spec.name} from prompts "
        f"once {nd.min_new_rows}+ new rows"
        + (f" and +{nd.min_new_fraction:.0%}" if nd.min_new_fraction else "")
        + " are pending.",
    )
    def new_data(context: SensorEvaluationContext):
        from stages.automation import new_data as check

        decision, cursor, error = check(spec, context.cursor)
        if error is not None:
            return SkipReason(error)
        context.update_cursor(cursor)
        context.log.info(decision.reason)
        if not decision.request:
            return SkipReason(decision.reason)
        return RunRequest(
            run_key=decision.run_key,
            asset_selection=stage_keys(spec),
            tags=trigger_tags(
                spec,
                "sensor",
                decision.reason,
                new_files=",".join(decision.new_files)[:500],
                new_rows=str(decision.new_rows),
            ),
        )

    return new_data


def _materialized(instance, order: list[str], upstream: set[str]) -> tuple[dict, dict]:
    """``(latest, recorded)``: each asset's latest data version, and for the campaign's stages (``order``) the code
    version and input data versions their latest materialization was made with (None: never materialized)."""
    from dagster import AssetKey, DataProvenance

    from stages.automation import recorded as Recorded

    latest, recorded = {}, {}
    for k in set(order) | upstream:
        ev = instance.get_latest_materialization_event(AssetKey.from_user_string(k))
        tags = ev.asset_materialization.tags if ev and ev.asset_materialization else None
        latest[k] = (tags or {}).get("dagster/data_version")
        if k in order:
            prov = DataProvenance.from_tags(tags) if tags else None
            recorded[k] = (
                None
                if prov is None
                else Recorded(
                    prov.code_version, {p.to_user_string(): v.value for p, v in prov.input_data_versions.items()}
                )
            )
    return latest, recorded


def model_change_sensor(spec: CampaignSpec, job_name: str):
    mc = spec.automation.model_change

    @sensor(
        name=f"{spec.name}_model_change",
        tags=automation_tags(spec, "model_change"),
        job_name=job_name,
        minimum_interval_seconds=mc.interval_s,
        default_status=_sensor_status(mc.enabled),
        description=f"Re-materializes the {spec.name} stages made with another teacher, student base or settings "
        f"(code version) or from an older upstream asset, and everything downstream of them.",
    )
    def model_change(context: SensorEvaluationContext):
        from dagster import AssetKey, RunsFilter

        from assets.versions import COVERS, code_versions
        from stages.automation import stale_plan as plan

        instance = context.instance
        busy = instance.get_run_records(RunsFilter(tags={"campaign": spec.name}, statuses=IN_PROGRESS), limit=1)
        if busy:
            return SkipReason(f"a {spec.name} run is in progress ({busy[0].dagster_run.run_id}); checking after it")
        graph = context.repository_def.asset_graph
        keys = stage_keys(spec)
        order = [k.to_user_string() for k in keys]
        parents = {k.to_user_string(): [p.to_user_string() for p in graph.get(k).parent_keys] for k in keys}
        current = {
            key(spec, st).to_user_string(): v for st, v in code_versions(spec).items()
        }  # fresh: sees new weights
        upstream = {p for ps in parents.values() for p in ps}
        latest, recorded = _materialized(instance, order, upstream)
        p = plan(
            order,
            parents,
            current,
            recorded,
            latest,
            explain={key(spec, st).to_user_string(): c for st, c in COVERS.items()},
        )
        if not p.stale:
            made = sum(1 for r in recorded.values() if r is not None)
            return SkipReason(
                f"no stale stage ({made}/{len(order)} materialized, all with their current code and inputs)"
            )
        return RunRequest(
            run_key=p.run_key,
            asset_selection=[AssetKey.from_user_string(k) for k in p.selection],
            tags=trigger_tags(spec, "model_change", f"stale: {p.reason()}"),
        )

    return model_change


def drift_job_name(spec: CampaignSpec) -> str:
    return f"{spec.name}_drift_check"


def drift_schedule(spec: CampaignSpec, drift_job):
    dr = spec.automation.drift

    @schedule(
        name=f"{spec.name}_drift",
        metadata=automation_tags(spec, "drift"),
        job=drift_job,
        cron_schedule=dr.cron,
        execution_timezone=dr.timezone,
        default_status=DefaultScheduleStatus.RUNNING if dr.enabled else DefaultScheduleStatus.STOPPED,
        description=f"Re-score the promoted {spec.name} model on the freshest held-out data ({dr.cron} {dr.timezone}).",
    )
    def drift(context: ScheduleEvaluationContext, storage: ArtifactStore):
        current = storage.campaign_dir(spec.name) / "promoted_model" / "CURRENT"
        if not current.exists():
            return SkipReason(f"campaign {spec.name} has no promoted model yet ({current} is missing)")
        return RunRequest(
            tags=trigger_tags(
                spec,
                "schedule",
                f"drift re-evaluation of promoted model {current.read_text().strip()} (cron '{dr.cron}' {dr.timezone})",
            )
        )

    return drift


def drift_retrain_sensor(spec: CampaignSpec, job_name: str):
    dr = spec.automation.drift

    @asset_sensor(
        asset_key=drift_key(spec),
        name=f"{spec.name}_drift_retrain",
        tags=automation_tags(spec, "drift_retrain"),
        job_name=job_name,
        default_status=_sensor_status(dr.enabled),
        description=f"A DRIFTED {spec.name}/drift_evaluation requests a retraining run on the freshest data.",
    )
    def drift_retrain(context: SensorEvaluationContext, asset_event: EventLogEntry):
        mat = asset_event.asset_materialization
        md = {k: v.value for k, v in (mat.metadata if mat else {}).items()}
        verdict = md.get("verdict")
        if verdict != "DRIFTED":
            return SkipReason(f"drift evaluation of {md.get('promoted_key')}: {verdict} ({md.get('summary', '')})")
        reason = f"drift of promoted model {md['promoted_key']}: {md['summary']}"
        # One request per (promoted model, fresh data): a drift that persists on the same data
        # does not retrain again and again; new data gives a new key.
        return RunRequest(
            run_key=f"drift-{md['content_key']}",
            asset_selection=stage_keys(spec),
            tags=trigger_tags(
                spec, "drift", reason, drifted_model=str(md["promoted_key"]), drift_run=asset_event.run_id
            ),
        )

    return drift_retrain


@dataclass
class CampaignAutomation:
    assets: list = field(default_factory=list)
    jobs: list = field(default_factory=list)
    schedules: list = field(default_factory=list)
    sensors: list = field(default_factory=list)


def campaign_automation(spec: CampaignSpec, campaign_job_name: str) -> CampaignAutomation:
    """The drift asset, its job and schedule, and the campaign's sensors."""
    from assets import drift_evaluation as drift

    drift_job = define_asset_job(
        drift_job_name(spec),
        selection=AssetSelection.keys(drift_key(spec)),
        tags={"campaign": spec.name},
        description=f"Re-score the promoted {spec.name} model on the freshest held-out data.",
    )
    return CampaignAutomation(
        assets=[drift.build(spec)],
        jobs=[drift_job],
        schedules=[drift_schedule(spec, drift_job)],
        sensors=[
            new_data_sensor(spec, campaign_job_name),
            model_change_sensor(spec, campaign_job_name),
            drift_retrain_sensor(spec, campaign_job_name),
        ],
    )
