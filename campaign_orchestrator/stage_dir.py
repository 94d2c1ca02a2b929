"""A stage's output directory, keyed by the content hash of its inputs and settings.

``<root>/<campaign>/<stage>/<key>/`` holds the stage's files, ``manifest.json`` (what the
stage produced, its counts and cost lines) and ``_SUCCESS``, written last. A directory without
``_SUCCESS`` is incomplete: a resumable stage may continue in it; nothing downstream reads it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUCCESS = "_SUCCESS"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class StageDir:
    root: Path
    campaign: str
    stage: str
    key: str

    @property
    def path(self) -> Path:
        return self.root / self.campaign / self.stage / self.key

    def is_complete(self) -> bool:
        return (self.path / SUCCESS).exists()

    def ensure(self) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.path / MANIFEST).read_text())

    def commit(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Write the manifest atomically, then the success marker.

        ``production_id`` names this production of the output (a re-computation after the directory
        was removed is a new production): the cost ledger records a production's cost lines once."""
        self.ensure()
        full = {
            "campaign": self.campaign,
            "stage": self.stage,
            "key": self.key,
            "path": str(self.path),
            "production_id": uuid.uuid4().hex,
            "committed_at": dt.datetime.now(dt.UTC).isoformat(),
            **manifest,
        }
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(full, indent=2, sort_keys=True, default=str))
        os.replace(tmp, self.path / MANIFEST)
        (self.path / SUCCESS).write_text("")
        return full
