"""Record `campaign run` as JSON, for the figures docs/results.md and the README quote (tests/test_figures.py checks
every quoted figure against its file).

Runs ``campaign run NAME --artifacts DIR`` as a user does (a fresh process) and keeps: what it printed (line by
line), its exit status and wall seconds, the run's cost report (``DIR/<campaign>/campaign_cost/<run id>.json``:
scores, verdict, cost, plan against actual), the host (CPU capability, cores, what ``compute_dtype: auto`` resolves
to, 1-minute load average before and after) and the code version. ``--again`` runs it a second time unchanged
(every stage reused: the rerun transcript). ``--plan`` adds ``campaign plan NAME --json`` first.

Usage:
  python benchmarks/record_run.py demo --artifacts /tmp/rec --again --out benchmarks/data/run_demo_<date>.json
  python benchmarks/record_run.py smollm2_gpu --plan-only --out benchmarks/data/plan_smollm2_h100_<date>.json

Prints the JSON; exit status: the last run's (0 GO, 3 NO-GO), 0 for ``--plan-only``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOT_MARK = "<artifact root>"  # the artifact root as the recorded text shows it: no path of the recording machine


def _campaign(*args: str) -> tuple[int, float, list[str]]:
    """Run the ``campaign`` command in a fresh process: (exit status, wall seconds, stdout lines)."""
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "campaign_app.cli", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )
    wall = time.monotonic() - t0
    if r.returncode not in (0, 3):
        sys.stderr.write(r.stderr[-4000:])
    return r.returncode, round(wall, 1), r.stdout.splitlines()


def host() -> dict:
    from campaign_orchestrator.hardware import cpu_capability, resolve_compute_dtype

    auto = resolve_compute_dtype("auto", "cpu")
    return {
        "cpu_capability": cpu_capability(),
        "cores": os.cpu_count(),
        "auto_dtype": auto.dtype,
        "auto_dtype_reason": auto.reason,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def latest_report(artifacts: Path, campaign: str, after: float) -> dict | None:
    """The cost report the run wrote (the newest one written after ``after``), its paths under the artifact root
    written ``<artifact root>/...`` as in the transcript; None when it wrote none."""
    reports = [p for p in (artifacts / campaign / "campaign_cost").glob("*.json") if p.stat().st_mtime >= after]
    if not reports:
        return None
    return json.loads(max(reports, key=lambda p: p.stat().st_mtime).read_text().replace(str(artifacts), ROOT_MARK))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("campaign", help="campaign name or YAML file")
    ap.add_argument("--artifacts", default="artifacts", help="artifact root (default: ./artifacts)")
    ap.add_argument("--again", action="store_true", help="run it a second time, unchanged")
    ap.add_argument("--plan", action="store_true", help="record `campaign plan --json` first")
    ap.add_argument("--plan-only", action="store_true", help="record only `campaign plan --json`")
    ap.add_argument("--out", help="write the JSON here too")
    a = ap.parse_args(argv)
    from evaluation.model_card import code_version

    artifacts = Path(a.artifacts).resolve()
    name = Path(a.campaign).stem if a.campaign.endswith((".yaml", ".yml")) else a.campaign
    out: dict = {
        "benchmark": "record_run",
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "campaign": name,
        "code_version": code_version(),
        "host": host(),
    }
    code = 0
    if a.plan or a.plan_only:
        rc, _wall, lines = _campaign("plan", a.campaign, "--artifacts", str(artifacts), "--json")
        out["plan_command"] = f"campaign plan {a.campaign} --json"
        text = "\n".join(lines).replace(str(artifacts), ROOT_MARK).replace(str(ROOT) + "/", "")  # no local paths
        out["plan"] = json.loads(text) if rc == 0 else {"exit_code": rc}
    if not a.plan_only:
        out["command"] = f"campaign run {a.campaign} --artifacts <artifact root>"
        out["runs"] = []
        for _ in range(2 if a.again else 1):
            started = time.time()
            code, wall, lines = _campaign("run", a.campaign, "--artifacts", str(artifacts))
            out["runs"].append(
                {
                    "exit_code": code,
                    "wall_s": wall,
                    "stdout": [line.replace(str(artifacts), ROOT_MARK) for line in lines],
                    "report": latest_report(artifacts, name, started),
                }
            )
        out["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    text = json.dumps(out, indent=2, default=str)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
