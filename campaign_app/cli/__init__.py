"""``campaign``: validate, run and inspect campaigns from the command line.

``campaign run`` materializes the campaign's job through Dagster (the same assets, resources
and checks the UI runs) against the persistent instance in ``$DAGSTER_HOME`` (default
``.dagster_home/`` in the repository), so its runs show up in ``dagster dev`` too.

One module per command group; each registers its commands (``add_parsers``).
"""

from __future__ import annotations

import argparse

from campaign_app.cli import campaigns, cluster, costs, models, review, run
from campaign_app.cli.common import EXIT_BLOCKED, EXIT_FAILED, EXIT_INVALID, EXIT_OK  # noqa: F401  (exit codes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="campaign", description="Distillation and fine-tune campaigns on Dagster.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    campaigns.add_parsers(sub)
    run.add_parsers(sub)
    costs.add_parsers(sub)
    models.add_parsers(sub)
    from resources.k8s.render import add_parser as add_k8s_render  # pure: no Kubernetes client import

    add_k8s_render(sub)
    review.add_parsers(sub)
    cluster.add_parsers(sub)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
