"""Where the project's files are. One module, so no other one derives a location from ``__file__``.

- The **project directory** is the working directory (or ``$CAMPAIGN_PROJECT_DIR``): where
  ``campaigns/*.yaml`` are looked for, and what a relative artifact root, cache or Dagster home
  is relative to. Run ``campaign`` or ``dagster dev`` from your project's folder.
- A **campaign file's relative paths** (data sources, suites, the pricing catalog, local models)
  are relative to the project that holds it: the folder above the file's ``campaigns/`` folder
  (``<project>/campaigns/x.yaml``), else the project directory. So a campaign reads the same
  files whether it is run from the checkout, from an installed package, or from another folder.
- **Shipped files** (the demo campaigns and their data, the pricing catalog, the instance
  settings) are package data, found with :mod:`importlib.resources`.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

PROJECT_DIR_ENV = "CAMPAIGN_PROJECT_DIR"
CACHE_DIR_ENV = "CAMPAIGN_CACHE_DIR"
CAMPAIGNS_FOLDER = "campaigns"


def project_dir() -> Path:
    """The project directory: ``$CAMPAIGN_PROJECT_DIR`` or the working directory."""
    return Path(os.environ.get(PROJECT_DIR_ENV) or os.getcwd()).resolve()


def resolve(path: str | os.PathLike, base: str | os.PathLike | None = None) -> Path:
    """``path`` as an absolute path: as given when absolute, else under ``base`` (default: the project directory)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base or project_dir()) / p


def artifact_root(configured: str | os.PathLike = "artifacts") -> Path:
    """The artifact root: the configured directory (relative: to the project directory)."""
    return resolve(configured).resolve()


def cache_dir() -> Path:
    """Per-user caches that are not artifacts (file digests): ``$CAMPAIGN_CACHE_DIR``, else
    ``~/.cache/campaign-orchestrator``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "campaign-orchestrator").expanduser()


def hash_cache_file() -> Path:
    """The persistent table of file digests (``campaign_orchestrator.content.HashCache``)."""
    return cache_dir() / "file-sha256.sqlite"


def dagster_home() -> Path:
    """``$DAGSTER_HOME``, else ``.dagster_home/`` in the project directory."""
    return resolve(os.environ.get("DAGSTER_HOME") or ".dagster_home").resolve()


def campaign_project_dir(campaign_file: str | os.PathLike) -> Path:
    """The project a campaign file belongs to (what its relative paths are relative to)."""
    parent = Path(campaign_file).resolve().parent
    return parent.parent if parent.name == CAMPAIGNS_FOLDER else project_dir()


def shipped_campaigns_dir() -> Path:
    """The ``campaigns`` package's folder: the shipped campaigns, their data and the pricing catalog."""
    return Path(str(resources.files(CAMPAIGNS_FOLDER)))


def shipped_file(package: str, name: str) -> Path:
    """A file shipped as package data of ``package`` (e.g. ``campaign_app``'s ``dagster.yaml``, the default
    instance settings)."""
    return Path(str(resources.files(package) / name))


def default_campaign_files() -> list[Path]:
    """``campaigns/*.yaml`` (and ``*.yml``) of the project directory; the shipped campaigns when it has none."""
    for folder in (project_dir() / CAMPAIGNS_FOLDER, shipped_campaigns_dir()):
        files = sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])
        if files:
            return files
    return []


def display(path: str | os.PathLike) -> str:
    """A path as shown to a person: relative to the project directory when it lies inside it."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(project_dir()))
    except ValueError:
        return str(p)
