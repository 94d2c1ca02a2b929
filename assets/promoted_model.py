"""promoted_model: the candidate adapter published as the campaign's current model.

In the same run the blocking ``gate`` check stops it; across runs it checks again before copying
anything: the evaluation it reads must be of this very candidate with verdict GO, and the latest
``gate`` check recorded in the Dagster instance for the evaluation asset must have passed for this
candidate. With ``evaluation.requires_human_review`` it also waits (materializes nothing, records an
observation saying so) until an approval of this exact candidate and evaluation exists; approve with
``campaign approve`` or the ``<campaign>_approve`` job, then materialize promoted_model again.
"""

import json
import os
import shutil
import time

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

from assets.common import key
from assets.evaluation import GATE_CHECK, approve_hint
from assets.model_card import write_model_card
from campaigns.spec import CampaignSpec
from evaluation.drift import PROMOTION_ITEMS
from evaluation.promotion import base_model_record, make_portable
from resources.storage import ArtifactStore


def gate_refusal(instance: DagsterInstance, evaluation_key: AssetKey, evaluation: dict, adapter: dict) -> str | None:
    """Why this candidate must not be promoted, or None."""
    cand = adapter["key"]
    if evaluation.get("candidate_key") != cand:
        return (
            f"the latest evaluation scored candidate {evaluation.get('candidate_key')}, not the current adapter "
            f"{cand}; materialize evaluation first"
        )
    if evaluation.get("verdict") != "GO":
        why = "; ".join(evaluation.get("reasons", [])[:3])
        return f"gate verdict for candidate {cand} is {evaluation.get('verdict')}: not promoting" + (
            f" ({why})" if why else ""
        )
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


def latest_evaluation(storage: ArtifactStore, campaign: str) -> dict:
    """The evaluation asset's latest manifest (what the IO manager hands downstream)."""
    p = storage.campaign_dir(campaign) / "evaluation" / "LATEST.json"
    if not p.exists():
        raise FileNotFoundError(f"campaign {campaign} has no evaluation yet ({p}); materialize its evaluation first")
    return json.loads(p.read_text())


def _keep_candidate_items(items_path: str, dest) -> None:
    """The candidate's per-item rows of its evaluation, kept with the promoted adapter: drift compares
    fresh scores with these (an interval needs the items, not the mean)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    t = pq.read_table(items_path)
    pq.write_table(t.filter(pc.equal(t["model"], "candidate")), dest)


def _awaiting_review(context, spec: CampaignSpec, evaluation: dict, adapter: dict) -> AssetObservation:
    """The observation (and warning) of a GO candidate that waits for a reviewer's approval."""
    msg = (
        f"candidate {adapter['key']} passed the gate and awaits human review; approve it with "
        f"{approve_hint(spec.name, adapter['key'])}, then materialize promoted_model"
    )
    context.log.warning(msg)
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


def promote(spec: CampaignSpec, storage: ArtifactStore, evaluation: dict, adapter: dict, approval, run_id: str):
    """Copy the adapter, its candidate items, ``promotion.json`` and its model card to the campaign's
    ``promoted_model/<key>`` (atomically, once per key), and point ``CURRENT`` at it; returns that directory."""
    dest = storage.campaign_dir(spec.name) / "promoted_model" / adapter["key"]
    if not (dest / "promotion.json").exists():
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(adapter["adapter_path"], tmp / "adapter")
        _keep_candidate_items(evaluation["items_path"], tmp / PROMOTION_ITEMS)  # what drift compares with
        base = base_model_record(  # no absolute path in the promoted folder (evaluation/promotion.py)
            spec.student.base_model, adapter["base_model_path"], storage.root_path(), spec.project_dir
        )
        record = {
            "candidate_key": adapter["key"],
            **base,
            "evaluation_key": evaluation["key"],
            "verdict": evaluation["verdict"],
            "scores": evaluation["scores"],
            "items": PROMOTION_ITEMS,
            "approval": approval.as_dict() if approval else None,
            "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "run_id": run_id,
        }
        (tmp / "promotion.json").write_text(json.dumps(record, indent=2))
        write_model_card(spec, storage, evaluation, adapter, tmp / "adapter", record)  # README.md, Hugging Face format
        make_portable(tmp, [storage.root_path(), spec.project_dir], base["base_model_hub_id"] or base["base_model"])
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    current = storage.campaign_dir(spec.name) / "promoted_model" / "CURRENT"
    current.write_text(adapter["key"])
    return dest


def _promotion_metadata(dest, adapter: dict, record: dict, run_id: str) -> dict:
    """What the UI shows; a candidate promoted by an earlier run (promotion is once per key) is ``reused``."""
    md = {
        "adapter": MetadataValue.path(str(dest / "adapter")),
        "candidate_key": adapter["key"],
        "content_key": adapter["key"],
        "verdict": record["verdict"],
        "promoted_at": record["promoted_at"],
        "reused": record.get("run_id") != run_id,
    }
    if md["reused"]:
        md["reused_from_run"] = record.get("run_id")
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
        from evaluation.approval import find_approval

        refusal = gate_refusal(context.instance, key(spec, "evaluation"), evaluation, adapter)
        if refusal:
            raise Failure(refusal)
        approval = None
        if review:
            approval = find_approval(storage.campaign_dir(spec.name), adapter["key"], evaluation["key"])
            if approval is None:
                yield _awaiting_review(context, spec, evaluation, adapter)
                return
        dest = promote(spec, storage, evaluation, adapter, approval, context.run_id)
        record = json.loads((dest / "promotion.json").read_text())
        manifest = {"key": adapter["key"], "path": str(dest), "adapter_path": str(dest / "adapter"), **record}
        yield Output(manifest, metadata=_promotion_metadata(dest, adapter, record, context.run_id))

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
        from evaluation.approval import ApprovalError, record_approval

        try:
            approval, created = record_approval(
                spec.name,
                storage.campaign_dir(spec.name),
                latest_evaluation(storage, spec.name),
                config.candidate_key,
                config.approved_by,
                config.note,
                via=f"dagster run {context.run_id}",
            )
        except ApprovalError as e:
            raise Failure(str(e)) from None
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
