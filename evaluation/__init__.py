"""Metrics, suites, paired comparison and gate logic. Never imports Dagster."""
