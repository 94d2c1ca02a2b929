"""What recording a stage in the cost ledger adds to a materialization.

Baseline (same run, same machine): the IO manager's existing work per stage output, writing the
manifest pointer (JSON, atomic rename). Measured: the same plus ``Ledger.record_stage`` (one DuckDB
transaction: look up the production, insert its lines and a materialization row). Also: a cache hit
(the production already recorded) and reading a campaign's per-run totals. Prints JSON; the
figure to watch is ``ledger_ms_per_stage`` against a stage's seconds-to-hours of work.

    python benchmarks/cost_ledger_overhead.py [--stages 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from campaign_orchestrator.costs.ledger import Ledger  # noqa: E402
from campaign_orchestrator.stage_dir import StageDir  # noqa: E402

LINE = {
    "kind": "training",
    "price_key": "h100-sxm",
    "quantity": 1.5,
    "unit": "gpu-hour",
    "unit_price": 2.99,
    "usd": 4.485,
    "as_of": "2026-01-15",
    "tier": "on_demand",
    "catalog_version": "2026-11-29",
}


def write_pointer(root: Path, manifest: dict) -> None:
    p = root / "LATEST.json"
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    os.replace(tmp, p)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=200)
    n = ap.parse_args().stages
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        manifests = [
            StageDir(root, "bench", "student_adapter", f"k{i}").commit({"cost_lines": [LINE]}) for i in range(n)
        ]
        t0 = time.perf_counter()
        for m in manifests:
            write_pointer(root, m)
        base = time.perf_counter() - t0
        ledger = Ledger(root / "ledger.duckdb")
        ledger.spent("bench")  # schema creation outside the timing
        t0 = time.perf_counter()
        for i, m in enumerate(manifests):
            write_pointer(root, m)
            ledger.record_stage(
                campaign="bench", asset="student_adapter", run_id=f"r{i % 10}", step_key="s", manifest=m
            )
        with_ledger = time.perf_counter() - t0
        t0 = time.perf_counter()
        for m in manifests:
            ledger.record_stage(campaign="bench", asset="student_adapter", run_id="later", step_key="s", manifest=m)
        hits = time.perf_counter() - t0
        t0 = time.perf_counter()
        runs = ledger.runs("bench")
        read = time.perf_counter() - t0
        assert len(ledger.lines("bench")) == n and len(runs) == 11
    print(
        json.dumps(
            {
                "stages": n,
                "manifest_only_ms_per_stage": round(base / n * 1e3, 3),
                "manifest_plus_ledger_ms_per_stage": round(with_ledger / n * 1e3, 3),
                "ledger_ms_per_stage": round((with_ledger - base) / n * 1e3, 3),
                "ratio_vs_manifest_only": round(with_ledger / base, 1),
                "cache_hit_ms_per_stage": round(hits / n * 1e3, 3),
                "per_run_totals_query_ms": round(read * 1e3, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
