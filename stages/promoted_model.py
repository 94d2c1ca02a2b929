"""promoted_model: the candidate adapter published as the campaign's current model, once its gate passed (and, with
``evaluation.requires_human_review``, once a reviewer approved this exact candidate and evaluation).

The Dagster asset adds the check only the orchestrator can make (the latest ``gate`` check recorded for this
candidate must have passed) before calling :func:`run`."""

from __future__ import annotations

import json
import os
import shutil
import time

from campaigns.spec import CampaignSpec
from evaluation.drift import PROMOTION_ITEMS
from evaluation.promotion import base_model_record, make_portable
from stages.errors import StageError
from stages.evaluation import approve_hint
from stages.model_card import write_model_card
from stages.outcome import Outcome
from stages.storage import Store

STAGE = "promoted_model"


def refusal(evaluation: dict, adapter: dict) -> str | None:
    """Why this candidate must not be promoted by what its evaluation says, or None."""
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
    return None


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """The adapter promoted (``inputs``: the ``evaluation`` and ``adapter`` manifests): its manifest, ``cached``
    when an earlier run promoted it (promotion is once per key; ``notes["record"]``: its ``promotion.json``,
    ``notes["dest"]``: where it is). A candidate awaiting review gives ``manifest`` None and
    ``notes["awaiting_review"]``: what to do. Raises :class:`StageError` when the evaluation refuses it."""
    from evaluation.approval import find_approval

    evaluation, adapter = inputs["evaluation"], inputs["adapter"]
    why = refusal(evaluation, adapter)
    if why:
        raise StageError(why)
    approval = None
    if spec.evaluation.requires_human_review:
        approval = find_approval(ctx.store.campaign_dir(spec.name), adapter["key"], evaluation["key"])
        if approval is None:
            msg = (
                f"candidate {adapter['key']} passed the gate and awaits human review; approve it with "
                f"{approve_hint(spec.name, adapter['key'])}, then materialize promoted_model"
            )
            ctx.log.warning(msg)
            return Outcome(None, False, {"awaiting_review": msg})
    dest = promote(spec, ctx.store, evaluation, adapter, approval, ctx.run_id)
    record = json.loads((dest / "promotion.json").read_text())
    manifest = {"key": adapter["key"], "path": str(dest), "adapter_path": str(dest / "adapter"), **record}
    return Outcome(manifest, record.get("run_id") != ctx.run_id, {"record": record, "dest": dest})


def latest_evaluation(storage: Store, campaign: str) -> dict:
    """The evaluation stage's latest manifest (what the IO manager hands downstream)."""
    p = storage.campaign_dir(campaign) / "evaluation" / "LATEST.json"
    if not p.exists():
        raise FileNotFoundError(f"campaign {campaign} has no evaluation yet ({p}); materialize its evaluation first")
    return json.loads(p.read_text())


def approve(spec: CampaignSpec, storage: Store, candidate_key: str, approved_by: str, note: str, via: str):
    """Record a reviewer's approval of the latest evaluation's candidate: ``(approval, created)``
    (``evaluation.approval.record_approval``); a :class:`StageError` saying why it cannot be approved."""
    from evaluation.approval import ApprovalError, record_approval

    try:
        return record_approval(
            spec.name,
            storage.campaign_dir(spec.name),
            latest_evaluation(storage, spec.name),
            candidate_key,
            approved_by,
            note,
            via=via,
        )
    except ApprovalError as e:
        raise StageError(str(e)) from None


def _keep_candidate_items(items_path: str, dest) -> None:
    """The candidate's per-item rows of its evaluation, kept with the promoted adapter: drift compares
    fresh scores with these (an interval needs the items, not the mean)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    t = pq.read_table(items_path)
    pq.write_table(t.filter(pc.equal(t["model"], "candidate")), dest)


def promote(spec: CampaignSpec, storage: Store, evaluation: dict, adapter: dict, approval, run_id: str):
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
