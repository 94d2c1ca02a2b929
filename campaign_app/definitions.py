"""The Dagster code location: every campaign in ``campaigns/*.yaml`` (see workspace.yaml).

Two environment variables, read here once when the code location loads (nothing else in the
code location reads the environment for configuration), point it elsewhere:

- ``CAMPAIGN_FILES``: campaign files or globs, separated by ``os.pathsep`` (``:`` on Linux),
  instead of ``campaigns/*.yaml``; e.g. ``CAMPAIGN_FILES=/srv/campaigns/*.yaml``.
- ``CAMPAIGN_ARTIFACTS``: the artifact root, instead of ``artifacts/`` in the repository.

Loading refuses a Dagster other than the one ``assets/dagster_patches.py`` was tested against
(``CAMPAIGN_ALLOW_UNTESTED_DAGSTER=1``: a warning instead).
"""

import glob
import os

from assets.dagster_patches import require_tested_dagster
from assets.location import build_definitions


def campaign_files_from_env(value: str | None) -> list[str] | None:
    """``CAMPAIGN_FILES`` as a sorted list of files (None: the default campaigns)."""
    if not value:
        return None
    files: list[str] = []
    for pattern in value.split(os.pathsep):
        if pattern.strip():
            matches = sorted(glob.glob(os.path.expanduser(pattern.strip())))
            files += matches if matches else [pattern.strip()]  # a missing file is reported by the loader
    return files


require_tested_dagster("loading the code location campaign_app/definitions.py")
defs = build_definitions(
    campaign_files=campaign_files_from_env(os.environ.get("CAMPAIGN_FILES")),
    artifact_root=os.environ.get("CAMPAIGN_ARTIFACTS") or "artifacts",
)
