"""The stage layer: what each stage of a campaign does, without Dagster. Each stage module exposes one entry point,
``run(spec, inputs, ctx) -> Outcome`` (``stages/outcome.py``: the manifest handed downstream, whether the stage was
found complete, what it found on the way), and owns its content key and cache check, its choice of executor (through
``stages/executors.py: executor_for``), its budget guard, its billing and its commit. ``ctx`` is a plain
:class:`stages.context.StageContext` (store, pricing, run, log, launchers), never Dagster's context; the Dagster
assets (``assets/``) build one from their resources, call ``run`` and turn the outcome into metadata and checks,
and a stage's :class:`stages.errors.StageError` into a ``Failure``.

=====================  =========================================================================
stage (module)         work done by
=====================  =========================================================================
prompts                campaign_orchestrator.dataset.prompts (sources: .triggers.sources)
teacher_generations    campaign_orchestrator.generation (runner, cache, backends); teacher.py, executors.py
distillation_set       campaign_orchestrator.dataset.filtering, .decontamination, .replay (scorer: evaluation.scorers)
tokenized_dataset      campaign_orchestrator.dataset.tokenize (formatting, packing, topk), .checks
hparam_sweep           campaign_orchestrator.sweep (Optuna; each rung a launch: training.sweep_rung)
student_adapter        training (``python -m training`` through the context's launcher)
evaluation             evaluation (runner, suite, gate, judging, report; lm_eval suites: harness.py)
promoted_model         evaluation.approval; model_card.py (evaluation.model_card)
campaign_cost          pricing.py (cost report, dashboards: campaign_orchestrator.costs)
drift_evaluation       evaluation.drift
=====================  =========================================================================

Shared: ``common.py`` (content keys, model identity), ``context.py``, ``errors.py``, ``outcome.py``, ``storage.py``
(the plain artifact store), ``pricing.py`` (the one door to prices, ledger, budgets, planner), ``teacher.py`` (the
teacher's identity, backend and cache), ``executors.py`` (in process, a Ray pool, a KubeRay RayJob), ``harness.py``,
``diagnosis.py``, ``model_card.py``, ``tracking.py`` (MLflow), ``versions.py`` (code versions), ``automation.py``
(what the sensors decide), ``demo_models.py``.
"""
