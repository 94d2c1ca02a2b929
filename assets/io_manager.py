"""Stage outputs cross asset boundaries as small JSON manifests (paths, hashes, counts), never
pickles: the data itself stays in the stage directory as Parquet or model files."""

import json
import os
from pathlib import Path

from dagster import ConfigurableIOManager, InputContext, OutputContext

from resources.storage import ArtifactStore


class ManifestIOManager(ConfigurableIOManager):
    root: str = "artifacts"

    def _pointer(self, key_path: list[str]) -> Path:
        return ArtifactStore(root=self.root).root_path() / Path(*key_path[:-1]) / key_path[-1] / "LATEST.json"

    def handle_output(self, context: OutputContext, obj: dict) -> None:
        if obj is None:
            return
        p = self._pointer(list(context.asset_key.path))
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
        os.replace(tmp, p)

    def load_input(self, context: InputContext) -> dict:
        key = list(context.asset_key.path)
        p = self._pointer(key)
        if not p.exists():
            raise FileNotFoundError(f"asset {'/'.join(key)} has not been materialized yet (no {p}); materialize it first")
        return json.loads(p.read_text())
