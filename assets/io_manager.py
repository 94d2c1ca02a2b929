"""Stage outputs cross asset boundaries as small JSON manifests (paths, hashes, counts), never
pickles: the data itself stays in the stage directory as Parquet or model files.

Every stage manifest that carries ``cost_lines`` is also recorded in the cost ledger here, in one
place for all stages: its lines once, by the run that produced it; a cache hit or a retried step
adds nothing (see ``campaign_orchestrator/costs/ledger.py``)."""

import json
import os
from pathlib import Path

from dagster import ConfigurableIOManager, InputContext, OutputContext

from assets.common import reused_metadata
from stages.pricing import Pricing, dollars
from stages.storage import Store


class ManifestIOManager(ConfigurableIOManager):
    root: str = "artifacts"
    ledger: str | None = None  # cost ledger file; default <root>/cost_ledger.duckdb (see stages/pricing.py)

    def _pointer(self, key_path: list[str]) -> Path:
        return Store(root=self.root).root_path() / Path(*key_path[:-1]) / key_path[-1] / "LATEST.json"

    def handle_output(self, context: OutputContext, obj: dict) -> None:
        if obj is None:
            return
        p = self._pointer(list(context.asset_key.path))
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
        os.replace(tmp, p)
        if isinstance(obj, dict) and "cost_lines" in obj:
            self._record_cost(context, obj)

    def _record_cost(self, context: OutputContext, manifest: dict) -> None:
        key = list(context.asset_key.path)
        ledger = Pricing(ledger=self.ledger).ledger_at(Store(root=self.root).root_path())
        res = ledger.record_stage(
            campaign=manifest.get("campaign", key[0]),
            asset=key[-1],
            run_id=context.run_id,
            step_key=context.step_key,
            manifest=manifest,
            attempt=context.step_context.previous_attempt_count,
        )
        context.add_output_metadata(ledger_metadata(res, context.run_id, manifest.get("cost_unknown")))

    def load_input(self, context: InputContext) -> dict:
        key = list(context.asset_key.path)
        p = self._pointer(key)
        if not p.exists():
            raise FileNotFoundError(
                f"asset {'/'.join(key)} has not been materialized yet (no {p}); materialize it first"
            )
        return json.loads(p.read_text())


def ledger_metadata(res: dict, run_id: str, unknown: str | None = None) -> dict:
    """What the ledger knows better than the stage (``res``: ``Ledger.record_stage``'s answer), over the stage's
    own metadata (``assets/common.base_metadata``; these keys win): whether the output is reused, from which run,
    and, for an output that cost something, who paid: this run, or another one (then nothing in this run). An output
    whose cost is ``unknown`` (an unpriced teacher's work) keeps the stage's "unknown" over the priced part."""
    md = reused_metadata(res["produced_by"], run_id)
    paid_by = res.get("lines_paid_by") or res["produced_by"]  # the run that paid for the lines the output carries
    if res["production_usd"] > 0 and not unknown:
        paid_here = res["spent_usd"] > 0 or paid_by == run_id
        note = "" if paid_here else f" (paid in run {paid_by[:8]}; nothing in this run)"
        md["cost"] = dollars(res["production_usd"]) + note
    return md
