"""What a stage's ``run`` returns: the manifest handed downstream, whether it was found complete, and what the
stage found on the way for its adapter to show (``notes``: e.g. the recipe checks, a blocking check's report)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    manifest: dict
    cached: bool
    notes: dict[str, Any] = field(default_factory=dict)
