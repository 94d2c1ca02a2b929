"""How much a new-data sensor tick costs, with and without the cursor's stat cache.

A prompt source of N files (JSONL, ~S MiB each) is listed three ways in one run:
``cold`` (first tick: every file hashed), ``warm`` (unchanged source: the cursor's
(size, mtime) stamps skip hashing) and ``one_new`` (one new file among them: only it is hashed).
Prints JSON; the figures that matter are the ratios, measured against ``cold`` in the same run.

    python benchmarks/sensor_tick.py [--files 200] [--mib 1]
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

from campaign_orchestrator.triggers.newdata import NewDataState, Threshold, observe  # noqa: E402
from campaign_orchestrator.triggers.sources import list_source  # noqa: E402


def _write(path: Path, mib: float, seed: int) -> None:
    line = json.dumps({"id": f"{seed}-{{}}", "prompt": "encode " + "x" * 80 + " =", "reference": "y"}) + "\n"
    n = max(1, int(mib * (1 << 20) / len(line)))
    with open(path, "w") as f:
        for i in range(n):
            f.write(line.replace("{}", str(i)))


def _tick(state: NewDataState, source: str, base: Path) -> float:
    t0 = time.perf_counter()
    observe(state, list_source(source, base, cache=state.stat_cache), Threshold())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--mib", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for i in range(args.files):
            _write(root / f"drop-{i:05d}.jsonl", args.mib, i)
        source = str(root / "*.jsonl")
        state = NewDataState()
        cold = _tick(state, source, root)
        # what the daemon does between ticks: the state goes through the stored cursor
        state = NewDataState.from_cursor(state.to_cursor())
        warm = _tick(state, source, root)
        _write(root / "drop-new.jsonl", args.mib, 10**6)
        state = NewDataState.from_cursor(state.to_cursor())
        one_new = _tick(state, source, root)
        cursor_bytes = len(state.to_cursor())
    print(
        json.dumps(
            {
                "benchmark": "new_data_sensor_tick",
                "files": args.files,
                "mib_per_file": args.mib,
                "cpus": os.cpu_count(),
                "cold_s": round(cold, 4),
                "warm_s": round(warm, 4),
                "one_new_file_s": round(one_new, 4),
                "warm_speedup_vs_cold": round(cold / warm, 1),
                "one_new_speedup_vs_cold": round(cold / one_new, 1),
                "cursor_bytes": cursor_bytes,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
