"""Dagster asset factories, one module per asset key. Thin: read the spec, call a plain module or a
resource, write files, return metadata. Nothing here imports torch at module level.

A campaign's graph, in pipeline order, and the library module that does each asset's work:

=====================  =========================================================================
asset (module)         work done by
=====================  =========================================================================
prompts                campaign_orchestrator.dataset.prompts (sources: .triggers.sources)
teacher_generations    campaign_orchestrator.generation (runner, cache, backends; resources.teacher)
distillation_set       campaign_orchestrator.dataset.filtering (scorer: evaluation.scorers), .decontamination
tokenized_dataset      campaign_orchestrator.dataset.tokenize (formatting, packing, topk)
hparam_sweep           campaign_orchestrator.sweep (Optuna; each rung a launch as below)
sweep_trial            hparam_sweep (one dynamic partition per trial, reported by the sweep step)
student_adapter        training (``python -m training`` through resources.training_launcher)
evaluation             evaluation (runner, suite, gate, report; local generation: .generation.local; lm_eval suites:
harness)
promoted_model         evaluation.approval
campaign_cost          resources.pricing (the cost report and dashboard; every asset prices through it)
drift_evaluation       evaluation.drift (automation group: sensors.py, plain logic in .triggers)
=====================  =========================================================================

Beside them: ``demo_models`` (campaign_orchestrator.demo.build), ``cluster`` (the validation ladder,
training.cluster), ``invalid_campaigns`` (a broken campaign file, campaigns.loader).
``location.py`` builds the ``Definitions``; ``sensors.py`` and ``versions.py`` add the campaigns'
sensors, schedules and code versions; ``common.py``, ``io_manager.py``, ``progress.py``,
``perf_metadata.py``, ``tracking.py`` (MLflow) and ``harness.py`` (lm_eval suites, for evaluation and distillation_set)
are
shared helpers.
"""
