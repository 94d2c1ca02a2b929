"""Benchmark (b): SIGKILL a 2,000-prompt generation at about half, then run it again.

The generation runs as ``python -m campaign_orchestrator.teacher`` (openai backend, concurrency 64) against a local
OpenAI-compatible server (50 ms per request, its own process) that counts every request it
receives and answers, per prompt. The first run is killed with SIGKILL once the server has
answered about half; the rerun must send the server exactly the requests the cache lacks, and
the final dataset must hold each prompt exactly once.

    python benchmarks/teacher_resume.py [--prompts 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from teacher_common import REPO, emit, load_average, prompts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    a = ap.parse_args()
    import pyarrow.parquet as pq

    from campaign_orchestrator.demo import cipher
    from tests.support.testserver import ServerProcess

    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    rows = prompts(a.prompts)
    src = cipher.write_jsonl(rows, work / "prompts.jsonl")
    out = work / "generations.parquet"
    env = os.environ | {"PYTHONPATH": str(REPO)}
    load0 = load_average()
    with ServerProcess("--latency-ms", "50") as srv:
        teacher = json.dumps(
            {"backend": "openai", "model": "teacher", "base_url": srv.base_url, "max_concurrency": a.concurrency}
        )
        cmd = [
            sys.executable,
            "-m",
            "campaign_orchestrator.teacher",
            "--prompts",
            str(src),
            "--teacher",
            teacher,
            "--out",
            str(out),
            "--artifacts",
            str(work / "artifacts"),
            "--quiet",
        ]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        while proc.poll() is None and srv.stats(summary=True)["ok"] < a.prompts // 2:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        first = srv.stats()
        srv.reset()
        t0 = time.perf_counter()
        rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        rerun_s = time.perf_counter() - t0
        second = srv.stats()
    if rerun.returncode != 0:
        print(rerun.stderr[-3000:], file=sys.stderr)
        return 2
    st = json.loads(rerun.stdout)
    final = pq.read_table(out, columns=["id", "completion"]).to_pylist()
    ids = [r["id"] for r in final]
    exactly_once = sorted(ids) == sorted(r["id"] for r in rows)
    correct = sum(r["completion"] == " " + ref["reference"] for r, ref in zip(final, rows, strict=True))
    missing_after_kill = a.prompts - st["cache_hits"]
    both_runs = {
        p: first["received_by_prompt"].get(p, 0) + second["received_by_prompt"].get(p, 0)
        for p in (r["prompt"] for r in rows)
    }
    paid_twice = sum(1 for n in both_runs.values() if n > 1)
    ok = exactly_once and second["received"] == missing_after_kill == st["generated"] and correct == a.prompts
    return emit(
        {
            "benchmark": "teacher_resume",
            "prompts": a.prompts,
            "concurrency": a.concurrency,
            "first_run_server_answered": first["ok"],
            "first_run_server_received": first["received"],
            "cached_when_killed": st["cache_hits"],
            "recovered_from_spool": st["recovered_rows"],
            "missing_after_kill": missing_after_kill,
            "rerun_server_received": second["received"],
            "rerun_generated": st["generated"],
            "rerun_s": round(rerun_s, 2),
            "prompts_requested_in_both_runs": paid_twice,
            "note": "prompts requested in both runs = requests in flight when the client was killed (the server "
            "received them; the client never stored their answers); at most the concurrency",
            "final_rows": len(final),
            "each_prompt_exactly_once": exactly_once,
            "correct_completions": correct,
            "pass": ok,
            "load_average_before": load0,
            "load_average_after": load_average(),
        }
    )


if __name__ == "__main__":
    raise SystemExit(main())
