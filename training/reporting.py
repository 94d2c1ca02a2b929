"""Talk back to Dagster through ``dagster-pipes`` when launched by it; print otherwise.

Only global rank 0 opens the Pipes channel, so a job with N ranks reports once.
"""

from __future__ import annotations

import sys
from typing import Any


class Reporter:
    def __init__(self, is_main: bool):
        self.is_main = is_main
        self._pipes = None
        if is_main:
            import os

            from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR, open_dagster_pipes

            if os.environ.get(DAGSTER_PIPES_CONTEXT_ENV_VAR):
                self._pipes = open_dagster_pipes()

    def log(self, msg: str) -> None:
        if not self.is_main:
            return
        if self._pipes is not None:
            self._pipes.log.info(msg)
        print(msg, file=sys.stderr, flush=True)

    def metrics(self, row: dict[str, Any]) -> None:
        if self._pipes is not None:
            self._pipes.report_custom_message({"kind": "train_metrics", **row})

    def materialization(self, metadata: dict[str, Any]) -> None:
        if self._pipes is not None:  # nested values (a MoE student's report) travel as JSON metadata
            self._pipes.report_asset_materialization(
                metadata={
                    k: {"raw_value": v, "type": "json"} if isinstance(v, dict | list) else v
                    for k, v in metadata.items()
                }
            )

    def close(self) -> None:
        if self._pipes is not None:
            self._pipes.close()
            self._pipes = None
