"""Run one generation job on the Ray cluster this process is part of (the command of a KubeRay ``RayJob``).

    python -m campaign_orchestrator.scaleout --job JOB.json [--address auto] [--summary OUT.json]

``JOB.json`` is a :class:`campaign_orchestrator.scaleout.job.Job`: the stage kind, the recipe a worker builds its
engine from (a teacher ``teacher:`` section, or a local model answering evaluation prompts), the prompts'
Parquet path or URI, the generation cache (store URL, namespace, spool directory), the sampling, the
``execution:`` settings, and where the rows go (``output``). The job connects with ``ray.init(address=
"auto")`` (the cluster the RayJob's submitter runs in; ``--address`` to override), runs the shards on an actor
pool of ``execution.replicas`` workers, and writes the rows to ``output`` (Parquet) and a JSON summary to
stdout (and ``--summary``). Launched under Dagster Pipes (``DAGSTER_PIPES_CONTEXT`` set), it also reports
each finished shard as a Pipes log line and the result as an asset materialization's metadata.

Exit codes: 0 done; 1 the job failed (a shard out of retries, an engine error); 2 a bad JOB.json.
Secrets are never in JOB.json: an endpoint's key is read in each worker from the environment variable the
teacher section names (``api_key_env``).
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m campaign_orchestrator.scaleout",
                                 description="Run one sharded generation job on a Ray cluster (a KubeRay RayJob's "
                                             "entry point).")
    ap.add_argument("--job", required=True, help="JOB.json: the job (campaign_orchestrator/scaleout/job.py)")
    ap.add_argument("--address", default="auto", help="Ray address to connect to (default: auto, the cluster this "
                                                      "process runs in)")
    ap.add_argument("--summary", default=None, help="also write the JSON summary to this file")
    return ap.parse_args(argv)


class _Report:
    """Pipes when launched under Dagster Pipes, stderr otherwise."""

    def __init__(self):
        import os

        from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR, open_dagster_pipes

        self.pipes = open_dagster_pipes() if os.environ.get(DAGSTER_PIPES_CONTEXT_ENV_VAR) else None

    def log(self, msg: str) -> None:
        if self.pipes is not None:
            self.pipes.log.info(msg)
        print(msg, file=sys.stderr, flush=True)

    def done(self, summary: dict) -> None:
        if self.pipes is not None:
            self.pipes.report_asset_materialization(metadata={
                k: {"raw_value": v, "type": "json"} if isinstance(v, dict | list) else v for k, v in summary.items()})

    def close(self) -> None:
        if self.pipes is not None:
            self.pipes.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from campaign_orchestrator.scaleout.job import Job

    try:
        job = Job.read(args.job)
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    from campaign_orchestrator.scaleout.pool import ShardFailed
    from campaign_orchestrator.scaleout.stage import run_job

    report = _Report()
    try:
        ray.init(address=args.address, log_to_driver=False)

        def on_shard(rep, run) -> None:
            report.log(f"shard {rep.id} done ({run.done}/{len(run.shards)}) on {rep.worker}: {rep.generated} generated, "
                       f"{rep.completion_tokens} tokens in {rep.seconds:.1f} s")

        res, run = run_job(job, log=report.log, on_shard=on_shard)
        st = res.stats
        summary = {"kind": job.kind, "output": job.output, "rows": len(res.rows), "generated": st.generated,
                   "cache_hits": st.cache_hits, "failed": st.failed, "prompt_tokens": st.new_prompt_tokens,
                   "completion_tokens": st.new_completion_tokens, "generate_seconds": st.generate_s,
                   "shards_total": len(run.shards), "shards_done": run.done, "lost_workers": run.lost_workers,
                   "nodes": run.nodes}
        print(json.dumps(summary))
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(summary | {"stats": st.as_dict(), "ray": run.as_dict()}, f, indent=2)
        report.done(summary)
        return 0
    except ShardFailed as e:
        report.log(f"job failed: {e}")
        return 1
    finally:
        report.close()
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
