"""Human review of a candidate: an approval recorded against that exact candidate.

An approval names the candidate (the adapter's content key) and the evaluation whose gate report
the reviewer read (its content key), who approved and when. It lives at
``<artifact root>/<campaign>/approvals/<candidate key>.json``; promotion accepts it only when both
keys match, so a later candidate, or the same adapter judged under another gate policy, needs its
own approval. Only a candidate whose gate said GO can be approved. No Dagster import.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path


class ApprovalError(ValueError):
    pass


@dataclass(frozen=True)
class Approval:
    campaign: str
    candidate_key: str
    evaluation_key: str
    verdict: str
    approved_by: str
    approved_at: str
    note: str = ""
    via: str = "cli"

    def as_dict(self) -> dict:
        return asdict(self)


def approvals_dir(campaign_dir: Path) -> Path:
    return Path(campaign_dir) / "approvals"


def approval_path(campaign_dir: Path, candidate_key: str) -> Path:
    return approvals_dir(campaign_dir) / f"{candidate_key}.json"


def record_approval(
    campaign: str,
    campaign_dir: Path,
    evaluation: dict,
    candidate_key: str,
    approved_by: str,
    note: str = "",
    via: str = "cli",
) -> tuple[Approval, bool]:
    """Approve ``candidate_key``, which must be the latest evaluated candidate with a GO gate.

    ``evaluation`` is the evaluation asset's manifest. Returns (approval, created); approving an
    already approved candidate returns the first approval unchanged."""
    if not approved_by or not approved_by.strip():
        raise ApprovalError("an approval needs the reviewer's name (`approved_by` / --by)")
    latest = evaluation.get("candidate_key")
    if candidate_key != latest:
        raise ApprovalError(
            f"candidate {candidate_key!r} is not the latest evaluated candidate of campaign {campaign} "
            f"({latest!r}); review and approve that one, or evaluate yours first"
        )
    if evaluation.get("verdict") != "GO":
        raise ApprovalError(
            f"candidate {candidate_key} has gate verdict {evaluation.get('verdict')}; only a candidate "
            "whose gate passed (GO) can be approved"
        )
    existing = find_approval(campaign_dir, candidate_key, evaluation["key"])
    if existing is not None:
        return existing, False
    a = Approval(
        campaign,
        candidate_key,
        evaluation["key"],
        evaluation["verdict"],
        approved_by.strip(),
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        note,
        via,
    )
    p = approval_path(campaign_dir, candidate_key)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(a.as_dict(), indent=2))
    os.replace(tmp, p)
    return a, True


def find_approval(campaign_dir: Path, candidate_key: str, evaluation_key: str) -> Approval | None:
    """The approval of exactly this candidate and evaluation, or None (a record for another
    candidate or another evaluation, even under this candidate's file name, is not accepted)."""
    p = approval_path(campaign_dir, candidate_key)
    if not p.exists():
        return None
    try:
        a = Approval(**json.loads(p.read_text()))
    except (ValueError, TypeError):
        return None
    if a.candidate_key != candidate_key or a.evaluation_key != evaluation_key or a.verdict != "GO":
        return None
    return a
