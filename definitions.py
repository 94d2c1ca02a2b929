"""The Dagster code location: every campaign in ``campaigns/*.yaml`` (see workspace.yaml)."""

from assets.location import build_definitions

defs = build_definitions()
