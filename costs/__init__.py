"""Pricing catalog, cost lines and cost-per-result arithmetic. Pure Python, no Dagster."""
