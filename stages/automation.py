"""What the campaigns' sensors decide, without Dagster: new prompt data past its threshold, and the stages made with
another code version or from older inputs (the plain logic is in ``campaign_orchestrator.triggers``; the Dagster
sensors in ``assets/sensors.py`` read the instance and turn these decisions into run requests)."""

from __future__ import annotations

from campaigns.spec import CampaignSpec


def new_data(spec: CampaignSpec, cursor: str | None) -> tuple[object | None, str | None, str | None]:
    """``(decision, new cursor, error)`` of the new-data check of the campaign's prompt source
    (``campaign_orchestrator.triggers.newdata.observe``); ``error``: why the source could not be listed (no
    decision, the cursor unchanged)."""
    from campaign_orchestrator.triggers.newdata import NewDataState, Threshold, observe
    from campaign_orchestrator.triggers.sources import SourceError, list_source

    nd = spec.automation.new_data
    state = NewDataState.from_cursor(cursor)
    try:
        files = list_source(spec.data.source, spec.project_dir, cache=state.stat_cache)
    except SourceError as e:
        return None, cursor, str(e)
    decision = observe(state, files, Threshold(nd.min_new_rows, nd.min_new_fraction))
    return decision, state.to_cursor(), None


def recorded(code_version: str | None, input_versions: dict[str, str]):
    """What a stage's latest materialization was made with (``campaign_orchestrator.triggers.staleness.Recorded``)."""
    from campaign_orchestrator.triggers.staleness import Recorded

    return Recorded(code_version, input_versions)


def stale_plan(order, parents, current, recorded_, latest, explain):
    """The stale stages and what to re-materialize (``campaign_orchestrator.triggers.staleness.plan``)."""
    from campaign_orchestrator.triggers.staleness import plan

    return plan(order, parents, current, recorded_, latest, explain=explain)
