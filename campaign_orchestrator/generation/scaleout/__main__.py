"""Run one generation job on the Ray cluster this process is part of (the command of a KubeRay ``RayJob``).

    python -m campaign_orchestrator.generation.scaleout --job JOB.json [--address auto] [--summary OUT.json]

``JOB.json`` is a :class:`campaign_orchestrator.generation.scaleout.job.Job`: the stage kind, the recipe a worker builds
its
engine from (a teacher ``teacher:`` section, or a local model answering evaluation prompts), the prompts'
Parquet path or URI, the generation cache (store URL, namespace, spool directory), the sampling, the
``execution:`` settings, and where the rows go (``output``). The job connects with ``ray.init(address=
"auto")`` (the cluster the RayJob's submitter runs in; ``--address`` to override), runs the shards on an actor
pool of ``execution.replicas`` workers, and writes the rows to ``output`` (Parquet) and a JSON summary to
stdout (and ``--summary``: with ``stats``, the stage's :class:`GenerationStats`, and ``ray``, every shard's report).
Launched under Dagster Pipes (``DAGSTER_PIPES_CONTEXT`` set, as the KubeRay launcher does), it also reports
finished shards as Pipes log lines (at most ~50 a job, every retried or failing one), the result as an asset
materialization's metadata, and two custom messages the launcher charges to the stage's budget guard: once the
cache has been looked up, ``{"kind": "ray_plan", "share": <part of the distinct requests still to pay for>}``
(the guard's deferred planner estimate), and per finished shard ``{"kind": "ray_shard", "shard", "generated",
"failed", "prompt_tokens", "completion_tokens", "seconds", "final"}`` (``final``: every shard is done).

Exit codes: 0 done; 1 the job failed (a shard out of retries, an engine error); 2 a bad JOB.json.
Secrets are never in JOB.json: an endpoint's key is read in each worker from the environment variable the
teacher section names (``api_key_env``).
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m campaign_orchestrator.generation.scaleout",
        description="Run one sharded generation job on a Ray cluster (a KubeRay RayJob's entry point).",
    )
    ap.add_argument("--job", required=True, help="JOB.json: the job (campaign_orchestrator/generation/scaleout/job.py)")
    ap.add_argument(
        "--address", default="auto", help="Ray address to connect to (default: auto, the cluster this process runs in)"
    )
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

    def custom(self, message: dict) -> None:
        if self.pipes is not None:
            self.pipes.report_custom_message(message)

    def done(self, summary: dict) -> None:
        if self.pipes is not None:
            self.pipes.report_asset_materialization(
                metadata={
                    k: {"raw_value": v, "type": "json"} if isinstance(v, dict | list) else v for k, v in summary.items()
                }
            )

    def close(self) -> None:
        if self.pipes is not None:
            self.pipes.close()


class _PipesBudget:
    """The budget guard as ``run_generation`` sees it (with the Ray executor), inside the cluster: the guard itself
    is the Dagster step's, so the planned share goes to it as a ``ray_plan`` message; usage is sent per finished shard
    (``ray_shard``, by ``on_shard``), not per worker poll, so ``charge`` sends nothing."""

    def __init__(self, report: _Report):
        self.report = report

    def check_planned(self, share: float = 1.0) -> None:
        self.report.custom({"kind": "ray_plan", "share": float(share)})

    def charge(self, **_usage) -> None:
        pass


def shard_message(rep, run) -> dict:
    """The ``ray_shard`` Pipes message of a finished shard: what it paid for, for the stage's budget guard."""
    return {
        "kind": "ray_shard",
        "shard": rep.id,
        "generated": rep.generated,
        "failed": rep.failed,
        "prompt_tokens": rep.prompt_tokens,
        "completion_tokens": rep.completion_tokens,
        "seconds": round(float(rep.seconds), 6),
        "shards_done": run.done,
        "shards_total": len(run.shards),
        "final": run.done == len(run.shards),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from campaign_orchestrator.generation.scaleout.job import Job

    try:
        job = Job.read(args.job)
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    from campaign_orchestrator.generation.scaleout.pool import ShardFailed
    from campaign_orchestrator.generation.scaleout.stage import run_job, worth_a_line

    report = _Report()
    try:
        ray.init(address=args.address, log_to_driver=False)

        def on_shard(rep, run) -> None:
            report.custom(shard_message(rep, run))
            if worth_a_line(rep, run):
                report.log(
                    f"shard {rep.id} done ({run.done}/{len(run.shards)}) on {rep.worker}: {rep.generated} "
                    f"generated, {rep.failed} failed, {rep.completion_tokens} tokens in {rep.seconds:.1f} s"
                )

        res, run = run_job(
            job, log=report.log, on_shard=on_shard, budget=_PipesBudget(report) if report.pipes is not None else None
        )
        st = res.stats
        summary = {
            "kind": job.kind,
            "output": job.output,
            "rows": len(res.rows),
            "generated": st.generated,
            "cache_hits": st.cache_hits,
            "failed": st.failed,
            "prompt_tokens": st.new_prompt_tokens,
            "completion_tokens": st.new_completion_tokens,
            "generate_seconds": st.generate_s,
            "shards_total": len(run.shards),
            "shards_done": run.done,
            "lost_workers": run.lost_workers,
            "nodes": run.nodes,
        }
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
