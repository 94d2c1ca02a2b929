"""``campaign costs`` and ``dashboard``: spend from the cost ledger."""

from __future__ import annotations

import argparse
import sys

from campaign_app.cli.common import EXIT_INVALID, EXIT_OK, resolve_spec


def costs_command(args: argparse.Namespace) -> int:
    from campaign_orchestrator.costs.report import money
    from resources.pricing import STAGE_KIND, PricingResource
    from resources.storage import ArtifactStore

    ledger = PricingResource().ledger_at(ArtifactStore(root=args.artifacts).root_path())
    if args.sql:
        import duckdb

        try:
            rows = ledger.user_query(args.sql)
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
        unknown = ledger.unknown(name)  # an unpriced teacher: its spend is unknown, never $0
        total = (f"unknown ({'; '.join(f'{a} {why}' for a, why in unknown.items())}; priced stages "
                 f"{money(ledger.spent(name))})" if unknown else money(ledger.spent(name)))
        print(f"\ncampaign {name}: {total} in {len(runs)} run(s)")
        print(f"  {'run':36s} {'first record (UTC)':19s} {'spent':>11s} {'teacher':>11s} {'training':>11s} "
              f"{'evaluation':>11s} {'stopped':>11s}")
        for r in runs:
            kinds = {STAGE_KIND.get(part.split(":")[0].strip(), "") for part in (r["unknown"] or "").split(";")}

            def col(key: str, kind: str | None = None, r=r, kinds=kinds) -> str:
                return "unknown" if r["unknown"] and (kind is None or kind in kinds) else money(r[key])

            print(f"  {r['run_id']:36s} {str(r['started_at'])[:19]:19s} {col('usd'):>11s} "
                  f"{col('teacher_usd', 'teacher'):>11s} {col('training_usd', 'training'):>11s} {col('evaluation_usd', 'evaluation'):>11s} "
                  f"{money(r['interrupted_usd']):>11s}")
            if r["unknown"]:
                print(f"    unknown: {r['unknown']} (priced stages {money(r['usd'])})")
    return EXIT_OK


def dashboard_command(args: argparse.Namespace) -> int:
    from campaign_orchestrator.costs.dashboard import write_dashboard
    from resources.pricing import PricingResource, latest_sweep
    from resources.storage import ArtifactStore

    spec = resolve_spec(args.campaign)
    if spec is None:
        return EXIT_INVALID
    root = ArtifactStore(root=args.artifacts).root_path()
    path = write_dashboard(root / spec.name / "campaign_cost" / "dashboard.html", spec.name,
                           PricingResource().ledger_at(root), spec.cost.budget_usd, sweep=latest_sweep(spec, root))
    print(path)
    return EXIT_OK


def add_parsers(sub) -> None:
    """Register this group's commands on the ``campaign`` parser."""
    c = sub.add_parser("costs", help="spend per run from the cost ledger, or any SQL query on it")
    c.add_argument("campaign", nargs="?", help="one campaign (default: every campaign in the ledger)")
    c.add_argument("--sql", help="a query over the ledger's tables cost_lines, materializations and cost_reports, e.g. "
                   "\"SELECT kind, SUM(usd) AS usd ... GROUP BY kind\" (the table after FROM)")
    c.add_argument("--artifacts", default="artifacts")
    c.set_defaults(fn=costs_command)
    d = sub.add_parser("dashboard", help="write the campaign's cost dashboard (HTML) from the ledger")
    d.add_argument("campaign")
    d.add_argument("--artifacts", default="artifacts")
    d.set_defaults(fn=dashboard_command)
