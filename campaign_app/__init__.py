"""The app on top of the layers: the ``campaign`` command (``cli/``) and the Dagster code location
(``definitions.py``). It may import every other package; none imports it (pyproject.toml's
``[tool.importlinter]`` holds the layer order)."""
