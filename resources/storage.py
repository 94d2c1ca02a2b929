"""The artifact store: one root directory, stage directories keyed by content hash."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field

from lineage.stage_dir import StageDir
from tinymodels import recipe

REPO_ROOT = Path(__file__).resolve().parent.parent


class ArtifactStore(ConfigurableResource):
    """Local artifact root (relative paths are relative to the repository root)."""

    root: str = Field("artifacts", description="Directory holding every campaign's artifacts and the demo models.")

    def root_path(self) -> Path:
        p = Path(self.root)
        return (p if p.is_absolute() else REPO_ROOT / p).resolve()

    def stage(self, campaign: str, stage: str, key: str) -> StageDir:
        return StageDir(self.root_path(), campaign, stage, key)

    def campaign_dir(self, campaign: str) -> Path:
        return self.root_path() / campaign

    def resolve_model(self, ref: str) -> Path:
        """A model reference from a campaign (``@demo/<name>`` or a path) as a directory."""
        if recipe.is_demo_ref(ref):
            path = recipe.resolve(ref, self.root_path())
            if not (path / "config.json").exists():
                raise FileNotFoundError(
                    f"demo model {ref} is not built yet (expected at {path}); materialize the demo_models assets "
                    f"or run `python -m tinymodels --artifacts {self.root_path()}`"
                )
            return path
        p = Path(ref)
        p = p if p.is_absolute() else REPO_ROOT / p
        if not p.exists():
            raise FileNotFoundError(f"model {ref!r} not found at {p}; give a checkpoint directory or `@demo/<name>`")
        return p
