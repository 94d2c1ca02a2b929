"""``campaign ladder`` and ``triage``: validate a cluster, explain slow training (``k8s-render`` is in
resources.k8s.render)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from campaign_app.cli.common import EXIT_FAILED, EXIT_INVALID, EXIT_OK, check_status, dagster_home, latest_manifest


def ladder_command(args: argparse.Namespace) -> int:
    """Run the cluster validation ladder (the ``cluster`` asset group) through Dagster."""
    dagster_home()
    from dagster import DagsterInstance

    from assets.cluster import JOB
    from assets.location import build_definitions, default_resources
    from resources.cluster import ClusterValidation

    overrides = {
        k: v
        for k, v in {
            "nodes": args.nodes,
            "processes_per_node": args.processes_per_node,
            "max_bytes": args.max_bytes,
            "train_steps": args.train_steps,
        }.items()
        if v is not None
    }
    resources = default_resources(args.artifacts) | {
        "cluster": ClusterValidation(rebaseline=args.rebaseline, **overrides)
    }
    defs = build_definitions([], artifact_root=args.artifacts, resources=resources)
    selection = None
    if args.up_to:
        from dagster import AssetKey

        from training.cluster.ladder import RUNGS

        selection = [AssetKey(["cluster", r]) for r in RUNGS[: RUNGS.index(args.up_to) + 1]]
    with DagsterInstance.get() as instance:
        result = defs.resolve_job_def(JOB).execute_in_process(
            instance=instance,
            raise_on_error=False,
            tags={"trigger": "manual"},
            asset_selection=selection,
            run_config={"loggers": {"console": {"config": {"log_level": args.log_level}}}},
        )
    checks = result.get_asset_check_evaluations()
    status = check_status
    failed = sum(status(e) == "FAIL" for e in checks)
    warned = sum(status(e) == "WARN" for e in checks)
    print(
        f"\n=== cluster validation ladder: run {'succeeded' if result.success else 'failed'}, "
        f"{len(checks) - failed - warned} check(s) passed, {warned} warning(s), {failed} failed ==="
    )
    for ev in checks:
        print(f"{status(ev):4s}  {ev.asset_key.to_user_string():32s} {ev.check_name:24s} {ev.description or ''}")
    print(f"dagster run id: {result.run_id}")
    return EXIT_OK if result.success and not failed else EXIT_FAILED


def triage_command(args: argparse.Namespace) -> int:
    """Print the profile triage of a campaign's latest training run, or of trace files/directories."""
    from resources.storage import ArtifactStore
    from training.triage import render, trace_files, triage_files

    paths = [Path(p) for p in args.target if Path(p).exists()]
    if not paths:
        latest = latest_manifest(ArtifactStore(root=args.artifacts).root_path(), args.target[0], "student_adapter")
        if latest is None:
            print(
                f"no training run of campaign {args.target[0]!r} under {args.artifacts} and no such trace path",
                file=sys.stderr,
            )
            return EXIT_INVALID
        report = Path(latest["path"]) / "profile" / "report.json"
        if not report.exists() or not json.loads(report.read_text()).get("triage"):
            print(
                f"the latest training run of {args.target[0]} was not profiled; set training.profiling.enabled: true",
                file=sys.stderr,
            )
            return EXIT_INVALID
        print(render(json.loads(report.read_text())["triage"]))
        return EXIT_OK
    files = [f for p in paths for f in trace_files(p)]
    print(render(triage_files(files)))
    return EXIT_OK


def add_parsers(sub) -> None:
    """Register this group's commands on the ``campaign`` parser."""
    lad = sub.add_parser("ladder", help="validate the cluster: environment, all-reduce, bandwidth, tiny training, gate")
    lad.add_argument("--artifacts", default="artifacts")
    lad.add_argument("--nodes", type=int)
    lad.add_argument("--processes-per-node", type=int)
    lad.add_argument("--max-bytes", help="largest message of the bandwidth sweep (e.g. 1M, 16M, 8G)")
    lad.add_argument("--train-steps", type=int)
    lad.add_argument("--rebaseline", action="store_true", help="record this run as the new baseline")
    lad.add_argument(
        "--up-to",
        choices=["environment", "allreduce_smoke", "collective_bandwidth", "tiny_training", "eval_gate"],
        help="run the rungs up to this one only",
    )
    lad.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    lad.set_defaults(fn=ladder_command)
    tri = sub.add_parser("triage", help="why is training slow: triage a campaign's profiled run or trace files")
    tri.add_argument("target", nargs="+", help="campaign name, or trace files / directories")
    tri.add_argument("--artifacts", default="artifacts")
    tri.set_defaults(fn=triage_command)
