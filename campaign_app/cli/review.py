"""``campaign approve``: a reviewer's approval of an evaluated candidate."""

from __future__ import annotations

import argparse
import sys

from campaign_app.cli.common import EXIT_INVALID, EXIT_OK, dagster_home
from campaigns.loader import CampaignError, resolve_campaign


def approve_command(args: argparse.Namespace) -> int:
    """Record a reviewer's approval of the campaign's latest GO candidate (see evaluation/approval.py)."""
    import getpass

    try:
        spec, _ = resolve_campaign(args.campaign)
    except (CampaignError, KeyError) as e:
        print(e.args[0] if isinstance(e, KeyError) else f"invalid campaign:\n{e}", file=sys.stderr)
        return EXIT_INVALID
    from assets.promoted_model import approval_observation
    from evaluation.approval import ApprovalError, record_approval
    from resources.storage import ArtifactStore
    from stages.promoted_model import latest_evaluation

    storage = ArtifactStore(root=args.artifacts)
    try:
        approval, created = record_approval(
            spec.name,
            storage.campaign_dir(spec.name),
            latest_evaluation(storage, spec.name),
            args.candidate,
            args.by or getpass.getuser(),
            args.note,
            via="cli",
        )
    except (ApprovalError, FileNotFoundError) as e:
        print(f"not approved: {e}", file=sys.stderr)
        return EXIT_INVALID
    if not created:
        print(
            f"candidate {approval.candidate_key} was already approved by {approval.approved_by} at "
            f"{approval.approved_at}"
        )
        return EXIT_OK
    dagster_home()
    from dagster import DagsterInstance

    with DagsterInstance.get() as instance:  # so the UI shows the approval on the evaluation asset
        instance.report_runless_asset_event(approval_observation(spec, approval))
    print(
        f"approved candidate {approval.candidate_key} of campaign {spec.name} "
        f"(by {approval.approved_by} at {approval.approved_at}); materialize {spec.name}/promoted_model to promote it"
    )
    return EXIT_OK


def add_parsers(sub) -> None:
    """Register this group's commands on the ``campaign`` parser."""
    a = sub.add_parser("approve", help="approve a campaign's evaluated candidate (when human review is required)")
    a.add_argument("campaign", help="campaign name or YAML file")
    a.add_argument("--candidate", required=True, help="the candidate key shown in the gate report")
    a.add_argument("--by", default=None, help="reviewer name (default: the current user)")
    a.add_argument("--note", default="", help="review note")
    a.add_argument("--artifacts", default="artifacts", help="artifact root (default: ./artifacts)")
    a.set_defaults(fn=approve_command)
