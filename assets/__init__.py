"""Dagster asset factories, one module per asset key. They only adapt: each reads its slice of the spec, builds the
plain stage context from its resources (``common.stage_context``), calls its stage's ``run`` (``stages/``, the table
of what each stage's work is done by is in ``stages/__init__.py``) and turns the outcome into metadata and asset
checks, and a stage error into a Dagster ``Failure`` (``common.dagster_failures``). Nothing here imports torch, the
trainer, evaluation or the library (the contracts in pyproject.toml; no comparison on a backend, engine or executor
name: tests/assets/test_thin_assets.py).

The campaign's graph, in pipeline order: prompts, teacher_generations, distillation_set, tokenized_dataset,
hparam_sweep (with sweep_trial, one dynamic partition per trial), student_adapter, evaluation (and its blocking
``gate`` check), promoted_model, campaign_cost; drift_evaluation (automation group: sensors.py).

Beside them: ``demo_models`` (the demo's models), ``cluster`` (the validation ladder, training.cluster),
``invalid_campaigns`` (a broken campaign file, campaigns.loader). ``location.py`` builds the ``Definitions``;
``sensors.py``, ``versions.py`` and ``run_recovery.py`` add the campaigns' sensors, schedules, code versions and the
reaper; ``common.py``, ``io_manager.py`` and ``perf_metadata.py`` are shared helpers.
"""
