"""The campaign orchestrator's library, one layer above ``campaigns`` and below ``training`` and
``evaluation``: teacher generation (``teacher/``), prompts to Parquet (``dataset/``), costs
(``costs/``), the sensors' plain logic (``triggers/``), sweeps, model resolution, hardware probes and
the demo's tiny models. No Dagster import. The layer order is in pyproject.toml (``[tool.importlinter]``).
"""
