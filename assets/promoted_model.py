"""promoted_model: the candidate adapter published as the campaign's current model (``stages/promoted_model.py``).

In the same run the blocking ``gate`` check stops it; across runs it checks again before copying
anything: the evaluation it reads must be of this very candidate with verdict GO, and the latest
``gate`` check recorded in the Dagster instance for the evaluation asset must have passed for this
candidate. With ``evaluation.requires_human_review`` it also waits (materializes nothing, records an
observation saying so) until an approval of this exact candidate and evaluation exists; approve with
``campaign approve`` or the ``<campaign>_approve`` job, then materialize promoted_model again.
"""

from dagster import (
    AssetCheckKey,
    AssetExecutionContext,
    AssetIn,
    AssetKey,
    AssetObservation,
    Config,
    DagsterInstance,
    Failure,
    MetadataValue,
    OpExecutionContext,
    Output,
    asset,
    job,
    op,
)
from pydantic import Field

from assets.common import dagster_failures, key, reused_metadata, stage_context
from assets.evaluation import GATE_CHECK
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore
from stages import promoted_model as stage
from stages.promoted_model import latest_evaluation  # noqa: F401 - the review CLI reads it here too


def gate_refusal(instance: DagsterInstance, evaluation_key: AssetKey, evaluation: dict, adapter: dict) -> str | None:
    """Why this candidate must not be promoted, or None: what its evaluation says (the stage's refusal), then the
    latest ``gate`` check recorded for it in the instance."""
    why = stage.refusal(evaluation, adapter)
    if why:
        return why
    cand = adapter["key"]
    record = instance.get_latest_asset_check_evaluation_record(AssetCheckKey(evaluation_key, GATE_CHECK))
    if record is None:
        return None
    if record.status.value != "SUCCEEDED":
        return (
            f"the latest `{GATE_CHECK}` check of {evaluation_key.to_user_string()} (run {record.run_id}) is "
            f"{record.status.value}, not passed: not promoting candidate {cand}"
        )
    data = record.event.dagster_event.event_specific_data if record.event and record.event.dagster_event else None
    checked = getattr(data, "metadata", {}).get("candidate_key") if data is not None else None
    checked = getattr(checked, "value", checked)
    if checked and checked != cand:
        return (
            f"the latest `{GATE_CHECK}` check (run {record.run_id}) judged candidate {checked}, not {cand}: "
            "materialize evaluation first"
        )
    return None


def approval_observation(spec: CampaignSpec, approval) -> AssetObservation:
    """The approval as an observation on the evaluation asset, so the UI shows who approved what, when."""
    return AssetObservation(
        asset_key=key(spec, "evaluation"),
        description=f"Candidate approved by {approval.approved_by}",
        metadata={
            "approved_candidate": approval.candidate_key,
            "approved_evaluation": approval.evaluation_key,
            "approved_by": approval.approved_by,
            "approved_at": approval.approved_at,
            "note": approval.note,
            "via": approval.via,
        },
    )


def _awaiting_review(context, spec: CampaignSpec, evaluation: dict, adapter: dict, msg: str) -> AssetObservation:
    """The observation of a GO candidate that waits for a reviewer's approval."""
    return AssetObservation(
        asset_key=context.asset_key,
        description="Awaiting human review",
        metadata={
            "status": "awaiting human review",
            "candidate_key": adapter["key"],
            "evaluation_key": evaluation["key"],
            "how_to_approve": msg,
        },
    )


def _promotion_metadata(dest, adapter: dict, record: dict, run_id: str) -> dict:
    """What the UI shows (``content_key``: the candidate's, the adapter's key); a candidate promoted by an earlier
    run (promotion is once per key) is ``reused``, from that run."""
    md = {
        "adapter": MetadataValue.path(str(dest / "adapter")),
        "content_key": adapter["key"],
        "verdict": record["verdict"],
        "promoted_at": record["promoted_at"],
    } | reused_metadata(record.get("run_id"), run_id)
    if record.get("approval"):
        md |= {"approved_by": record["approval"]["approved_by"], "approved_at": record["approval"]["approved_at"]}
    return md


def build(spec: CampaignSpec):
    review = spec.evaluation.requires_human_review

    @asset(
        key=key(spec, "promoted_model"),
        group_name=spec.name,
        kinds={"pytorch"},
        output_required=False,
        ins={"evaluation": AssetIn(key(spec, "evaluation")), "adapter": AssetIn(key(spec, "student_adapter"))},
        description="The adapter whose gate passed"
        + (" and a reviewer approved" if review else "")
        + ", copied to the campaign's promoted location.",
    )
    def promoted_model(context: AssetExecutionContext, evaluation: dict, adapter: dict, storage: ArtifactStore):
        refusal = gate_refusal(context.instance, key(spec, "evaluation"), evaluation, adapter)
        if refusal:
            raise Failure(refusal)
        with dagster_failures():
            out = stage.run(spec, {"evaluation": evaluation, "adapter": adapter}, stage_context(context, storage))
        if out.manifest is None:
            yield _awaiting_review(context, spec, evaluation, adapter, out.notes["awaiting_review"])
            return
        md = _promotion_metadata(out.notes["dest"], adapter, out.notes["record"], context.run_id)
        yield Output(out.manifest, metadata=md)

    return promoted_model


class ApproveConfig(Config):
    candidate_key: str = Field(
        description="The candidate key shown in the evaluation report (the adapter's content key)."
    )
    approved_by: str = Field(description="Who approves (recorded with the time).")
    note: str = Field("", description="Optional review note.")


def approve_job_name(campaign: str) -> str:
    return f"{campaign}_approve"


def approve_job(spec: CampaignSpec):
    """``<campaign>_approve``: record a reviewer's approval of the latest GO candidate (Launchpad config)."""

    @op(name=f"{spec.name}_approve_candidate", description="Record an approval of this exact candidate.")
    def approve_candidate(context: OpExecutionContext, config: ApproveConfig, storage: ArtifactStore) -> None:
        with dagster_failures():
            approval, created = stage.approve(
                spec,
                storage.store(),
                config.candidate_key,
                config.approved_by,
                config.note,
                via=f"dagster run {context.run_id}",
            )
        if created:
            context.log_event(approval_observation(spec, approval))
            context.log.info(
                f"approved candidate {approval.candidate_key} for {spec.name}; materialize "
                f"{spec.name}/promoted_model to promote it"
            )
        else:
            context.log.info(
                f"candidate {approval.candidate_key} was already approved by {approval.approved_by} "
                f"at {approval.approved_at}"
            )

    @job(
        name=approve_job_name(spec.name),
        tags={"campaign": spec.name},
        description=f"Approve campaign {spec.name}'s latest candidate after reading its gate report "
        "(config: candidate_key, approved_by, note); then materialize promoted_model.",
    )
    def approve():
        approve_candidate()

    return approve
