"""Shared fixtures. The demo models are built once per artifact root (cached by recipe hash),
so the first test session on a fresh clone pays ~1.5 minutes and later ones nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Tests share the repository's artifact root only for the demo models; every test that
# materializes a campaign uses its own temporary root with the models linked in.
MODELS_ROOT = Path(os.environ.get("CAMPAIGN_TEST_MODELS_ROOT", REPO_ROOT / "artifacts"))


@pytest.fixture(scope="session")
def demo_models_root() -> Path:
    """An artifact root holding the built demo models (teacher, student)."""
    from campaign_orchestrator.demo.build import build_demo_models

    build_demo_models(MODELS_ROOT, log=lambda _m: None)
    return MODELS_ROOT


@pytest.fixture(scope="session")
def demo_models(demo_models_root) -> dict[str, Path]:
    from campaign_orchestrator.demo.recipe import resolve

    return {name: resolve(f"@demo/{name}", demo_models_root) for name in ("teacher", "student")}


@pytest.fixture
def artifact_root(tmp_path, demo_models_root) -> Path:
    """A fresh artifact root for one test, with the demo models linked in (read-only use)."""
    root = tmp_path / "artifacts"
    (root / "models").mkdir(parents=True)
    from campaign_orchestrator.demo.recipe import models_dir

    src = models_dir(demo_models_root)
    (root / "models" / src.name).symlink_to(src, target_is_directory=True)
    return root
