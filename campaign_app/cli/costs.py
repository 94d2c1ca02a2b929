"""``campaign costs`` and ``dashboard``: spend from the cost ledger."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from campaign_app.cli.common import EXIT_INVALID, EXIT_OK, resolve_spec


def costs_command(args: argparse.Namespace) -> int:
    from campaign_orchestrator.costs.report import money
    from resources.storage import ArtifactStore
    from stages.pricing import STAGE_KIND, Pricing

    ledger = Pricing().ledger_at(ArtifactStore(root=args.artifacts).root_path())
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
        total = (
            f"unknown ({'; '.join(f'{a} {why}' for a, why in unknown.items())}; priced stages "
            f"{money(ledger.spent(name))})"
            if unknown
            else money(ledger.spent(name))
        )
        print(f"\ncampaign {name}: {total} in {len(runs)} run(s)")
        print(
            f"  {'run':36s} {'first record (UTC)':19s} {'spent':>11s} {'teacher':>11s} {'training':>11s} "
            f"{'evaluation':>11s} {'stopped':>11s}"
        )
        for r in runs:
            kinds = {STAGE_KIND.get(part.split(":")[0].strip(), "") for part in (r["unknown"] or "").split(";")}

            def col(key: str, kind: str | None = None, r=r, kinds=kinds) -> str:
                return "unknown" if r["unknown"] and (kind is None or kind in kinds) else money(r[key])

            print(
                f"  {r['run_id']:36s} {str(r['started_at'])[:19]:19s} {col('usd'):>11s} "
                f"{col('teacher_usd', 'teacher'):>11s} {col('training_usd', 'training'):>11s} "
                f"{col('evaluation_usd', 'evaluation'):>11s} "
                f"{money(r['interrupted_usd']):>11s}"
            )
            if r["unknown"]:
                print(f"    unknown: {r['unknown']} (priced stages {money(r['usd'])})")
    return EXIT_OK


def dashboard_command(args: argparse.Namespace) -> int:
    """``campaign dashboard [NAME]``: write the campaign's dashboard (with NAME; its path is printed) and the team's
    dashboard across every campaign in the ledger (``<root>/dashboards/index.html``); ``--serve``: then serve
    that folder over HTTP and record where (``stages.campaign_cost.record_dashboards_url``), so the links in the UI's
    metadata follow: campaign_cost links the URL served (unless ``PricingResource.dashboard_url`` names another
    server). Without ``--port`` it serves where it served last (links already shown open again), else at 8765."""
    from campaign_orchestrator.costs.dashboard import write_dashboard, write_team_dashboard
    from resources.storage import ArtifactStore
    from stages.campaign_cost import dashboards_port
    from stages.pricing import Pricing, latest_sweep

    root = ArtifactStore(root=args.artifacts).root_path()
    ledger = Pricing().ledger_at(root)
    pages = {}
    if args.campaign:
        spec = resolve_spec(args.campaign)
        if spec is None:
            return EXIT_INVALID
        pages[spec.name] = write_dashboard(
            root / spec.name / "campaign_cost" / "dashboard.html",
            spec.name,
            ledger,
            spec.cost.budget_usd,
            sweep=latest_sweep(spec, root),
        )
    else:  # every campaign's latest page (written by its last campaign_cost or `campaign run`)
        pages = {n: root / n / "campaign_cost" / "dashboard.html" for n in ledger.campaigns()}
    team = write_team_dashboard(root, ledger, pages)
    print(pages[spec.name] if args.campaign else team)
    if args.serve:
        serve(team.parent, dashboards_port(root) if args.port is None else args.port, lambda srv: _record(root, srv))
    return EXIT_OK


def _record(root: Path, server) -> None:
    """Record the URL ``server`` serves the dashboards of ``root`` at: where the UI's links point from now on."""
    from stages.campaign_cost import record_dashboards_url

    url = f"http://127.0.0.1:{server.server_address[1]}"
    before = record_dashboards_url(root, url)
    moved = f"; links shown before point at {before} (serve there to open them)" if before not in (None, url) else ""
    print(f"campaign_cost's dashboard links point here from its next materialization{moved}", flush=True)


def serve(folder: Path, port: int, ready=None) -> None:
    """Serve ``folder`` (the dashboards) at http://127.0.0.1:PORT/ until interrupted; ``ready(server)``: called
    once it listens (tests stop it with ``server.shutdown()``)."""
    import functools
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *a) -> None:  # the terminal shows the URL, not every request
            pass

    with ThreadingHTTPServer(("127.0.0.1", port), functools.partial(Quiet, directory=str(folder))) as server:
        print(
            f"serving the cost dashboards at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C to stop)", flush=True
        )
        if ready is not None:
            ready(server)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


def add_parsers(sub) -> None:
    """Register this group's commands on the ``campaign`` parser."""
    c = sub.add_parser("costs", help="spend per run from the cost ledger, or any SQL query on it")
    c.add_argument("campaign", nargs="?", help="one campaign (default: every campaign in the ledger)")
    c.add_argument(
        "--sql",
        help="a query over the ledger's tables cost_lines, materializations and cost_reports, e.g. "
        '"SELECT kind, SUM(usd) AS usd ... GROUP BY kind" (the table after FROM)',
    )
    c.add_argument("--artifacts", default="artifacts")
    c.set_defaults(fn=costs_command)
    d = sub.add_parser(
        "dashboard",
        help="write the cost dashboards (HTML) from the ledger: the campaign's and the "
        "team's across every campaign; --serve: serve them over HTTP",
    )
    d.add_argument("campaign", nargs="?", help="one campaign (default: only the team's page)")
    d.add_argument("--artifacts", default="artifacts")
    d.add_argument("--serve", action="store_true", help="serve <artifacts>/dashboards/ at http://127.0.0.1:PORT/")
    d.add_argument(
        "--port",
        type=int,
        default=None,
        help="port for --serve (0: any free port); the UI's links follow it. Default: the port it served at last, "
        "else 8765",
    )
    d.set_defaults(fn=dashboard_command)
