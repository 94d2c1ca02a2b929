"""``campaign build-models``: the demo models (cached)."""

from __future__ import annotations

import argparse
import json

from campaign_orchestrator.cli.common import EXIT_OK


def build_models_command(args: argparse.Namespace) -> int:
    from resources.storage import ArtifactStore
    from campaign_orchestrator.demo.build import build_demo_models

    report = build_demo_models(ArtifactStore(root=args.artifacts).root_path(), force=args.force)
    print(json.dumps(report, indent=2))
    return EXIT_OK


def add_parsers(sub) -> None:
    """Register this group's commands on the ``campaign`` parser."""
    b = sub.add_parser("build-models", help="build the demo models (cached)")
    b.add_argument("--artifacts", default="artifacts")
    b.add_argument("--force", action="store_true")
    b.set_defaults(fn=build_models_command)
