"""``campaign``: validate, run and inspect campaigns from the command line.

``campaign run`` materializes the campaign's job through Dagster (the same assets, resources
and checks the UI runs) against the persistent instance in ``$DAGSTER_HOME`` (default
``.dagster_home/`` in the repository), so its runs show up in ``dagster dev`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from campaigns.loader import REPO_ROOT, CampaignError, default_campaign_files, load_campaigns, resolve_campaign

EXIT_OK, EXIT_INVALID, EXIT_FAILED, EXIT_BLOCKED = 0, 1, 2, 3


def _validate(args: argparse.Namespace) -> int:
    files = args.files or default_campaign_files()
    missing = [f for f in files if not Path(f).exists()]
    loaded = load_campaigns([f for f in files if Path(f).exists()])
    for name, src in loaded.sources.items():
        print(f"ok       {src}  (campaign {name})")
    for f in missing:
        print(f"invalid  {f}: no such file")
    for err in loaded.errors:
        print(f"invalid  {err.path}")
        for line in err.render().splitlines():
            print(f"  {line}")
    bad = len(loaded.errors) + len(missing)
    print(f"\n{len(loaded.campaigns)} valid, {bad} invalid")
    return EXIT_INVALID if bad else EXIT_OK


def dagster_home() -> Path:
    home = Path(os.environ.get("DAGSTER_HOME") or REPO_ROOT / ".dagster_home").resolve()
    home.mkdir(parents=True, exist_ok=True)
    shipped = REPO_ROOT / "dagster.yaml"
    if not (home / "dagster.yaml").exists():
        if shipped.exists():
            shutil.copy(shipped, home / "dagster.yaml")
        else:
            (home / "dagster.yaml").write_text("# Dagster instance settings (empty: local SQLite storage here)\n")
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def _latest(artifacts: Path, campaign: str, stage: str) -> dict | None:
    p = artifacts / campaign / stage / "LATEST.json"
    return json.loads(p.read_text()) if p.exists() else None


def campaign_summary(artifacts: Path, campaign: str, primary_suite: str) -> dict:
    """Scores, verdict and cost of the campaign's latest materializations (from the manifests)."""
    from costs.report import cost_per_result

    ev = _latest(artifacts, campaign, "evaluation")
    gen = _latest(artifacts, campaign, "teacher_generations")
    dist = _latest(artifacts, campaign, "distillation_set")
    out: dict = {"campaign": campaign}
    if ev:
        gate = json.loads(Path(ev["gate_path"]).read_text())
        scores = ev["scores"]
        out |= {role: scores.get(role, {}).get(primary_suite) for role in ("teacher", "base", "candidate")}
        out |= {"verdict": gate["verdict"], "reasons": gate["reasons"], "report": gate["markdown"]}
    stages = {s: _latest(artifacts, campaign, s) for s in
              ("teacher_generations", "distillation_set", "tokenized_dataset", "student_adapter", "evaluation")}
    if all(stages.values()):
        out["cost"] = cost_per_result(stages, dist["rows"], gen["prompt_tokens"] + gen["completion_tokens"],
                                      out.get("candidate"), out.get("base"))
    train = stages.get("student_adapter")
    report = Path(train["path"]) / "profile" / "report.json" if train else None
    if report is not None and report.exists() and (json.loads(report.read_text()).get("triage") or {}).get("verdict"):
        t = json.loads(report.read_text())["triage"]
        out["triage"] = {"verdict": t["verdict"], "reason": t["reason"], "advice": t["topology_advice"],
                         "traces": str(report.parent / "traces")}
    promoted = _latest(artifacts, campaign, "promoted_model")
    if promoted and ev and promoted.get("key") == ev.get("candidate_key"):
        out["promoted"] = promoted["adapter_path"]
    return out


def _fmt(x: float | None, pct: bool = True) -> str:
    return "n/a" if x is None else (f"{x:.1%}" if pct else f"{x:.6f}")


def print_summary(s: dict, seconds: float) -> None:
    print(f"\n=== campaign {s['campaign']} ({seconds:.0f} s) ===")
    print(f"teacher   exact match: {_fmt(s.get('teacher'))}")
    print(f"base      exact match: {_fmt(s.get('base'))}")
    print(f"student   exact match: {_fmt(s.get('candidate'))}")
    print(f"gate verdict: {s.get('verdict', 'not evaluated')}")
    for r in s.get("reasons", []):
        print(f"  - {r}")
    c = s.get("cost")
    if c:
        per_point = c["usd_per_point_gained"]
        print(f"cost: total ${c['total_usd']:.6f} (teacher ${c['teacher_usd']:.6f}, training ${c['training_usd']:.6f}, "
              f"evaluation ${c['evaluation_usd']:.6f})")
        print(f"cost per result: ${c['usd_per_1k_accepted_examples'] or 0:.6f} per 1k accepted examples; "
              f"${c['usd_per_million_teacher_tokens'] or 0:.6f} per M teacher tokens; "
              + (f"${per_point:.6f} per point gained over base" if per_point is not None
                 else "per point gained: not meaningful (no gain over base)"))
    if s.get("triage"):
        t = s["triage"]
        print(f"profile triage: {t['verdict']}: {t['reason']} (traces: {t['traces']}; details: "
              f"`python -m campaigns.cli triage {s['campaign']}`)")
        print(f"  {t['advice']}")
    if s.get("promoted"):
        print(f"promoted adapter: {s['promoted']}")


def _run(args: argparse.Namespace) -> int:
    try:
        spec, source = resolve_campaign(args.campaign)
    except CampaignError as e:
        print(f"invalid campaign:\n{e}", file=sys.stderr)
        return EXIT_INVALID
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return EXIT_INVALID
    dagster_home()
    from dagster import DagsterInstance

    from assets.location import build_definitions, campaign_job_name
    from resources.storage import ArtifactStore

    defs = build_definitions([str(REPO_ROOT / source) if not Path(source).is_absolute() else source],
                             artifact_root=args.artifacts)
    job = defs.resolve_job_def(campaign_job_name(spec.name))
    t0 = time.perf_counter()
    with DagsterInstance.get() as instance:
        result = job.execute_in_process(instance=instance, raise_on_error=False,
                                        run_config={"loggers": {"console": {"config": {"log_level": args.log_level}}}},
                                        tags={"trigger": "manual", "campaign": spec.name})
    seconds = time.perf_counter() - t0
    summary = campaign_summary(ArtifactStore(root=args.artifacts).root_path(), spec.name, spec.evaluation.suites[0].name)
    print_summary(summary, seconds)
    print(f"dagster run id: {result.run_id} ({'success' if result.success else 'failure'})")
    if summary.get("verdict") and summary["verdict"] != "GO":
        print("promotion blocked by the gate.")
        return EXIT_BLOCKED
    if not result.success:
        for ev in result.all_events:
            if ev.is_step_failure:
                print(f"step {ev.step_key} failed: {ev.event_specific_data.error.message.strip()}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    loaded = load_campaigns()
    for name, src in loaded.sources.items():
        print(f"{name:24s} {src}")
    for e in loaded.errors:
        print(f"{'(invalid)':24s} {e.path}")
    return EXIT_OK


def _build_models(args: argparse.Namespace) -> int:
    from resources.storage import ArtifactStore
    from tinymodels.build import build_demo_models

    report = build_demo_models(ArtifactStore(root=args.artifacts).root_path(), force=args.force)
    print(json.dumps(report, indent=2))
    return EXIT_OK


def _ladder(args: argparse.Namespace) -> int:
    """Run the cluster validation ladder (the ``cluster`` asset group) through Dagster."""
    dagster_home()
    from dagster import DagsterInstance

    from assets.cluster import JOB
    from assets.location import build_definitions, default_resources
    from resources.cluster import ClusterValidation

    overrides = {k: v for k, v in {"nodes": args.nodes, "processes_per_node": args.processes_per_node,
                                   "max_bytes": args.max_bytes, "train_steps": args.train_steps}.items() if v is not None}
    resources = default_resources(args.artifacts) | {"cluster": ClusterValidation(rebaseline=args.rebaseline, **overrides)}
    defs = build_definitions([], artifact_root=args.artifacts, resources=resources)
    selection = None
    if args.up_to:
        from dagster import AssetKey

        from perf.ladder import RUNGS

        selection = [AssetKey(["cluster", r]) for r in RUNGS[:RUNGS.index(args.up_to) + 1]]
    with DagsterInstance.get() as instance:
        result = defs.resolve_job_def(JOB).execute_in_process(
            instance=instance, raise_on_error=False, tags={"trigger": "manual"}, asset_selection=selection,
            run_config={"loggers": {"console": {"config": {"log_level": args.log_level}}}})
    checks = result.get_asset_check_evaluations()
    failed = sum(not e.passed for e in checks)
    print(f"\n=== cluster validation ladder: run {'succeeded' if result.success else 'failed'}, "
          f"{len(checks) - failed} check(s) passed, {failed} failed ===")
    for ev in checks:
        print(f"{'PASS' if ev.passed else 'FAIL':4s}  {ev.asset_key.to_user_string():32s} {ev.check_name:24s} "
              f"{ev.description or ''}")
    print(f"dagster run id: {result.run_id}")
    return EXIT_OK if result.success and not failed else EXIT_FAILED


def _triage(args: argparse.Namespace) -> int:
    """Print the profile triage of a campaign's latest training run, or of trace files/directories."""
    from perf.triage import render, trace_files, triage_files
    from resources.storage import ArtifactStore

    paths = [Path(p) for p in args.target if Path(p).exists()]
    if not paths:
        latest = _latest(ArtifactStore(root=args.artifacts).root_path(), args.target[0], "student_adapter")
        if latest is None:
            print(f"no training run of campaign {args.target[0]!r} under {args.artifacts} and no such trace path",
                  file=sys.stderr)
            return EXIT_INVALID
        report = Path(latest["path"]) / "profile" / "report.json"
        if not report.exists() or not json.loads(report.read_text()).get("triage"):
            print(f"the latest training run of {args.target[0]} was not profiled; set training.profiling.enabled: true",
                  file=sys.stderr)
            return EXIT_INVALID
        print(render(json.loads(report.read_text())["triage"]))
        return EXIT_OK
    files = [f for p in paths for f in trace_files(p)]
    print(render(triage_files(files)))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="campaign", description="Distillation and fine-tune campaigns on Dagster.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="validate campaign files (default: campaigns/*.yaml)")
    v.add_argument("files", nargs="*")
    v.set_defaults(fn=_validate)
    r = sub.add_parser("run", help="materialize a campaign end to end through Dagster")
    r.add_argument("campaign", help="campaign name or YAML file")
    r.add_argument("--artifacts", default="artifacts", help="artifact root (default: ./artifacts)")
    r.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="Dagster run log level on the console (default: INFO)")
    r.set_defaults(fn=_run)
    ls = sub.add_parser("list", help="list campaigns")
    ls.set_defaults(fn=_list)
    b = sub.add_parser("build-models", help="build the demo models (cached)")
    b.add_argument("--artifacts", default="artifacts")
    b.add_argument("--force", action="store_true")
    b.set_defaults(fn=_build_models)
    lad = sub.add_parser("ladder", help="validate the cluster: environment, all-reduce, bandwidth, tiny training, gate")
    lad.add_argument("--artifacts", default="artifacts")
    lad.add_argument("--nodes", type=int)
    lad.add_argument("--processes-per-node", type=int)
    lad.add_argument("--max-bytes", help="largest message of the bandwidth sweep (e.g. 1M, 16M, 8G)")
    lad.add_argument("--train-steps", type=int)
    lad.add_argument("--rebaseline", action="store_true", help="record this run as the new baseline")
    lad.add_argument("--up-to", choices=["environment", "allreduce_smoke", "collective_bandwidth", "tiny_training",
                                         "eval_gate"], help="run the rungs up to this one only")
    lad.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    lad.set_defaults(fn=_ladder)
    tri = sub.add_parser("triage", help="why is training slow: triage a campaign's profiled run or trace files")
    tri.add_argument("target", nargs="+", help="campaign name, or trace files / directories")
    tri.add_argument("--artifacts", default="artifacts")
    tri.set_defaults(fn=_triage)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
