"""Profile the training loop, run node diagnostics at its end, and triage the traces.

The trainer wraps its step loop, calls :meth:`RunProfiler.step` once per optimizer step and
:meth:`RunProfiler.finish` once after the loop, on every rank (after timing the loop, so that
diagnostics do not count as training time)::

    with RunProfiler(self.spec, self.out, self.report.log) as prof:   # self.spec: TrainingSpec
        for step in ...:
            ...
            prof.step()
    seconds = time.perf_counter() - t_start
    prof.finish()

* ``training.profiling.enabled`` (off by default) starts a ``torch.profiler`` with the campaign's
  schedule (skip_first / wait / warmup / active / repeat); each rank exports one Chrome trace per
  recorded cycle to ``<output_dir>/profile/traces/rank<R>.cycle<N>.pt.trace.json`` (open it in
  Perfetto or chrome://tracing). Off, :meth:`step` does nothing and no profiler is created.
* :meth:`finish` (collective, every rank, after the loop):
  each rank triages its own traces (:mod:`training.triage`), local rank 0 of each node runs the
  diagnostics (:mod:`training.diagnostics`), everything is gathered to global rank 0 with
  ``all_gather_object`` (so no shared filesystem is needed), and rank 0 writes
  ``profile/report.json`` (trace paths, per-rank breakdown, verdict, diagnostics index) and
  ``profile/triage.md``, and logs the verdict. With ``profiling.upload_url`` every rank also
  copies its files to S3.
* If the loop raises, leaving the ``with`` block stops the profiler (the trace of the cycle in
  progress is still written, useful for the post-mortem); ``finish`` is never reached, so nothing
  collective runs while a peer may be gone.

No Dagster import; torch is imported when the context is entered.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from campaigns.spec import TrainingSpec
from training import diagnostics

REPORT = "report.json"


def _default_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class RunProfiler:
    def __init__(self, training: TrainingSpec, out_dir: str | Path, log: Callable[[str], None] | None = None):
        self.training = training
        self.spec = training.profiling
        self.dir = Path(out_dir) / "profile"
        self.log = log or _default_log
        self.report: dict[str, Any] | None = None
        self._prof = None
        self._files: list[Path] = []
        self.rank, self.world = 0, 1

    # ------------------------------------------------------------------ loop
    def __enter__(self) -> RunProfiler:
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self._clear_previous_attempt()
        if self.spec.enabled:
            from torch.profiler import ProfilerActivity, profile, schedule

            sc = self.spec.schedule
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(
                activities=activities,
                schedule=schedule(
                    skip_first=sc.skip_first, wait=sc.wait, warmup=sc.warmup, active=sc.active, repeat=sc.repeat
                ),
                on_trace_ready=self._export,
                record_shapes=self.spec.record_shapes,
                profile_memory=self.spec.profile_memory,
                with_stack=self.spec.with_stack,
            )
            self._prof.__enter__()
        return self

    def _clear_previous_attempt(self) -> None:
        """A retried run in the same (incomplete) stage directory must not show an earlier attempt's files."""
        for p in (self.dir / "traces").glob(f"rank{self.rank}.cycle*.pt.trace.json"):
            p.unlink(missing_ok=True)
        if self.rank == 0:
            for name in (REPORT, "triage.md"):
                (self.dir / name).unlink(missing_ok=True)
            shutil.rmtree(self.dir / "diagnostics", ignore_errors=True)

    def step(self) -> None:
        """Mark the end of one optimizer step (advances the profiler schedule)."""
        if self._prof is not None:
            self._prof.step()

    def _export(self, prof) -> None:
        d = self.dir / "traces"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"rank{self.rank}.cycle{len(self._files) + 1}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self._files.append(path)

    def __exit__(self, exc_type, exc, tb) -> bool:
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.__exit__(exc_type, exc, tb)
            except Exception as e:  # never hide the training error behind a profiler error
                if exc_type is None:
                    raise
                self.log(f"profiler: could not stop cleanly after the training error: {e}")
        return False

    # ------------------------------------------------------------------ end of training
    def _context(self) -> dict[str, Any]:
        t = self.training
        return {
            "nodes": t.nodes,
            "processes_per_node": t.processes_per_node,
            "sharding": t.sharding,
            "world_size": self.world,
        }

    def _mine(self) -> dict[str, Any]:
        """This rank's contribution: its trace paths, its breakdown, its node's diagnostics."""
        ident = diagnostics.node_identity()
        mine: dict[str, Any] = {
            "rank": self.rank,
            "node": ident["node"],
            "host": ident["host"],
            "traces": [str(p) for p in self._files],
            "breakdown": None,
            "notes": [],
        }
        if self._files:
            try:
                from training.triage import analyze_files

                b = analyze_files(self._files)[0]
                b.rank = self.rank
                mine["breakdown"] = b.per_step()
            except Exception as e:  # a broken trace must not break the collective that follows
                mine["notes"].append(f"rank {self.rank}: could not triage {self._files}: {type(e).__name__}: {e}")
        elif self.spec.enabled:
            mine["notes"].append(
                f"rank {self.rank}: no trace written (training ended before the profiler schedule recorded a step)"
            )
        mine["diagnostics"] = diagnostics.collect(self.training) if ident["local_rank"] == 0 else None
        if self.spec.upload_url and self._files:
            mine["upload_error"] = self._upload(self._files)
        return mine

    def _upload(self, files: list[Path]) -> str | None:
        from training.publish import upload_files

        try:
            upload_files(files, self.dir, self.upload_target())
            return None
        except Exception as e:  # noted in the report, never a training failure
            return f"rank {self.rank}: upload to {self.upload_target()} failed: {type(e).__name__}: {e}"

    def upload_target(self) -> str:
        """``<upload_url>/<campaign>/<stage>/<run key>/profile`` (the output directory's last three parts)."""
        run = "/".join(self.dir.parent.parts[-3:])
        return f"{self.spec.upload_url.rstrip('/')}/{run}/profile"

    def finish(self) -> dict[str, Any] | None:
        """Collective: triage, diagnostics, gather to rank 0; rank 0 writes and returns the report."""
        import torch.distributed as dist

        mine = self._mine()
        if self.world > 1 and dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if self.rank != 0:
            return None
        return self._write(gathered)

    def _write(self, gathered: list[dict[str, Any]]) -> dict[str, Any]:
        from training.triage import decide, render

        self.dir.mkdir(parents=True, exist_ok=True)
        nodes = [g["diagnostics"] for g in gathered if g.get("diagnostics")]
        index = diagnostics.write(nodes, self.dir / "diagnostics")
        notes = [n for g in gathered for n in g["notes"]] + [
            g["upload_error"] for g in gathered if g.get("upload_error")
        ]
        triage = None
        if self.spec.enabled:
            triage = decide([g["breakdown"] for g in gathered if g["breakdown"]], self._context())
        report = {
            "profiling_enabled": self.spec.enabled,
            "schedule": self.spec.schedule.model_dump(),
            "profile_dir": str(self.dir),
            "traces": [t for g in gathered for t in g["traces"]],
            "upload_url": self.upload_target() if self.spec.upload_url else None,
            "triage": triage,
            "diagnostics": index,
            "diagnostics_summary": diagnostics.summary_line(index),
            "distributed_env": diagnostics.distributed_env(self.training),
            "world_size": self.world,
            "notes": notes,
        }
        (self.dir / REPORT).write_text(json.dumps(report, indent=2, default=str))
        if triage is not None:
            text = render(triage)
            (self.dir / "triage.md").write_text(text + "\n")
            self.log("profile triage:\n" + text)
        self.log(f"diagnostics: {report['diagnostics_summary']}")
        for n in notes:
            self.log(f"profiling note: {n}")
        if self.spec.upload_url:
            extra = [p for p in self.dir.rglob("*") if p.is_file() and "traces" not in p.relative_to(self.dir).parts]
            err = self._upload(extra)
            if err:
                report["notes"].append(err)
                (self.dir / REPORT).write_text(json.dumps(report, indent=2, default=str))
                self.log(f"profiling note: {err}")
        self.report = report
        return report


def read_report(out_dir: str | Path) -> dict[str, Any] | None:
    """The report a run wrote under ``<out_dir>/profile`` (None if it wrote none)."""
    p = Path(out_dir) / "profile" / REPORT
    return json.loads(p.read_text()) if p.exists() else None
