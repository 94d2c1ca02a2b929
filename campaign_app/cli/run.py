"""``campaign run``: materialize a campaign end to end through Dagster and print its scores, verdict and cost."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from campaign_app.cli.common import (
    EXIT_BLOCKED,
    EXIT_FAILED,
    EXIT_INVALID,
    EXIT_OK,
    dagster_home,
    latest_manifest,
    resolve_with_source,
)
from campaigns import paths


def campaign_summary(
    artifacts: Path,
    campaign: str,
    primary_suite: str,
    run_id: str | None = None,
    spec=None,
    attempted: set[str] = frozenset(),
) -> dict:
    """Scores and verdict of the campaign's latest materializations (from the manifests) and, given
    the ``spec`` and a ``run_id``, the run's cost: the full cost-per-result report from the ledger
    when the run evaluated a candidate (also when the gate blocked it, and campaign_cost was
    skipped), else what the run spent ("unknown" where an unpriced stage ran: ``attempted``, the assets
    whose steps started, tells a teacher stage that failed part-way from one that never ran)."""
    ev = latest_manifest(artifacts, campaign, "evaluation")
    out: dict = {"campaign": campaign}
    if ev:
        gate = json.loads(Path(ev["gate_path"]).read_text())
        scores = ev["scores"]
        out |= {role: scores.get(role, {}).get(primary_suite) for role in ("teacher", "base", "candidate")}
        out |= {"verdict": gate["verdict"], "reasons": gate["reasons"], "report": gate["markdown"]}
        out["diagnosis"] = (gate.get("diagnosis") or {}).get("causes", [])  # evaluation/diagnosis.py
        from campaign_orchestrator.costs.report import student_teacher_ratio

        out["student_teacher_ratio"] = student_teacher_ratio(scores, primary_suite)
        ref = (gate.get("teacher_reference") or {}).get(primary_suite) or []
        out["teacher_reference"] = [r for r in ref if r["teacher"] not in (None, "teacher")]  # several teachers
    train = latest_manifest(artifacts, campaign, "student_adapter")
    report = Path(train["path"]) / "profile" / "report.json" if train else None
    if report is not None and report.exists() and (json.loads(report.read_text()).get("triage") or {}).get("verdict"):
        t = json.loads(report.read_text())["triage"]
        out["triage"] = {
            "verdict": t["verdict"],
            "reason": t["reason"],
            "advice": t["topology_advice"],
            "traces": str(report.parent / "traces"),
        }
    promoted = latest_manifest(artifacts, campaign, "promoted_model")
    if promoted and ev and promoted.get("key") == ev.get("candidate_key"):
        out["promoted"] = promoted["adapter_path"]
    elif ev and ev.get("requires_human_review") and ev.get("verdict") == "GO":
        out["awaiting_review"] = ev["candidate_key"]
    if spec is not None and run_id is not None:
        out |= run_costs(artifacts, spec, run_id, attempted)
    return out


def run_costs(artifacts: Path, spec, run_id: str, attempted: set[str] = frozenset()) -> dict:
    """The cost report of ``run_id`` (reused from campaign_cost when it ran) or the run's spend: None
    (unknown, never $0) when the run produced something at an unknown price (an unpriced teacher),
    or ran an unpriced teacher stage that stopped before it finished."""
    from stages.pricing import Pricing, cost_report

    pricing = Pricing()
    ledger = pricing.ledger_at(artifacts)
    done = ledger.assets_materialized(spec.name, run_id)
    out: dict = {
        "run_id": run_id,
        "spent_this_run_usd": ledger.spent(spec.name, run_id=run_id),
        "spent_by_stage": ledger.spent_by_asset(spec.name, run_id),
    }
    unknown = ledger.unknown(spec.name, run_id=run_id)
    if (
        any(e.unpriced for e in spec.teachers)
        and "teacher_generations" in attempted
        and "teacher_generations" not in done
    ):
        unknown["teacher_generations"] = (
            "unknown: teacher.price is `unpriced` (the stage stopped part-way; what it was paid for is unknown)"
        )
    if unknown:
        out |= {
            "spent_known_usd": out["spent_this_run_usd"],
            "spent_this_run_usd": None,
            "spent_unknown": [f"{a} {why}" for a, why in sorted(unknown.items())],
        }
        out["spent_by_stage"] = dict(sorted((out["spent_by_stage"] | dict.fromkeys(unknown)).items()))
    if "evaluation" not in done:
        return out
    cost = latest_manifest(artifacts, spec.name, "campaign_cost")
    if cost and cost.get("run_id") == run_id:
        out["cost"] = cost
    else:  # the stage outputs this run materialized (its own or reused), as the ledger recorded them
        from campaign_orchestrator.stage_dir import StageDir

        used = ledger.run_outputs(spec.name, run_id)
        manifests = {
            r["asset"]: StageDir(artifacts, spec.name, r["asset"], r["stage_key"]).manifest()
            for r in used
            if r["stage_key"] and StageDir(artifacts, spec.name, r["asset"], r["stage_key"]).is_complete()
        }
        out["cost"] = cost_report(pricing, spec, artifacts, run_id, manifests)
    return out


def _wall_seconds(artifacts: Path | None, campaign: str, stage: str) -> float | None:
    m = latest_manifest(artifacts, campaign, stage) if artifacts is not None else None
    return (m or {}).get("wall_seconds")


def stage_outcomes(
    events, campaign: str, spent_by_stage: dict[str, float] | None = None, artifacts: Path | None = None
) -> list[dict]:
    """What each stage of the campaign did in a run, from its Dagster events: ``reused`` (a cache hit: its content
    ``key`` and the run it came from) or ran (``seconds``, the step's time; ``usd``, what this run spent on it).
    Stages in materialization order; the run's other assets (demo models) are left out."""
    from dagster import DagsterEventType

    seconds = {
        ev.step_key: ev.event_specific_data.duration_ms / 1000
        for ev in events
        if ev.event_type == DagsterEventType.STEP_SUCCESS and ev.event_specific_data is not None
    }
    out: dict[str, dict] = {}
    for ev in events:
        if ev.event_type != DagsterEventType.ASSET_MATERIALIZATION or ev.asset_key is None:
            continue
        path = ev.asset_key.path
        if len(path) != 2 or path[0] != campaign:
            continue
        md = {k: v.value for k, v in ev.step_materialization_data.materialization.metadata.items()}
        out[path[1]] = {
            "stage": path[1],
            "reused": bool(md.get("reused", False)),
            "key": md.get("content_key"),
            "from_run": md.get("reused_from_run"),
            # a step a blocking check failed has no success event: its own time is in its manifest
            "seconds": seconds[ev.step_key] if ev.step_key in seconds else _wall_seconds(artifacts, campaign, path[1]),
            "usd": (spent_by_stage or {}).get(path[1], 0.0),
        }  # None: unknown (an unpriced teacher)
    return list(out.values())


def mark_carried(outcomes: list[dict], artifacts: Path, campaign: str, run_id: str) -> None:
    """Each stage the run produced from work an earlier run paid for (a re-judgement of stored answers) gets
    ``carried_from``: that run (the ledger's ``carried_from``); it spent nothing on it."""
    from stages.pricing import Pricing

    carried = Pricing().ledger_at(artifacts).carried_from(campaign, run_id)
    for o in outcomes:
        if not o["reused"] and o["stage"] in carried:
            o["carried_from"] = carried[o["stage"]]


def run_tags(summary: dict) -> dict[str, str]:
    """The run's verdict and what its result cost (the first tags of the UI's runs list: ``assets/common.py``), what
    the run spent and how much it reused, as run tags."""
    from assets.common import COST_TAG, VERDICT_TAG
    from campaign_orchestrator.costs.report import dollars

    stages = [o for o in summary.get("stages", []) if o["stage"] not in REPORTS]
    spent = summary.get("spent_this_run_usd", (summary.get("cost") or {}).get("spent_this_run_usd"))
    tags = {VERDICT_TAG: summary.get("verdict") or "not evaluated"}
    cost = summary.get("cost") or {}
    if "total_usd" in cost:  # the result's cost (the ledger's report; a gate-blocked result's too)
        unknown = cost["total_usd"] is None and cost.get("unknown_costs")
        tags[COST_TAG] = "unknown" if unknown else dollars(cost["total_usd"])
    tags["spent"] = "unknown" if spent is None and summary.get("spent_unknown") else dollars(spent)
    if stages:
        tags["reused"] = f"{sum(o['reused'] for o in stages)} of {len(stages)} stages"
    return tags


# A stage that carries the lines of work an earlier run paid for (the ledger's ``carried_from``): what it did, and
# what it was made from
CARRIED = {"evaluation": "re-judged"}
CARRIED_INPUT = {"evaluation": "answers"}
REPORTS = ("campaign_cost",)  # recomputed from the ledger by every run (no spend): not counted as stages


def stage_lines(outcomes: list[dict]) -> list[str]:
    """One line per stage ("reused (key …, from run …)" or "ran N s"), then a one-line summary."""
    from campaign_orchestrator.costs.report import dollars, seconds

    lines = []
    for o in outcomes:
        if o["stage"] in REPORTS:
            what = "report refreshed from the ledger (no spend)"
        elif o["reused"]:
            src = f", from run {str(o['from_run'])[:8]}" if o.get("from_run") else ""
            what = f"reused (key {o['key']}{src})"
        elif o.get("carried_from") and not o["usd"]:  # made from work an earlier run paid for
            what = f"{CARRIED.get(o['stage'], 'ran')} ({CARRIED_INPUT.get(o['stage'], 'inputs')} from run "
            what += f"{str(o['carried_from'])[:8]}), nothing spent"
        else:
            what = f"ran {seconds(o['seconds'])}" + (
                ", spent unknown (unpriced)" if o["usd"] is None else f", spent {dollars(o['usd'])}" if o["usd"] else ""
            )
        lines.append(f"  {o['stage']:20s} {what}")
    stages = [o for o in outcomes if o["stage"] not in REPORTS]
    reused = sum(o["reused"] for o in stages)
    ran = [o for o in stages if not o["reused"]]
    spent = None if any(o["usd"] is None for o in ran) else sum(o["usd"] for o in ran)
    lines.append(
        f"{reused} of {len(stages)} stages reused"
        + (f"; ran {', '.join(o['stage'] for o in ran)}" if ran else "")
        + (
            "; spend unknown (an unpriced stage ran)"
            if spent is None
            else "; nothing spent"
            if spent == 0
            else f"; spent {dollars(spent)}"
        )
    )
    return lines


def _fmt(x: float | None, pct: bool = True) -> str:
    return "n/a" if x is None else (f"{x:.1%}" if pct else f"{x:.6f}")


def print_summary(s: dict, seconds: float) -> None:
    """Scores and verdict, then (last) the cost: the cost-per-result summary from the ledger."""
    from campaign_orchestrator.costs.report import money, render_text

    print(f"\n=== campaign {s['campaign']} ({seconds:.0f} s) ===")
    score = f"{s.get('suite', 'primary suite')} ({s.get('scorer', 'score')})"  # what the score is, as the spec says
    print(f"teacher   {score}: {_fmt(s.get('teacher'))}" + ("" if s.get("teacher") is not None else " (not scored)"))
    print(f"base      {score}: {_fmt(s.get('base'))}")
    print(f"student   {score}: {_fmt(s.get('candidate'))}")
    if s.get("student_teacher_ratio") is not None:
        print(f"student ÷ teacher: {s['student_teacher_ratio']:.1%}")
    for r in s.get("teacher_reference") or []:  # several teachers: each category against the teacher that answers it
        ratio = "n/a" if r["student_teacher_ratio"] is None else f"{r['student_teacher_ratio']:.1%}"
        print(
            f"  {r['category']}: teacher {r['teacher']} {_fmt(r['teacher_score'])}, student "
            f"{_fmt(r['candidate_score'])}, student ÷ teacher {ratio}"
        )
    print(f"gate verdict: {s.get('verdict', 'not evaluated')}")
    for r in s.get("reasons", []):
        print(f"  - {r}")
    for c in s.get("diagnosis", []):
        print(f"  diagnosis: {c['cause']}: {c['evidence']}; fix: {c['fix']}")
    if s.get("triage"):
        t = s["triage"]
        print(
            f"profile triage: {t['verdict']}: {t['reason']} (traces: {t['traces']}; details: "
            f"`campaign triage {s['campaign']}`)"
        )
        print(f"  {t['advice']}")
    if s.get("promoted"):
        print(f"promoted adapter: {s['promoted']}")
    if s.get("awaiting_review"):
        print(
            f"promotion awaits human review of candidate {s['awaiting_review']}: "
            f"campaign approve {s['campaign']} --candidate {s['awaiting_review']} --by <you>"
        )
    if s.get("stages"):
        print("--- stages ---")
        for line in stage_lines(s["stages"]):
            print(line)
    if s.get("run_id"):
        print(f"dagster run id: {s['run_id']}" + (f" ({s['run_status']})" if s.get("run_status") else ""))
    c = s.get("cost")
    if c:
        print("--- cost (from the ledger) ---")
        for line in render_text(c):
            print(line)
        team = f"; the team's: {c['team_dashboard_path']}" if c.get("team_dashboard_path") else ""
        print(f"dashboard: {c['dashboard_path']}{team} (`campaign dashboard --serve` serves them over http)")
    elif "spent_this_run_usd" in s:
        parts = ", ".join(f"{k} {'unknown' if v is None else money(v)}" for k, v in s["spent_by_stage"].items())
        spent = (
            f"unknown ({'; '.join(s['spent_unknown'])}; priced stages {money(s['spent_known_usd'])})"
            if s["spent_this_run_usd"] is None
            else money(s["spent_this_run_usd"])
        )
        print(
            f"--- cost (from the ledger) ---\nspent in this run: {spent}"
            + (f" ({parts})" if parts else "")
            + "; no candidate was evaluated, so no cost per result"
        )


def run_command(args: argparse.Namespace) -> int:
    resolved = resolve_with_source(args.campaign)
    if resolved is None:
        return EXIT_INVALID
    spec, source = resolved
    from campaign_app.cli.campaigns import price_problems

    problems = price_problems(spec)
    if problems:
        print(f"invalid campaign {source}:\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return EXIT_INVALID
    dagster_home()
    try:
        return _run(args, spec, source)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before the run started or after it ended
        print("campaign run: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def _run(args: argparse.Namespace, spec, source) -> int:
    import uuid

    from dagster import DagsterInstance, DagsterRunStatus

    from assets import dagster_patches
    from assets.location import build_definitions, campaign_job_name
    from assets.run_recovery import hold_lease, lease_tags, owner_tags, reap_dead_runs
    from resources.storage import ArtifactStore

    if dagster_patches.refuse_untested_dagster("campaign run"):  # before anything runs on an untested Dagster
        return EXIT_INVALID
    dagster_patches.install()  # a wait for a pool slot sleeps, says who holds it; SIGTERM/Ctrl-C cancel the run
    defs = build_definitions([str(paths.resolve(source))], artifact_root=args.artifacts)
    job = defs.resolve_job_def(campaign_job_name(spec.name))
    run_id = str(uuid.uuid4())
    t0 = time.perf_counter()
    with DagsterInstance.get() as instance:
        # runs of this machine whose `campaign run` process died still hold their pool slots: free them
        reap_dead_runs(instance, log=lambda m: print(f"campaign run: {m}", file=sys.stderr))
        dagster_patches.bind(instance, run_id)
        with hold_lease(instance, run_id):  # how a reaper in another PID namespace knows this process lives
            result = job.execute_in_process(
                instance=instance,
                raise_on_error=False,
                run_id=run_id,
                run_config={"loggers": {"console": {"config": {"log_level": args.log_level}}}},
                tags={"trigger": "manual", "campaign": spec.name, **owner_tags(), **lease_tags()},
            )
        status = instance.get_run_by_id(run_id).status
        if instance.event_log_storage.supports_global_concurrency_limits:
            instance.event_log_storage.free_concurrency_slots_for_run(run_id)  # finished: it holds nothing
    seconds = time.perf_counter() - t0
    if status == DagsterRunStatus.CANCELED:
        signum = dagster_patches.received_signal() or signal.SIGINT
        print(
            f"campaign run: run {run_id} canceled by {signal.Signals(signum).name} after {seconds:.1f} s; "
            "its pool slots are freed and finished work is kept (run the campaign again to continue)",
            file=sys.stderr,
        )
        return 128 + signum
    primary = spec.evaluation.suites[0]
    attempted = {ev.step_key.rsplit("__", 1)[-1] for ev in result.all_events if ev.is_step_start}
    summary = campaign_summary(
        ArtifactStore(root=args.artifacts).root_path(),
        spec.name,
        primary.name,
        run_id=result.run_id,
        spec=spec,
        attempted=attempted,
    ) | {"suite": primary.name, "scorer": primary.scorer}
    if not result.success:
        for ev in result.all_events:
            if ev.is_step_failure:
                print(f"step {ev.step_key} failed: {ev.event_specific_data.error.message.strip()}", file=sys.stderr)
    blocked = bool(summary.get("verdict") and summary["verdict"] != "GO")
    if blocked:
        summary.setdefault("reasons", []).append(
            "promotion blocked by the gate (campaign_cost is skipped with it; the cost below comes from the ledger)"
        )
    summary["run_status"] = "succeeded" if result.success else "failed"
    root = ArtifactStore(root=args.artifacts).root_path()
    summary["stages"] = stage_outcomes(result.all_events, spec.name, summary.get("spent_by_stage"), root)
    mark_carried(summary["stages"], root, spec.name, run_id)
    with DagsterInstance.get() as instance:  # what a person scans the runs list for
        instance.add_run_tags(run_id, run_tags(summary))
    print_summary(summary, seconds)
    if blocked:
        return EXIT_BLOCKED
    return EXIT_OK if result.success else EXIT_FAILED


def add_parsers(sub) -> None:
    """Register this group's commands on the ``campaign`` parser."""
    r = sub.add_parser("run", help="materialize a campaign end to end through Dagster")
    r.add_argument("campaign", help="campaign name or YAML file")
    r.add_argument("--artifacts", default="artifacts", help="artifact root (default: ./artifacts)")
    r.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Dagster run log level on the console (default: INFO)",
    )
    r.set_defaults(fn=run_command)
