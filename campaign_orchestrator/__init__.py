"""The campaign orchestrator's library: everything below the five top-level packages
(``campaigns``, ``assets``, ``resources``, ``training``, ``evaluation``).

Sub-packages, from the bottom of the layer order up (``tests/test_layers.py`` enforces it):

- ``paths``, ``content``, ``stage_dir``, ``demo``: where files live, content hashes, stage
  directories keyed by them, the demo's tiny models.
- ``dataset``: prompt sources, filtering, tokenization and packing into Parquet.
- ``teacher``, ``costs``, ``triggers``: teacher generation (backends, cache, loop), cost ledger /
  planner / dashboard, the sensors' plain logic.
- ``cluster``: the cluster validation ladder.
- ``cli`` and ``definitions`` sit on top: the ``campaign`` command and the Dagster code location.
"""
