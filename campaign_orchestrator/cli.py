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

from campaign_orchestrator import paths
from campaigns.loader import CampaignError, default_campaign_files, load_campaigns, resolve_campaign

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
    home = paths.dagster_home()
    home.mkdir(parents=True, exist_ok=True)
    shipped = paths.shipped_file("dagster.yaml")
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


def campaign_summary(artifacts: Path, campaign: str, primary_suite: str, run_id: str | None = None,
                     spec=None) -> dict:
    """Scores and verdict of the campaign's latest materializations (from the manifests) and, given
    the ``spec`` and a ``run_id``, the run's cost: the full cost-per-result report from the ledger
    when the run evaluated a candidate (also when the gate blocked it, and campaign_cost was
    skipped), else what the run spent."""
    ev = _latest(artifacts, campaign, "evaluation")
    out: dict = {"campaign": campaign}
    if ev:
        gate = json.loads(Path(ev["gate_path"]).read_text())
        scores = ev["scores"]
        out |= {role: scores.get(role, {}).get(primary_suite) for role in ("teacher", "base", "candidate")}
        out |= {"verdict": gate["verdict"], "reasons": gate["reasons"], "report": gate["markdown"]}
    train = _latest(artifacts, campaign, "student_adapter")
    report = Path(train["path"]) / "profile" / "report.json" if train else None
    if report is not None and report.exists() and (json.loads(report.read_text()).get("triage") or {}).get("verdict"):
        t = json.loads(report.read_text())["triage"]
        out["triage"] = {"verdict": t["verdict"], "reason": t["reason"], "advice": t["topology_advice"],
                         "traces": str(report.parent / "traces")}
    promoted = _latest(artifacts, campaign, "promoted_model")
    if promoted and ev and promoted.get("key") == ev.get("candidate_key"):
        out["promoted"] = promoted["adapter_path"]
    elif ev and ev.get("requires_human_review") and ev.get("verdict") == "GO":
        out["awaiting_review"] = ev["candidate_key"]
    if spec is not None and run_id is not None:
        out |= run_costs(artifacts, spec, run_id)
    return out


def run_costs(artifacts: Path, spec, run_id: str) -> dict:
    """The cost report of ``run_id`` (reused from campaign_cost when it ran) or the run's spend."""
    from resources.pricing import PricingResource, cost_report

    pricing = PricingResource()
    ledger = pricing.ledger_at(artifacts)
    done = {r["asset"] for r in ledger.query("SELECT DISTINCT asset FROM materializations WHERE campaign = ? AND run_id = ?",
                                             [spec.name, run_id])}
    out: dict = {"run_id": run_id, "spent_this_run_usd": ledger.spent(spec.name, run_id=run_id),
                 "spent_by_stage": {r["asset"]: r["usd"] for r in ledger.query(
                     "SELECT asset, SUM(usd) AS usd FROM cost_lines WHERE campaign = ? AND run_id = ? GROUP BY asset "
                     "ORDER BY asset", [spec.name, run_id])}}
    if "evaluation" not in done:
        return out
    cost = _latest(artifacts, spec.name, "campaign_cost")
    if cost and cost.get("run_id") == run_id:
        out["cost"] = cost
    else:  # the stage outputs this run materialized (its own or reused), as the ledger recorded them
        from campaign_orchestrator.stage_dir import StageDir

        used = ledger.query("SELECT asset, arg_max(stage_key, recorded_at) AS stage_key FROM materializations "
                            "WHERE campaign = ? AND run_id = ? GROUP BY asset", [spec.name, run_id])
        manifests = {r["asset"]: StageDir(artifacts, spec.name, r["asset"], r["stage_key"]).manifest() for r in used
                     if r["stage_key"] and StageDir(artifacts, spec.name, r["asset"], r["stage_key"]).is_complete()}
        out["cost"] = cost_report(pricing, spec, artifacts, run_id, manifests)
    return out


def _fmt(x: float | None, pct: bool = True) -> str:
    return "n/a" if x is None else (f"{x:.1%}" if pct else f"{x:.6f}")


def print_summary(s: dict, seconds: float) -> None:
    """Scores and verdict, then (last) the cost: the cost-per-result summary from the ledger."""
    from campaign_orchestrator.costs.report import money, render_text

    print(f"\n=== campaign {s['campaign']} ({seconds:.0f} s) ===")
    print(f"teacher   exact match: {_fmt(s.get('teacher'))}")
    print(f"base      exact match: {_fmt(s.get('base'))}")
    print(f"student   exact match: {_fmt(s.get('candidate'))}")
    print(f"gate verdict: {s.get('verdict', 'not evaluated')}")
    for r in s.get("reasons", []):
        print(f"  - {r}")
    if s.get("triage"):
        t = s["triage"]
        print(f"profile triage: {t['verdict']}: {t['reason']} (traces: {t['traces']}; details: "
              f"`campaign triage {s['campaign']}`)")
        print(f"  {t['advice']}")
    if s.get("promoted"):
        print(f"promoted adapter: {s['promoted']}")
    if s.get("awaiting_review"):
        print(f"promotion awaits human review of candidate {s['awaiting_review']}: "
              f"campaign approve {s['campaign']} --candidate {s['awaiting_review']} --by <you>")
    if s.get("run_id"):
        print(f"dagster run id: {s['run_id']}" + (f" ({s['run_status']})" if s.get("run_status") else ""))
    c = s.get("cost")
    if c:
        print("--- cost (from the ledger) ---")
        for line in render_text(c):
            print(line)
        print(f"dashboard: {c['dashboard_path']}")
    elif "spent_this_run_usd" in s:
        parts = ", ".join(f"{k} {money(v)}" for k, v in s["spent_by_stage"].items())
        print(f"--- cost (from the ledger) ---\nspent in this run: {money(s['spent_this_run_usd'])}"
              + (f" ({parts})" if parts else "") + "; no candidate was evaluated, so no cost per result")


def check_status(ev) -> str:
    """PASS, WARN or FAIL for an asset check evaluation: a failed WARN-severity check (a version change,
    an improvement to rebaseline) is reported but never fails a command."""
    from dagster import AssetCheckSeverity

    return "PASS" if ev.passed else "WARN" if ev.severity == AssetCheckSeverity.WARN else "FAIL"


def _run(args: argparse.Namespace) -> int:
    resolved = _resolve_with_source(args.campaign)
    if resolved is None:
        return EXIT_INVALID
    spec, source = resolved
    dagster_home()
    from dagster import DagsterInstance

    from assets.location import build_definitions, campaign_job_name
    from resources.storage import ArtifactStore

    defs = build_definitions([str(paths.resolve(source))],
                             artifact_root=args.artifacts)
    job = defs.resolve_job_def(campaign_job_name(spec.name))
    t0 = time.perf_counter()
    with DagsterInstance.get() as instance:
        result = job.execute_in_process(instance=instance, raise_on_error=False,
                                        run_config={"loggers": {"console": {"config": {"log_level": args.log_level}}}},
                                        tags={"trigger": "manual", "campaign": spec.name})
    seconds = time.perf_counter() - t0
    summary = campaign_summary(ArtifactStore(root=args.artifacts).root_path(), spec.name, spec.evaluation.suites[0].name,
                               run_id=result.run_id, spec=spec)
    if not result.success:
        for ev in result.all_events:
            if ev.is_step_failure:
                print(f"step {ev.step_key} failed: {ev.event_specific_data.error.message.strip()}", file=sys.stderr)
    blocked = bool(summary.get("verdict") and summary["verdict"] != "GO")
    if blocked:
        summary.setdefault("reasons", []).append("promotion blocked by the gate (campaign_cost is skipped with it; "
                                                 "the cost below comes from the ledger)")
    summary["run_status"] = "succeeded" if result.success else "failed"
    print_summary(summary, seconds)
    if blocked:
        return EXIT_BLOCKED
    return EXIT_OK if result.success else EXIT_FAILED


def _resolve_with_source(name: str):
    """(spec, source file) of a campaign name or file, or None after printing why it cannot be loaded."""
    try:
        return resolve_campaign(name)
    except CampaignError as e:
        print(f"invalid campaign:\n{e}", file=sys.stderr)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
    return None


def _resolve(name: str):
    resolved = _resolve_with_source(name)
    return None if resolved is None else resolved[0]


def _plan(args: argparse.Namespace) -> int:
    from campaign_orchestrator.costs.catalog import PricingError
    from campaign_orchestrator.costs.planner import PlanError, render_plan
    from resources.pricing import PricingResource
    from resources.storage import ArtifactStore

    spec = _resolve(args.campaign)
    if spec is None:
        return EXIT_INVALID
    root = ArtifactStore(root=args.artifacts).root_path()
    pricing = PricingResource()
    try:
        plan = pricing.plan(spec, root)
    except (PlanError, PricingError, FileNotFoundError, ValueError) as e:
        print(f"cannot plan campaign {spec.name}: {e}", file=sys.stderr)
        return EXIT_INVALID
    spent = pricing.ledger_at(root).spent(spec.name)
    plan["campaign_spent_usd"] = spent
    if args.json:
        print(json.dumps(plan, indent=2, default=str))
        return EXIT_OK
    print(render_plan(plan))
    if spent:
        print(f"already spent on campaign {spec.name} (ledger): ${spent:.6f}"
              + (f"; ${spec.cost.budget_usd - spent:.6f} of the budget remains" if spec.cost.budget_usd else ""))
    return EXIT_OK


def _costs(args: argparse.Namespace) -> int:
    from campaign_orchestrator.costs.report import money
    from resources.pricing import PricingResource
    from resources.storage import ArtifactStore

    ledger = PricingResource().ledger_at(ArtifactStore(root=args.artifacts).root_path())
    if args.sql:
        import duckdb

        try:
            rows = ledger.query(args.sql)
        except duckdb.Error as e:
            print(f"query failed: {e}", file=sys.stderr)
            return EXIT_INVALID
        if rows:
            print("\t".join(rows[0]))
            for r in rows:
                print("\t".join("" if v is None else str(v) for v in r.values()))
        return EXIT_OK
    names = [args.campaign] if args.campaign else ledger.campaigns()
    print(f"ledger: {ledger.path}")
    for name in names:
        runs = ledger.runs(name)
        print(f"\ncampaign {name}: {money(ledger.spent(name))} in {len(runs)} run(s)")
        print(f"  {'run':36s} {'first record (UTC)':19s} {'spent':>11s} {'teacher':>11s} {'training':>11s} "
              f"{'evaluation':>11s} {'stopped':>11s}")
        for r in runs:
            print(f"  {r['run_id']:36s} {str(r['started_at'])[:19]:19s} {money(r['usd']):>11s} {money(r['teacher_usd']):>11s} "
                  f"{money(r['training_usd']):>11s} {money(r['evaluation_usd']):>11s} {money(r['interrupted_usd']):>11s}")
    return EXIT_OK


def _dashboard(args: argparse.Namespace) -> int:
    from campaign_orchestrator.costs.dashboard import write_dashboard
    from resources.pricing import PricingResource
    from resources.storage import ArtifactStore

    spec = _resolve(args.campaign)
    if spec is None:
        return EXIT_INVALID
    root = ArtifactStore(root=args.artifacts).root_path()
    path = write_dashboard(root / spec.name / "campaign_cost" / "dashboard.html", spec.name,
                           PricingResource().ledger_at(root), spec.cost.budget_usd)
    print(path)
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
    from campaign_orchestrator.demo.build import build_demo_models

    report = build_demo_models(ArtifactStore(root=args.artifacts).root_path(), force=args.force)
    print(json.dumps(report, indent=2))
    return EXIT_OK


def _approve(args: argparse.Namespace) -> int:
    """Record a reviewer's approval of the campaign's latest GO candidate (see evaluation/approval.py)."""
    import getpass

    try:
        spec, _ = resolve_campaign(args.campaign)
    except (CampaignError, KeyError) as e:
        print(e.args[0] if isinstance(e, KeyError) else f"invalid campaign:\n{e}", file=sys.stderr)
        return EXIT_INVALID
    from assets.promoted_model import approval_observation, latest_evaluation
    from evaluation.approval import ApprovalError, record_approval
    from resources.storage import ArtifactStore

    storage = ArtifactStore(root=args.artifacts)
    try:
        approval, created = record_approval(spec.name, storage.campaign_dir(spec.name),
                                            latest_evaluation(storage, spec.name), args.candidate,
                                            args.by or getpass.getuser(), args.note, via="cli")
    except (ApprovalError, FileNotFoundError) as e:
        print(f"not approved: {e}", file=sys.stderr)
        return EXIT_INVALID
    if not created:
        print(f"candidate {approval.candidate_key} was already approved by {approval.approved_by} at {approval.approved_at}")
        return EXIT_OK
    dagster_home()
    from dagster import DagsterInstance

    with DagsterInstance.get() as instance:  # so the UI shows the approval on the evaluation asset
        instance.report_runless_asset_event(approval_observation(spec, approval))
    print(f"approved candidate {approval.candidate_key} of campaign {spec.name} "
          f"(by {approval.approved_by} at {approval.approved_at}); materialize {spec.name}/promoted_model to promote it")
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

        from campaign_orchestrator.cluster.ladder import RUNGS

        selection = [AssetKey(["cluster", r]) for r in RUNGS[:RUNGS.index(args.up_to) + 1]]
    with DagsterInstance.get() as instance:
        result = defs.resolve_job_def(JOB).execute_in_process(
            instance=instance, raise_on_error=False, tags={"trigger": "manual"}, asset_selection=selection,
            run_config={"loggers": {"console": {"config": {"log_level": args.log_level}}}})
    checks = result.get_asset_check_evaluations()
    status = check_status
    failed = sum(status(e) == "FAIL" for e in checks)
    warned = sum(status(e) == "WARN" for e in checks)
    print(f"\n=== cluster validation ladder: run {'succeeded' if result.success else 'failed'}, "
          f"{len(checks) - failed - warned} check(s) passed, {warned} warning(s), {failed} failed ===")
    for ev in checks:
        print(f"{status(ev):4s}  {ev.asset_key.to_user_string():32s} {ev.check_name:24s} {ev.description or ''}")
    print(f"dagster run id: {result.run_id}")
    return EXIT_OK if result.success and not failed else EXIT_FAILED


def _triage(args: argparse.Namespace) -> int:
    """Print the profile triage of a campaign's latest training run, or of trace files/directories."""
    from training.triage import render, trace_files, triage_files
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
    p = sub.add_parser("plan", help="before running: per-GPU memory, fit, teacher tokens, GPU-hours and $ per stage")
    p.add_argument("campaign", help="campaign name or YAML file")
    p.add_argument("--artifacts", default="artifacts", help="artifact root holding models and the ledger")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(fn=_plan)
    c = sub.add_parser("costs", help="spend per run from the cost ledger, or any SQL query on it")
    c.add_argument("campaign", nargs="?", help="one campaign (default: every campaign in the ledger)")
    c.add_argument("--sql", help="a query, e.g. \"SELECT kind, SUM(usd) FROM cost_lines GROUP BY kind\"")
    c.add_argument("--artifacts", default="artifacts")
    c.set_defaults(fn=_costs)
    d = sub.add_parser("dashboard", help="write the campaign's cost dashboard (HTML) from the ledger")
    d.add_argument("campaign")
    d.add_argument("--artifacts", default="artifacts")
    d.set_defaults(fn=_dashboard)
    ls = sub.add_parser("list", help="list campaigns")
    ls.set_defaults(fn=_list)
    b = sub.add_parser("build-models", help="build the demo models (cached)")
    b.add_argument("--artifacts", default="artifacts")
    b.add_argument("--force", action="store_true")
    b.set_defaults(fn=_build_models)
    from resources.k8s.render import add_parser as add_k8s_render  # pure: no Kubernetes client import

    add_k8s_render(sub)
    a = sub.add_parser("approve", help="approve a campaign's evaluated candidate (when human review is required)")
    a.add_argument("campaign", help="campaign name or YAML file")
    a.add_argument("--candidate", required=True, help="the candidate key shown in the gate report")
    a.add_argument("--by", default=None, help="reviewer name (default: the current user)")
    a.add_argument("--note", default="", help="review note")
    a.add_argument("--artifacts", default="artifacts", help="artifact root (default: ./artifacts)")
    a.set_defaults(fn=_approve)
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
