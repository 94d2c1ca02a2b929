"""Shared by the command groups: exit codes, resolving a campaign, the Dagster instance's home."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from campaigns import paths
from campaigns.loader import CampaignError, resolve_campaign

EXIT_OK, EXIT_INVALID, EXIT_FAILED, EXIT_BLOCKED = 0, 1, 2, 3


def dagster_home() -> Path:
    home = paths.dagster_home()
    home.mkdir(parents=True, exist_ok=True)
    shipped = paths.shipped_file("campaign_app", "dagster.yaml")
    if not (home / "dagster.yaml").exists():
        if shipped.exists():
            shutil.copy(shipped, home / "dagster.yaml")
        else:
            (home / "dagster.yaml").write_text("# Dagster instance settings (empty: local SQLite storage here)\n")
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def resolve_with_source(name: str):
    """(spec, source file) of a campaign name or file, or None after printing why it cannot be loaded."""
    try:
        return resolve_campaign(name)
    except CampaignError as e:
        print(f"invalid campaign:\n{e}", file=sys.stderr)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
    return None


def resolve_spec(name: str):
    resolved = resolve_with_source(name)
    return None if resolved is None else resolved[0]


def latest_manifest(artifacts: Path, campaign: str, stage: str) -> dict | None:
    p = artifacts / campaign / stage / "LATEST.json"
    return json.loads(p.read_text()) if p.exists() else None


def check_status(ev) -> str:
    """PASS, WARN or FAIL for an asset check evaluation: a failed WARN-severity check (a version change,
    an improvement to rebaseline) is reported but never fails a command."""
    from dagster import AssetCheckSeverity

    return "PASS" if ev.passed else "WARN" if ev.severity == AssetCheckSeverity.WARN else "FAIL"
