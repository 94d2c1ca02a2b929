"""A broken campaign file still shows up in the UI: as an asset whose description is the
validation report and whose materialization fails with it."""

import re

from dagster import AssetKey, Failure, asset

from campaigns.loader import CampaignFileError

GROUP = "invalid_campaigns"


def build(error: CampaignFileError):
    stem = re.sub(r"[^a-zA-Z0-9_]", "_", error.path.rsplit("/", 1)[-1].rsplit(".", 1)[0])
    text = error.render()

    @asset(
        key=AssetKey([GROUP, stem]),
        group_name=GROUP,
        kinds={"yaml"},
        description=f"INVALID CAMPAIGN FILE — fix it and reload the code location.\n\n```\n{text}\n```",
        metadata={"file": error.path, "problems": len(error.problems)},
    )
    def invalid_campaign():
        raise Failure(f"campaign file {error.path} is invalid:\n{text}")

    return invalid_campaign
